"""Real library code on the ranks: a clean path reads clean, a planted bug reads as its mechanism,
and a call a library issued is placed at the user's line with the library's beside it (torch's own modules too:
FSDP's all-gather, DDP's reducer, DTensor's scatter).

accelerate 1.13.0's ``fsdp2_load_full_state_dict`` (the version before accelerate PR #3982) zips
rank 0's full state dict with the model's keys: one extra key on rank 0 mispairs every broadcast
after it. DTensor's ``distribute_tensor`` scatters from rank 0 while the other ranks pass no scatter
list: a correct load once read as a scatter dtype mismatch. Also: FSDP2 forward and backward,
DTensor ``redistribute``, DDP with uneven inputs and ``Join``.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb

pytestmark = pytest.mark.slow


def _llama(meta: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    return LlamaForCausalLM(config)


def _shard(model) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _accelerate_scenario() -> wb.Scenario:
    sc = wb.Scenario("accelerate-fsdp2-load", params={"sidecar": True, "backward": True}, probe=None)

    @sc.step
    def build(ctx) -> None:
        ctx.full_sd = _llama(meta=False).state_dict() if ctx.rank == 0 else {}
        if ctx.rank == 0 and ctx.params["sidecar"]:  # a sidecar entry first, as a checkpoint's extra key
            ctx.full_sd = {"sidecar.scale": torch.arange(7.0), **ctx.full_sd}
        ctx.model = _llama(meta=True)
        _shard(ctx.model)

    @sc.step
    def load(ctx) -> None:
        import types

        from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

        # the function reads one thing from its accelerator: which rank holds the full state dict
        accelerator = types.SimpleNamespace(is_main_process=ctx.rank == 0)
        fsdp2_load_full_state_dict(accelerator, ctx.model, ctx.full_sd)
        # a state dict has no non-persistent buffers: the rotary embedding's inv_freq is still on meta
        rotary = ctx.model.model.rotary_emb
        ctx.model.model.rotary_emb = type(rotary)(config=ctx.model.config)

    @sc.step
    def train(ctx) -> None:
        ids = torch.arange(16).reshape(2, 8) % 128
        loss = ctx.model(input_ids=ids, labels=ids).loss
        if ctx.params["backward"] or ctx.rank == 0:  # the planted bug: rank 1 skips its backward
            loss.backward()
        ctx.output("loss", loss.detach().reshape(1))

    return sc


ACCELERATE = _accelerate_scenario()


SLOW = 180.0  # a step's deadline here: building a transformers model can take a while under load


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, ln in enumerate(f, 1) if text in ln)


def test_accelerate_fsdp2_load_with_an_extra_key_reads_as_the_mispaired_broadcast(healthy):
    s = healthy.session(ACCELERATE, sidecar=True)
    s.deadline = SLOW  # the first transformers import on a loaded 2-core machine
    s.run(until="load")
    d = s.diagnose()
    user = f"tests/test_libraries.py:{_line('fsdp2_load_full_state_dict(accelerator, ctx.model')} load"
    # the cause first: rank 0's own exception on the sidecar key, at the user's line and accelerate's
    assert d.sentence.startswith(f"rank 0 raised AttributeError at {user} (in accelerate/utils/fsdp_utils.py:"), \
        d.sentence
    # then the mechanism: the first broadcast carries the sidecar on rank 0 and the embedding on rank 1
    assert "collectives part at group 0 call #1 in step `load` (different sizes)" in d.sentence, d.sentence
    bc = f"rank 0: broadcast #1 float32 [7] 28 B src=0 at {user} (in accelerate/utils/fsdp_utils.py:"
    assert bc in d.sentence and " fsdp2_load_full_state_dict); rank 1: " in d.sentence, d.sentence
    assert f"rank 1: broadcast #1 float32 [128, 64] 32.0 KiB src=0 at {user} (in accelerate/utils/fsdp_utils.py:" \
        in d.sentence, d.sentence
    led = s.ledger
    assert led["library_frame"].str.contains("accelerate/utils/fsdp_utils.py").all()
    assert led["user_frame"].str.endswith(user.split("/")[-1]).all()


def test_accelerate_fsdp2_load_of_the_models_keys_reads_clean_through_forward_and_backward(healthy):
    s = healthy.session(ACCELERATE, sidecar=False)
    s.deadline = SLOW
    s.run()
    d = s.diagnose()
    assert d.clean, d.sentence
    led = s.ledger
    load = led[led["step"] == "load"]
    # distribute_tensor scattered from rank 0; rank 1 passed no scatter list and is recorded as receiving
    scatter = load[load["op"] == "scatter"]
    assert len(scatter) and set(scatter[scatter["rank"] == 1]["dtypes"]) == {"float32"}
    train = led[led["step"] == "train"]
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(train["op"])  # FSDP2's own collectives
    losses = s.outputs[s.outputs["name"] == "loss"]["head"].map(lambda h: h[0]).tolist()
    assert len(losses) == 2 and losses[0] == losses[1]


def test_fsdp2_backward_on_one_rank_only_reads_as_the_all_gather_the_other_never_issued(healthy):
    s = healthy.session(ACCELERATE, sidecar=False, backward=False)
    s.deadline = SLOW
    s.run()
    d = s.diagnose()
    assert d.mechanism == "rank-missing" and d.ranks == [1] and d.step == "train", d.sentence
    assert "that rank 0 issued in step `train` (all_gather_into_tensor #" in d.sentence, d.sentence
    # FSDP2 issued it, inside the backward the user's line ran: both lines are named
    user = f"tests/test_libraries.py:{_line('loss.backward()')} train"
    assert f" at {user} (in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:" in d.sentence, d.sentence
    train = s.ledger[s.ledger["step"] == "train"]
    assert train["library_frame"].str.contains("torch/distributed/fsdp/_fully_shard/").all(), \
        train["library_frame"].unique()


def _dtensor_scenario() -> wb.Scenario:
    sc = wb.Scenario("dtensor-distribute", params={"plant": False}, probe=None)

    @sc.step
    def distribute(ctx) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ctx.world_size,))
        dtype = torch.bfloat16 if ctx.params["plant"] and ctx.rank == 1 else torch.float32
        full = torch.arange(32.0).reshape(8, 4).to(dtype) if ctx.rank == 0 else torch.empty(8, 4, dtype=dtype)
        d = distribute_tensor(full, mesh, [Shard(0)])  # scatters rank 0's rows
        ctx.output("whole", d.redistribute(mesh, [Replicate()]).to_local().float())

    return sc


DTENSOR = _dtensor_scenario()


def test_dtensor_distribute_and_redistribute_read_clean_and_a_dtype_plant_reads_as_a_mismatch(healthy):
    s = healthy.session(DTENSOR)
    s.run()
    assert s.diagnose().clean, s.diagnose().sentence
    assert set(s.ledger["op"]) >= {"scatter", "all_gather_into_tensor"}
    planted = healthy.session(DTENSOR, plant=True)
    planted.run()
    d = planted.diagnose()
    assert d.mechanism == "collective-mismatch" and "(different dtypes)" in d.sentence, d.sentence
    assert "rank 0: scatter #" in d.sentence and "rank 1: scatter #" in d.sentence and "bfloat16" in d.sentence
    # DTensor issued the scatter and the redistribute's all-gather: its line beside the user's (never the custom
    # op's autograd wrapper that sits innermost)
    user = f"tests/test_libraries.py:{_line('d = distribute_tensor(full, mesh')} distribute"
    assert f" at {user} (in torch/distributed/tensor/_collective_utils.py:" in d.sentence, d.sentence
    assert planted.ledger["library_frame"].str.contains("torch/distributed/tensor/").all(), \
        planted.ledger["library_frame"].unique()


def _ddp_scenario() -> wb.Scenario:
    sc = wb.Scenario("ddp-uneven-inputs", params={"join": True}, probe=None)

    @sc.step
    def train(ctx) -> None:
        import contextlib

        from torch import nn
        from torch.distributed.algorithms.join import Join
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = DDP(nn.Linear(4, 4))
        batches = 3 if ctx.rank == 0 else 5  # uneven inputs: rank 1 has two batches more
        with Join([model]) if ctx.params["join"] else contextlib.nullcontext():
            for _ in range(batches):
                model(torch.ones(2, 4)).sum().backward()
        ctx.output("weight", model.module.weight.detach())

    return sc


DDP_UNEVEN = _ddp_scenario()


def test_ddp_uneven_inputs_read_clean_with_join_and_as_a_missing_all_reduce_without(healthy):
    s = healthy.session(DDP_UNEVEN)
    s.run()
    assert s.diagnose().clean, s.diagnose().sentence
    bug = healthy.session(DDP_UNEVEN, join=False)
    bug.run()
    d = bug.diagnose()
    assert d.mechanism == "rank-missing" and d.ranks == [0], d.sentence
    assert d.sentence.startswith("rank 0 never issued group 0 call #"), d.sentence
    assert "that rank 1 issued in step `train` (all_reduce #" in d.sentence, d.sentence
    # DDP's reducer issued it from C++ inside the backward: autograd's line beside the user's
    user = f"tests/test_libraries.py:{_line('model(torch.ones(2, 4)).sum().backward()')} train"
    assert f" at {user} (in torch/autograd/graph.py:" in d.sentence, d.sentence
    forward = bug.ledger[bug.ledger["library_frame"].str.contains("torch/nn/parallel/distributed.py", na=False)]
    assert set(forward["op"]) == {"broadcast"}, bug.ledger["library_frame"].unique()  # DDP's buffer broadcasts
