"""weight-sync-rank0-metadata: every worker slices its own buffer with rank 0's metadata.

Incident 002 (SkyRL, Megatron -> vLLM colocated, CUDA IPC). Each trainer rank packs the
tensors it exports into its own contiguous buffer and makes a handle to it; the ranks
all-gather ``{device: handle}`` and rank 0 sends one update request to every inference
worker. That request carried rank 0's ``names, dtype_names, shapes, sizes`` only. Under
expert parallelism rank ``r`` exports experts ``r*E_loc ..`` first, so its buffer lists
other names in another order, but the sizes agree: worker ``r`` cuts its own buffer with
rank 0's lists and loads rank ``r``'s experts under rank 0's expert names. Nothing raises;
the model answers with coherent garbage. Where every rank exports the same tensors in the
same order (``layout=replicated``: an FSDP-style full export, or "it worked at PP=2"),
rank 0's metadata is right for everybody and the bug is invisible.

Roles on 2 ranks: rank ``r`` is trainer rank ``r`` (expert-parallel shard ``r`` of a tiny
``DeepseekV3ForCausalLM``, 8 experts, top-2) and hosts inference worker ``(r-1) % 2``,
which lives on trainer rank ``(r-1) % 2``'s device. A CUDA IPC handle cannot be opened by
the process that made it, so the worker reading trainer rank ``w``'s buffer runs in the
other engine, on ``w``'s GPU, as vLLM's colocated workers do; on CPU the same split maps a
shared-memory segment across the two engine processes. Worker ``w`` hosts the dense
tensors and trainer rank ``w``'s experts; the experts other workers serve start right.

Steps: ``build`` (trainer model, the worker's stale copy, log-prob gap before the sync),
``pack`` (export, cast to bf16 keeping the router bias fp32, pack per dtype), ``share``
(handles all-gathered, rank 0's request broadcast), ``load`` (the worker rebuilds its
device's handle, slices, loads by name), ``check`` (log-prob gap after, routing).

Receiver: ``receiver=vllm`` (the default where vLLM imports) makes the worker a real vLLM engine
in the hosting rank's process (a tiny GLM-4.5 MoE, started from the trainer's checkpoint): the
sliced tensors go through vLLM's update protocol and ``load_weights``, the log-probs are vLLM's,
and the worker's tensors are read back from vLLM's parameters. ``receiver=workbench`` is the
stand-in (a second transformers model), for machines without vLLM.

Fix ``per-rank-metadata`` (PR #1816): each rank gathers its metadata with its handle and
every worker slices with its own device's lists.

Where the report's threshold stands: it says layouts were identical at PP=2 and diverged at
PP>2 / EP>16. The code it ran on does not show that (SkyRL's PR head 6401ef572 with
Megatron-Bridge 91a15142a, read for this scenario): the bridge walks one sorted task list on
every rank, ``broadcast_from_pp_rank`` and ``gather_from_ep_ranks`` hand every rank every
tensor under the same global names, and the extractor's bucket cuts depend on no rank, so
every GPU's buffer lists the same names at any PP and EP. The only mesh property that
separates the report's passing run (EP16/PP2) from its failing ones is expert data
parallelism (2 vs 1), and nothing in that code reads it. So the workbench does not invent a
threshold: ``layout=ep`` is the report's own description (each rank packs its shard first),
broken wherever a rank's list differs from rank 0's, i.e. at every N; ``layout=replicated``
is the export that code performs, clean at every N. ``workbench sweep
weight-sync-rank0-metadata --ranks 2,4,8 --set layout=ep,replicated`` shows both.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from workbench.lab.weightsync.defaults import DEFAULT_BUCKET_BYTES, RECEIVERS, TINY
from workbench.scenario import Scenario

if TYPE_CHECKING:
    import torch

# torch and the rank helpers are imported inside the steps, which run on the ranks: the client imports
# this module only for its declaration (tests/test_client_imports.py keeps it that way).

SCENARIO = Scenario(
    name="weight-sync-rank0-metadata",
    title=("Weight sync over CUDA IPC: every worker slices its own buffer with rank 0's metadata"
           " [vLLM's loader where it imports]"),
    doc=__doc__,
    params={**TINY, "seed": 0, "seq_len": 32, "layout": "ep", "bucket_bytes": DEFAULT_BUCKET_BYTES,
            "router_scale": 1.0, "keep_fp32_routing": True, "receiver": "auto"},
    probe=None,  # trainer, sent, worker<w> (loaded, by HF name), worker<w>_model
    incident="002_79cad179003d2dbf",
)
SCENARIO.mesh("any N >= 2 that divides n_routed_experts (expert parallel over every rank)",
              lambda n, p: p["n_routed_experts"] % n == 0)
SCENARIO.require("receiver", lambda v: v in RECEIVERS, f"must be one of {', '.join(RECEIVERS)} "
                 "(auto: vLLM where it imports, else the workbench's stand-in)")
PER_RANK = SCENARIO.fix(
    "per-rank-metadata",
    "Each rank gathers its own names/dtypes/shapes/sizes with its handle; every worker slices its buffer with "
    "its own device's metadata (PR #1816).",
)
SYNC_DTYPE = "bfloat16"  # the torch dtype the sync casts to, by name (getattr(torch, SYNC_DTYPE) on the ranks)
ROUTING_NOTE = "routing:"  # JSON notes for the client's routing view


# -- the pieces both colocated-sync scenarios step through ------------------------------------
def build(ctx) -> None:
    """Trainer model (bf16, router bias fp32) one training step ahead of the hosted worker's copy."""
    import torch

    from workbench.lab.weightsync import ipc
    from workbench.lab.weightsync import model as wm
    from workbench.lab.weightsync import vllm_role as vr

    p = ctx.params
    sync_dtype = getattr(torch, SYNC_DTYPE)
    ctx.receiver = vr.resolve(p["receiver"], ctx.device)
    ctx.config = wm.vllm_config(**p) if ctx.receiver == "vllm" else wm.tiny_config(**p)
    kw = {"router_scale": p["router_scale"]}
    ctx._trainer_model = wm.build_model(ctx.config, p["seed"], sync_dtype, ctx.device, **kw)
    ctx.tokens = wm.fixed_tokens(ctx.config, p["seq_len"], p["seed"], ctx.device)
    if ctx.receiver == "vllm":
        start_vllm(ctx)  # from the checkpoint of the last sync's policy, before the training step
    wm.training_step(ctx._trainer_model, p["seed"])
    # this trainer rank's tensors as it computes with them (native dtypes): what the sync must deliver
    ctx.trainer = dict(wm.export_hf_weights(ctx._trainer_model, ctx.rank, ctx.world_size, p["layout"]))
    ctx.worker, ctx.worker_device = ipc.worker_device(ctx.device, ctx.rank, ctx.world_size)
    # Each rank holds its own expert shard and hosts a different worker: compare those to what
    # they should hold, never to rank 0's (which has other experts and another worker).
    ctx.local("trainer", "sent", "packs", "written", f"worker{ctx.worker}", f"worker{ctx.worker}_model",
              "logprobs_before", "logprobs", "experts")
    ctx.hosted = [n for n, _ in wm.export_hf_weights(ctx._trainer_model, ctx.worker, ctx.world_size, p["layout"])]
    served_elsewhere = {n: t for n, t in wm.hf_state(ctx._trainer_model).items() if n not in set(ctx.hosted)}
    if ctx.receiver == "vllm":  # one engine holds every expert: the others' arrive in the same update
        ctx._served_elsewhere = served_elsewhere
        expose_worker(ctx, vllm_view(ctx, ctx.hosted))
    else:
        ctx._inference = wm.build_model(ctx.config, p["seed"], sync_dtype, ctx.worker_device, **kw)  # last policy
        for name, t in served_elsewhere.items():
            wm.load_hf_weight(ctx._inference, name, t)
        expose_worker(ctx, wm.loaded_view(ctx._inference, ctx.hosted))
    ctx.reference_lp = wm.token_logprobs(ctx._trainer_model, ctx.tokens)
    lp = worker_logprobs(ctx)
    gap = (lp - ctx.reference_lp).abs()
    ctx.gap_before = float(gap.mean())
    ctx.output("logprobs_before", lp, worker=ctx.worker, gap_mean=float(gap.mean()), gap_max=float(gap.max()),
               receiver=ctx.receiver)
    ctx.note(f"trainer rank {ctx.rank} (experts {_experts(ctx, ctx.rank)}); hosts inference worker {ctx.worker} "
             f"on {ctx.worker_device} (experts {_experts(ctx, ctx.worker)}); log-prob gap before the sync "
             f"{ctx.gap_before:.3g}")


