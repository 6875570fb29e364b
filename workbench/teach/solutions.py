"""Reference solutions and the known non-fixes, one pair per exercise: what the grader is tested against.

Kept out of the notebooks on purpose (the learner writes their own). Each function is a step: it runs
on every rank in the exercise's slot (``ctx.rank``, ``ctx.model``, ``ctx.params``, ... as in any
scenario step). Rank side: torch and the helpers are imported inside the functions.
"""

from __future__ import annotations


# -- 01 --------------------------------------------------------------------------------------------
def ref_01(ctx) -> None:
    """After the fp16 cast: parameters and persistent buffers to bf16 (rank 0's dtype), non-persistent fp32."""
    import torch

    if ctx.rank == 0:
        return
    for module in ctx.model.modules():
        for p in module.parameters(recurse=False):
            p.data = p.data.to(torch.bfloat16)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                keep_fp32 = name in module._non_persistent_buffers_set
                module._buffers[name] = b.to(torch.float32 if keep_fp32 else torch.bfloat16)


def nonfix_01(ctx) -> None:
    """Recompute inv_freq after the wrap (slot: after ``wrap_fsdp1``): the buffer is right, the rest is not."""
    from workbench.lab.buffers import recompute_rope

    recompute_rope(ctx.model)


# -- 02 --------------------------------------------------------------------------------------------
def ref_02(ctx) -> None:
    """Rank 0 recomputes the buffers with the module's own rope init (linear scaling included), then broadcasts."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workbench.lab.buffers import sync_non_persistent_buffers

    if ctx.rank == 0:
        for module in ctx.model.modules():
            if hasattr(module, "rope_type") and hasattr(module, "inv_freq"):
                init = (module.compute_default_rope_parameters if module.rope_type == "default"
                        else ROPE_INIT_FUNCTIONS[module.rope_type])
                inv_freq, _ = init(module.config)
                module.inv_freq = inv_freq.to(ctx.device)
                module.original_inv_freq = inv_freq.clone().to(ctx.device)
    sync_non_persistent_buffers(ctx.model, ctx.device)


def nonfix_02(ctx) -> None:
    """The notebook's ``init-buffers-before-broadcast``: default rope frequencies, blind to the scaling."""
    from workbench.lab.buffers import recompute_rope, sync_non_persistent_buffers

    if ctx.rank == 0:
        recompute_rope(ctx.model)
    sync_non_persistent_buffers(ctx.model, ctx.device)


