"""A job that replaces ``torch.Tensor.__new__`` as DeepSpeed's ``zero.Init`` does (``get_new_tensor_fn_for_dtype``
in ``deepspeed/runtime/zero/partition_parameters.py``: ``new_tensor(cls, *args, **kwargs)``), then issues its
first collectives inside that block, as ``zero.Init``'s parameter broadcast does. Every line that names ``cap`` or
``wj`` is the workbench's. ``argv``: the capture's directory and its ledger mode (``calls``, ``full``).
"""

import sys

import torch
import torch.distributed as dist

import workbench.job as wj

dist.init_process_group("gloo")
cap = wj.capture(sys.argv[1], ledger=sys.argv[2], attach=None)
_orig_empty = torch.empty


def get_new_tensor_fn_for_dtype(target_fp_dtype, target_device):
    def new_tensor(cls, *args, **kwargs):  # DeepSpeed's signature: (cls, *args, **kwargs)
        if not args:
            args = (0,)
        tensor = _orig_empty(0).new_empty(*args, **kwargs)
        if tensor.is_floating_point() and target_fp_dtype is not None:
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return new_tensor


torch.Tensor.__old_new__ = torch.Tensor.__new__
torch.Tensor.__new__ = get_new_tensor_fn_for_dtype(torch.float32, None)
try:
    made = torch.Tensor(3)  # through the replaced __new__, as zero.Init's modules make their tensors
    weight = torch.full((4,), float(dist.get_rank() + 1))
    dist.broadcast(weight, src=0)
    dist.all_reduce(weight)
    dist.barrier()
finally:
    torch.Tensor.__new__ = torch.Tensor.__old_new__
print(f"rank {dist.get_rank()} weight {weight.tolist()} made {list(made.shape)}", flush=True)
cap.close()
dist.destroy_process_group()