def pack(ctx, keep_suffixes: tuple[str, ...]) -> None:
    """Export this trainer rank's shard, cast for the sync, bucket and pack per dtype."""
    import torch

    from workbench.lab.weightsync import pack as wp

    p = ctx.params
    sync_dtype = getattr(torch, SYNC_DTYPE)
    exported = list(ctx.trainer.items())
    ctx.sent = dict(wp.cast_for_sync(exported, sync_dtype, keep_suffixes))
    ctx.packs = wp.pack_for_sync(exported, sync_dtype, keep_suffixes, p["bucket_bytes"])
    ctx.note(f"packed {len(ctx.sent)} tensors (first {next(iter(ctx.sent))}) into {len(ctx.packs)} buffer(s): "
             + ", ".join(f"{p.data.numel()} x {p.dtype_names[0]}" for p in ctx.packs))


def share(ctx, per_rank: bool) -> None:
    """Per buffer: a handle, all-gathered with (fix) or without this rank's metadata; rank 0's request out."""
    from workbench.lab.weightsync import ipc

    ctx.requests = []
    key = ipc.device_key(ctx.device, ctx.rank)
    for pk in ctx.packs:
        entry = {key: {"handle": ipc.make_handle(pk.data, pk.names[0]), "metadata": pk.metadata()}}
        gathered = ipc.gather_handles(entry, device=ctx.device)
        req = None
        if ctx.rank == 0:
            req = ipc.request_per_rank(gathered) if per_rank else ipc.request_rank0_metadata(gathered)
        ctx.requests.append(ipc.broadcast_request(req, src=0, device=ctx.device))
    how = "each device's own metadata" if per_rank else "rank 0's metadata for every device"
    ctx.note(f"{len(ctx.requests)} update request(s) from rank 0: {len(ctx.requests[0].handles)} handles, {how}")