# -- 03 --------------------------------------------------------------------------------------------
def ref_03(ctx) -> None:
    """Materialise meta tensors only; real buffers (both of them) keep their values."""
    import torch

    from workbench.scenarios.to_empty_clobbers_buffers import materialize_meta_only

    torch.manual_seed(ctx.params["seed"])
    for module in ctx.model.modules():
        materialize_meta_only(module, ctx.device, poison=ctx.poison)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def nonfix_03(ctx) -> None:
    """to_empty as before, then re-zero ``expert_bias``: routing is right again, ``gate_scale`` is not."""
    import torch

    torch.manual_seed(ctx.params["seed"])
    for module in ctx.model.modules():
        module.to_empty(device=ctx.device, recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    ctx.model.router.expert_bias.zero_()


# -- 04 --------------------------------------------------------------------------------------------
def ref_04(ctx) -> None:
    """Evaluate while every rank has a batch (a MIN all-reduce of a has-data flag), then all-reduce the loss."""
    import torch
    import torch.distributed as dist

    loss_sum = torch.zeros((), device=ctx.device)
    tokens = torch.zeros((), device=ctx.device)
    it = iter(ctx.batches)
    with torch.no_grad():
        while True:
            batch = next(it, None)
            has_data = torch.tensor(0 if batch is None else 1, device=ctx.device)
            dist.all_reduce(has_data, op=dist.ReduceOp.MIN)
            if has_data.item() == 0:
                break
            batch = batch.to(ctx.device)
            n = batch[:, 1:].numel()
            loss_sum += ctx.net(input_ids=batch, labels=batch).loss.float() * n
            tokens += n
    total = torch.stack([loss_sum, tokens])
    dist.all_reduce(total)
    ctx.output("loss", total[0] / total[1])


def nonfix_04(ctx) -> None:
    """Agree on the batch count, but report each rank's own mean loss: no hang, and the ranks disagree."""
    import torch
    import torch.distributed as dist

    count = torch.tensor(len(ctx.batches), device=ctx.device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    losses = []
    with torch.no_grad():
        for batch in ctx.batches[: int(count)]:
            batch = batch.to(ctx.device)
            losses.append(ctx.net(input_ids=batch, labels=batch).loss.float())
    ctx.output("loss", torch.stack(losses).mean())


# -- 05 --------------------------------------------------------------------------------------------
def ref_05(ctx) -> None:
    """Every handle travels with its own rank's metadata; each worker slices with its own device's lists."""
    from workbench.lab.weightsync import ipc

    ctx.requests = []
    key = ipc.device_key(ctx.device, ctx.rank)
    for pk in ctx.packs:
        entry = {key: {"handle": ipc.make_handle(pk.data, pk.names[0]), "metadata": pk.metadata()}}
        gathered = ipc.gather_handles(entry, device=ctx.device)
        request = ipc.request_per_rank(gathered) if ctx.rank == 0 else None
        ctx.requests.append(ipc.broadcast_request(request, src=0, device=ctx.device))


def nonfix_05(ctx) -> None:
    """(slot: replace ``load``) Drop every tensor whose name this worker does not host: nothing lands under a
    foreign name any more, but the worker's own experts stay stale (their bytes were never addressed)."""
    import torch.distributed as dist

    from workbench.lab.weightsync import ipc, receive
    from workbench.lab.weightsync import model as wm
    from workbench.scenarios import weight_sync_rank0_metadata as colocated

    key = ipc.device_key(ctx.worker_device, ctx.worker)
    hosted = set(ctx.hosted)
    kept: list[str] = []

    def load_if_hosted(name, tensor) -> None:
        if name in hosted:
            wm.load_hf_weight(ctx._inference, name, tensor)
            kept.append(name)

    try:
        for req in ctx.requests:
            receive.update_weights_ipc(req, key, load_if_hosted, ctx.worker_device)
    finally:
        dist.barrier()
    ctx.written = kept
    colocated.expose_worker(ctx, wm.loaded_view(ctx._inference, ctx.hosted))
    ctx.note(f"worker {ctx.worker} kept {len(kept)} tensors whose names it hosts")


# -- 06 --------------------------------------------------------------------------------------------
def ref_06(ctx) -> None:
    """Cast for the sync, but routing-critical names (``e_score_correction_bias``) keep fp32, packed apart."""
    import torch

    from workbench.lab.weightsync import pack as wp

    exported = list(ctx.trainer.items())
    ctx.sent = dict(wp.cast_for_sync(exported, torch.bfloat16, wp.ROUTING_SUFFIXES))
    ctx.packs = wp.pack_for_sync(exported, torch.bfloat16, wp.ROUTING_SUFFIXES, ctx.params["bucket_bytes"])


def nonfix_06(ctx) -> None:
    """Sync everything in fp16 ("more mantissa bits"): at an offset of ~41 fp16 steps are 0.03, still too coarse."""
    import torch

    from workbench.lab.weightsync import pack as wp

    exported = list(ctx.trainer.items())
    ctx.sent = dict(wp.cast_for_sync(exported, torch.float16, ()))
    ctx.packs = wp.pack_for_sync(exported, torch.float16, (), ctx.params["bucket_bytes"])


# -- 07 --------------------------------------------------------------------------------------------
def ref_07(ctx) -> None:
    """The plan from the same chunk generator the stream uses: names, dtypes and shapes per (bucket, dtype)."""
    from workbench.scenarios.weight_sync_order_desync import make_plan

    make_plan(ctx, "one-plan", stage=1)


def nonfix_07(ctx) -> None:
    """(slot: replace ``deliver``) Check the streamed names against the plan: loud, but nothing arrives."""
    from workbench.scenarios.weight_sync_order_desync import deliver

    deliver(ctx, check=True)


# -- 08 --------------------------------------------------------------------------------------------
def ref_08(ctx) -> None:
    """Fresh conversion tasks (fresh mappings, empty spec caches) before sync 2."""
    from workbench.scenarios.weight_sync_order_desync import extractor

    ctx.extractor = extractor(ctx, "one-plan", reuse_tasks=False)


def nonfix_08(ctx) -> None:
    """(slot: after ``sync_2``) The worker copies the router bias from its own trainer stage: the worker is
    right, the mis-sized pipeline broadcast that wrote stage 0's copy still happened."""
    import torch

    from workbench.lab.weightsync import conversion as cv
    from workbench.scenarios.weight_sync_order_desync import WORKER

    if ctx.rank != WORKER:
        return
    mine = dict(ctx.inference.named_buffers())
    with torch.no_grad():
        for name, bias in cv.router_biases(ctx.trainer):
            mine[name].data = bias.detach().clone().to(mine[name].device)


# -- 11 --------------------------------------------------------------------------------------------
def ref_11(ctx) -> None:
    """to_empty and the rope buffers, then every local shard drawn after re-seeding with its shard's coordinate."""
    import torch

    from workbench.lab.buffers import recompute_rope
    from workbench.scenarios.hsdp_replicas_diverge_at_init import local_shards, shard_seed

    ctx.model.to_empty(device=ctx.device)
    recompute_rope(ctx.model)
    torch.manual_seed(shard_seed(ctx, ctx.mesh.get_local_rank("shard")))  # the same on every replica of it
    with torch.no_grad():
        for t in local_shards(ctx.model):
            t.copy_(torch.randn(t.shape) * ctx.params["std"])


def nonfix_11(ctx) -> None:
    """The variant's fill, then the replicas averaged along `replicate`: they agree, on weights nobody meant."""
    import torch
    import torch.distributed as dist

    from workbench.scenarios.hsdp_replicas_diverge_at_init import local_shards
    from workbench.teach.steps import materialize_global_rng

    materialize_global_rng(ctx)
    group = ctx.mesh.get_group("replicate")
    with torch.no_grad():
        for t in local_shards(ctx.model):
            dist.all_reduce(t, group=group)
            t.div_(dist.get_world_size(group))