def load(ctx) -> None:
    """The hosted worker rebuilds its device's handles, slices them in metadata order, loads by name."""
    import torch.distributed as dist

    from workbench.lab.weightsync import ipc, receive
    from workbench.lab.weightsync import model as wm

    key = ipc.device_key(ctx.worker_device, ctx.worker)
    written: list[str] = []
    try:
        if ctx.receiver == "vllm":
            written = load_vllm(ctx, key)
        else:
            for req in ctx.requests:
                written += receive.update_weights_ipc(req, key, lambda n, t: wm.load_hf_weight(ctx._inference, n, t),
                                                      ctx.worker_device)
    finally:
        dist.barrier()  # the senders keep their buffers until every worker has loaded (SkyRL: barrier)
    ctx.written = written
    names = list(dict.fromkeys(ctx.hosted + written))
    expose_worker(ctx, vllm_view(ctx, names) if ctx.receiver == "vllm" else wm.loaded_view(ctx._inference, names))
    stray = [n for n in written if n not in set(ctx.hosted)]
    ctx.note(f"worker {ctx.worker} ({_receiver_words(ctx)}) loaded {len(written)} tensors from {key}"
             + (f"; {len(stray)} are not its own (e.g. {stray[0]})" if stray else ""))
    for name, t in wm.hf_state(ctx._trainer_model).items():  # what each tensor should hold after a right sync
        ctx.expect(f"worker{ctx.worker}_model.{_module_name(name)}", _fused_expected(ctx._trainer_model, name, t))


def check(ctx) -> None:
    """Log-prob gap after the sync; routing of the fixed tokens with the trainer's vs the worker's bias."""
    from workbench.lab.weightsync import model as wm

    lp = worker_logprobs(ctx)
    gap = (lp - ctx.reference_lp).abs()
    truth = wm.hf_state(ctx._trainer_model)
    wrong = [n for n in ctx.hosted if not _same(ctx._loaded[n], truth[n])]
    k = ctx.config.num_experts_per_tok
    bias_t = {n.rsplit(".", 1)[0]: b for n, b in wm.router_biases(ctx._trainer_model)}
    scores_w, bias_w = worker_router(ctx)
    # the trainer's picks: under vLLM, vLLM's own router scores with the trainer's fp32 bias, so the
    # difference is the bias's alone (kernel numerics cancel); under the stand-in, the trainer's forward
    scores_t = scores_w if ctx.receiver == "vllm" else wm.router_inputs(ctx._trainer_model, ctx.tokens)
    sets_t = wm.expert_sets(scores_t, bias_t, k)
    sets_w = wm.expert_sets(scores_w, bias_w, k)
    changed = {r: wm.changed_fraction(sets_t[r], sets_w[r]) for r in sets_t}
    floor = engine_floor(ctx)
    ctx.output("logprobs", lp, ref_max_abs_diff=float(gap.max()), ref_floor=float(floor.max()),
               gap_mean=float(gap.mean()), floor_mean=float(floor.mean()), gap_before=ctx.gap_before,
               worker=ctx.worker, names_wrong=len(wrong), names=len(ctx.hosted), receiver=ctx.receiver,
               presync_gap=getattr(ctx, "presync_gap", float("nan")))
    for r in sets_t:
        ctx.output(f"experts.{r}", sets_w[r].reshape(-1), worker=ctx.worker, changed_fraction=changed[r],
                   distinct_bias_trainer=wm.distinct_values(bias_t[r]),
                   distinct_bias_worker=wm.distinct_values(bias_w[r]))
        ctx.note(ROUTING_NOTE + json.dumps({
            "worker": ctx.worker, "router": r, "k": k, "trainer": sets_t[r].tolist(), "synced": sets_w[r].tolist(),
            "bias_trainer": bias_t[r].float().cpu().tolist(), "bias_synced": bias_w[r].float().cpu().tolist(),
            "score_spread": float((scores_t[r].max(-1).values - scores_t[r].min(-1).values).mean())}))
    ctx.note(f"worker {ctx.worker} ({_receiver_words(ctx)}): {len(ctx.hosted) - len(wrong)}/{len(ctx.hosted)} of its "
             f"names hold the trainer's "
             f"bytes; log-prob gap {ctx.gap_before:.3g} before, {float(gap.mean()):.3g} after (max "
             f"{float(gap.max()):.3g}"
             + (f"; vLLM serving the trainer's own weights: {float(floor.mean()):.3g} (max {float(floor.max()):.3g})"
                if ctx.receiver == "vllm" else "")
             + "); tokens with another expert set: "
             + ", ".join(f"{v:.0%}" for v in changed.values()))


def engine_floor(ctx) -> torch.Tensor:
    """Per token, how far the worker's engine is from the trainer with exactly the trainer's weights.

    vLLM's CPU kernels are not the trainer's: this is the gap they alone leave, on this CPU, measured in
    this run after the sync (what the sync left is put back). The stand-in computes like the trainer:
    no floor (NaN), the fixed rounding tolerance applies."""
    import torch

    from workbench.lab.weightsync import vllm_role as vr

    if ctx.receiver != "vllm":
        return torch.full((1,), float("nan"))
    return (vr.floor_logprobs(ctx._llm, ctx._trainer_model, ctx.tokens, ctx.config) - ctx.reference_lp).abs()


# -- the two receivers -----------------------------------------------------------------------------
def warm_vllm(cluster, timeout: float = 600.0) -> dict[int, dict]:
    """Start every rank's vLLM engine before a session (``{rank: {vllm, start_s, started_now}}``).

    An engine start takes seconds (minutes on a loaded box); inside a step it counts against the
    step's deadline. The sessions after it reuse the engine and reload every weight."""
    from workbench.lab.weightsync.vllm_role import warm

    return cluster.run(warm, timeout=timeout)


def start_vllm(ctx) -> None:
    """vLLM's engine from the trainer's checkpoint (reused engines reload it); the round trip before any sync."""
    from workbench.lab.weightsync import model as wm
    from workbench.lab.weightsync import vllm_role as vr

    ctx._llm, took = vr.engine(ctx._trainer_model)
    if took is None:
        vr.reload_all(ctx._llm, ctx._trainer_model)
    lp = vr.prompt_logprobs(ctx._llm, ctx.tokens)
    gap = (lp - wm.token_logprobs(ctx._trainer_model, ctx.tokens)).abs()
    ctx.presync_gap = float(gap.mean())
    ctx.output("logprobs_presync", lp, gap_mean=ctx.presync_gap, gap_max=float(gap.max()), receiver="vllm")
    how = f"started in {took:.1f} s" if took is not None else "reused, every weight reloaded from this checkpoint"
    ctx.note(f"vLLM {vr.vllm_version()} engine {how}; round trip before any sync (same weights): mean "
             f"|log-prob vLLM - trainer| {ctx.presync_gap:.3g}")


def load_vllm(ctx, key: str) -> list[str]:
    """vLLM's update: start, the other workers' experts, this device's slices by the request's metadata, finish."""
    from workbench.lab.weightsync import receive
    from workbench.lab.weightsync import vllm_role as vr

    written: list[str] = []
    with vr.WeightUpdate(ctx._llm) as up:
        up.update(ctx._served_elsewhere.items())
        for req in ctx.requests:
            written += receive.update_weights_ipc(req, key, lambda n, t: vr.update_one(up, n, t), ctx.worker_device)
    return written


def vllm_view(ctx, names: list[str]) -> dict[str, torch.Tensor]:
    """The worker's tensors under ``names``, read back from vLLM's parameters."""
    from workbench.lab.weightsync import vllm_role as vr

    state = vr.hf_state(ctx._llm, ctx.config)
    ctx._inference = vr.as_module(vr.fused_state(state))  # module tensors, what worker<w>_model probes
    return {n: state[n] for n in names}


def worker_logprobs(ctx) -> torch.Tensor:
    from workbench.lab.weightsync import model as wm
    from workbench.lab.weightsync import vllm_role as vr

    if ctx.receiver == "vllm":
        return vr.prompt_logprobs(ctx._llm, ctx.tokens)
    return wm.token_logprobs(ctx._inference, ctx.tokens.to(ctx.worker_device))


def worker_router(ctx) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The worker's router scores for the fixed tokens and its router biases (vLLM's own under vLLM)."""
    from workbench.lab.weightsync import model as wm
    from workbench.lab.weightsync import vllm_role as vr

    if ctx.receiver == "vllm":
        return vr.router_scores(ctx._llm, ctx.tokens), vr.router_biases(ctx._llm)
    return (wm.router_inputs(ctx._inference, ctx.tokens.to(ctx.worker_device)),
            {n.rsplit(".", 1)[0]: b for n, b in wm.router_biases(ctx._inference)})


def _receiver_words(ctx) -> str:
    return "vLLM's loader" if ctx.receiver == "vllm" else "the workbench's stand-in receiver"


# -- helpers ------------------------------------------------------------------------------------
def expose_worker(ctx, loaded: dict[str, torch.Tensor]) -> None:
    """Probe the hosted worker under its own id (``worker1.<HF name>``, ``worker1_model.<param>``).

    Rank ``r`` hosts another worker than rank ``r'``, so the same HF name on two ranks is two
    workers' tensors: named per worker, the cross-rank detectors never compare them.
    """
    ctx._loaded = loaded
    setattr(ctx, f"worker{ctx.worker}", loaded)
    setattr(ctx, f"worker{ctx.worker}_model", ctx._inference)


def _experts(ctx, rank: int) -> str:
    from workbench.lab.weightsync import model as wm

    if ctx.params["layout"] == "replicated":
        return "all"
    r = wm.owned_experts(ctx.config.n_routed_experts, rank, ctx.world_size)
    return f"{r.start}-{r.stop - 1}"


def _module_name(hf_name: str) -> str:
    from workbench.lab.weightsync import model as wm

    m = wm.EXPERT_RE.match(hf_name)
    return f"{m['prefix']}.{m['w']}" if m else hf_name


def _fused_expected(trainer, name: str, t: torch.Tensor) -> torch.Tensor:
    """The worker's module tensor a right sync leaves: the trainer's (fused experts whole)."""
    from workbench.lab.weightsync import model as wm

    m = wm.EXPERT_RE.match(name)
    return trainer.get_parameter(f"{m['prefix']}.{m['w']}").detach() if m else t.detach()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    b = b.to(device=a.device, dtype=a.dtype)
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- steps ----------------------------------------------------------------------------------------
@SCENARIO.step(name="build")
def build_step(ctx) -> None:
    """Trainer shard, the worker's stale copy, log-prob gap before the sync."""
    build(ctx)


@SCENARIO.step(name="pack")
def pack_step(ctx) -> None:
    """Export this rank's shard (its experts first), bf16 with the router bias kept fp32, pack per dtype."""
    from workbench.lab.weightsync import pack as wp

    pack(ctx, wp.ROUTING_SUFFIXES if ctx.params["keep_fp32_routing"] else ())


@SCENARIO.step(name="share")
def share_step(ctx) -> None:
    """Handles all-gathered; rank 0 sends one request (bug: with its own metadata only)."""
    share(ctx, per_rank=ctx.fix == PER_RANK)


@SCENARIO.step(name="load")
def load_step(ctx) -> None:
    """The worker rebuilds its device's handle and slices it by the request's metadata."""
    load(ctx)


@SCENARIO.step(name="check")
def check_step(ctx) -> None:
    """Log-prob gap after the sync and the routing of the fixed tokens."""
    check(ctx)
