"""weight-sync-order-desync: the receiver's plan and the sender's stream list the weights in different orders.

Incident 002, review comment (SkyRL, Megatron -> vLLM, non-colocated NCCL broadcast).
The trainer computes a plan (``get_weight_metadata``: names, dtypes, shapes) and streams
the tensors (``extract_weights``); the packed broadcast carries bytes only, and the
receiver slices them by the plan. Keeping the fp32 router bias fp32 made a bucket hold
two dtypes: ``extract_weights`` regroups each bucket by output dtype (the bf16 chunk,
then the fp32 chunk) while ``get_weight_metadata`` still lists names in raw export order.

Roles on 2 ranks: rank 0 is trainer stage 0 and the sender (rank 0 of the transfer
group); rank 1 is trainer stage 1 (it owns the MoE layer, hence the router bias) and
the inference worker. The routed experts are expert-parallel over both trainer ranks, so
exporting them all-gathers (see ``workbench.lab.weightsync.conversion``). Because rank 1
plays both roles, the sender packs its buffers in ``stream`` and broadcasts them in
``deliver``: the same bytes and cuts as streaming, in two steps.

On N >= 4 ranks the inference workers get ranks of their own, as in the incident's
non-colocated setup: ranks ``0 .. N/2-1`` are the trainer (pipeline stages and expert
ranks folded, T = N/2, with its own process group), ranks ``N/2 .. N-1`` are inference
workers, and the transfer group is rank 0 plus every worker (each worker receives the
whole broadcast, as vLLM's workers do). The MoE layer then sits on stage T/2.

Stage 1 (``plan`` .. ``score``), silent: equal byte totals, nothing fails; every tensor
after the bias's raw position is loaded from the wrong bytes.

Stage 2 (``mirror_plan`` .. ``score_2``), the mirrored fix that drifted: the metadata
builder copies the regrouping but decides it from the dtype of tensors this rank owns.
The owner of the bias walks the bucket once per dtype, the other rank once: the owner's
extra walk starts with an expert all-gather nobody joins, and the sync hangs there.
Where it departs from the report: there the two copies of the regrouping were each right by
inspection, and the hang came from drift between two separate export passes of a 550B hybrid
MoE (EP16/PP4) that nobody pinned down; two tiny ranks have no such pass to drift, so the
drift is planted as one decision taken from rank-local dtypes. What the ranks then do is the
report's: thousands of good collectives, then one rank's extra expert all-gather that its
peer never joins (step ``mirror_plan``).

Receiver: ``receiver=vllm`` (the default where vLLM imports) makes rank 1's worker a real vLLM
engine (a tiny GLM-4.5 MoE from the worker's checkpoint): the consumer hands each sliced tensor to
vLLM's update protocol and ``load_weights``, the gap is vLLM's prompt log-probs against the
trainer's, and the names are read back from vLLM's parameters. ``receiver=workbench``: the stand-in.

Fixes: ``one-chunk-plan`` (one generator feeds metadata and stream), ``check-streamed-names``
(the sender ships each buffer's names and both sides compare them with the plan before
any bytes move: a loud error at the first mismatching index; it cannot stop a walk that
parts before anything is streamed), and both together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workbench.lab.weightsync.defaults import DEFAULT_BUCKET_BYTES, DEFAULT_THRESHOLD, RECEIVERS, TOY_SHAPE
from workbench.scenario import Scenario

if TYPE_CHECKING:
    import torch

    from workbench.lab.weightsync import conversion as cv

# torch and the rank helpers are imported inside the steps, which run on the ranks: the client imports
# this module only for its declaration (tests/test_client_imports.py keeps it that way).

SCENARIO = Scenario(
    name="weight-sync-order-desync",
    title=("Weight sync: the plan lists raw order, the stream regroups by dtype (silent), then a drifted mirror hangs"
           " [vLLM's loader where it imports]"),
    doc=__doc__,
    params={**TOY_SHAPE, "seed": 0, "bucket_bytes": DEFAULT_BUCKET_BYTES, "threshold_bytes": DEFAULT_THRESHOLD,
            "seq_len": 16, "receiver": "auto"},
    probe=["inference"],
    incident="002_79cad179003d2dbf",
)
SCENARIO.mesh("N = 2 (rank 0: stage 0 and sender; rank 1: stage 1 and the inference worker), or even N >= 4 "
              "with N/2 dividing n_routed_experts (trainer ranks 0..N/2-1, inference workers N/2..N-1)",
              lambda n, p: n == 2 or (n % 2 == 0 and p["n_routed_experts"] % (n // 2) == 0))
SCENARIO.require("receiver", lambda v: v in RECEIVERS, f"must be one of {', '.join(RECEIVERS)} "
                 "(auto: vLLM where it imports, else the workbench's stand-in)")
ONE_PLAN = SCENARIO.fix(
    "one-chunk-plan",
    "One chunk-plan generator yields the per-(bucket, dtype) chunks: the metadata takes names, dtypes and shapes "
    "from it, the stream takes the tensors, so the two are equal by construction and every rank walks alike.",
)
CHECK = SCENARIO.fix(
    "check-streamed-names",
    "Insurance: the sender broadcasts each buffer's names before its bytes and both sides compare them with the "
    "plan, failing at the first mismatching index instead of loading (it cannot stop a walk that parts earlier).",
    non_fix=True,  # loud instead of silent: the sync is still wrong
)
BOTH = SCENARIO.fix("one-chunk-plan+check-streamed-names", "Both: the plan is right and the check confirms it.")

ORDER_NOTE = "order:"  # notes carrying the plan / stream entries as JSON, for the client's order view
SENDER, WORKER = 0, 1  # on 2 ranks; see `Roles` for N >= 4
_GROUPS: dict[Any, Any] = {}  # "world" -> the world group they belong to; ranks -> this process's subgroup


@dataclass(frozen=True)
class Roles:
    """Who does what at this world size: the trainer ranks, the inference workers, and their groups."""

    trainer: tuple[int, ...]
    workers: tuple[int, ...]
    trainer_group: Any = None  # None: the world group (2 ranks: both are trainer ranks)
    transfer_group: Any = None  # None: the world group (2 ranks: the sender and the worker)

    @classmethod
    def of(cls, rank: int, world_size: int) -> Roles:
        if world_size == 2:
            return cls((0, 1), (WORKER,))
        half = world_size // 2
        trainer, workers = tuple(range(half)), tuple(range(half, world_size))
        return cls(trainer, workers, _subgroup(trainer), _subgroup((SENDER, *workers)))

    def is_trainer(self, rank: int) -> bool:
        return rank in self.trainer

    def is_worker(self, rank: int) -> bool:
        return rank in self.workers


def _subgroup(ranks: tuple[int, ...]) -> Any:
    """A process group over ``ranks``, made once per world group and reused by later sessions: every rank
    calls this in the same order (a build step), so the groups match across ranks."""
    import torch.distributed as dist

    from workbench.rank.context import new_group

    world = dist.group.WORLD
    if _GROUPS.get("world") is not world:  # a re-formed world destroyed every subgroup of the one before
        _GROUPS.clear()
        _GROUPS["world"] = world
    if ranks not in _GROUPS:
        _GROUPS[ranks] = new_group(list(ranks))
    return _GROUPS[ranks]


# -- roles ----------------------------------------------------------------------------------
def build_roles(ctx, bias_dtype: torch.dtype | None = None) -> None:
    """Trainer replica on every rank (bf16, router bias in ``bias_dtype``, default fp32; a worker keeps it as the
    reference a right sync reaches); each worker's own model."""
    import torch

    from workbench.lab.weightsync import conversion as cv
    from workbench.lab.weightsync import vllm_role as vr

    p = ctx.params
    ctx.receiver = vr.resolve(p["receiver"], ctx.device)
    ctx.config = cv.vllm_config(**p) if ctx.receiver == "vllm" else cv.toy_config(**p)
    trainer = cv.build_model(ctx.config, p["seed"], dtype=torch.bfloat16, device=ctx.device)
    for _, b in cv.router_biases(trainer):
        b.data = b.data.to(torch.float32 if bias_dtype is None else bias_dtype)
    ctx.trainer = trainer
    # Each rank is its own pipeline stage and only rank 1 hosts the inference copy: role-local.
    ctx.local("trainer", "inference", "buffers", "logprob_gap", "names_wrong")
    ctx.roles = Roles.of(ctx.rank, ctx.world_size)
    if ctx.roles.is_trainer(ctx.rank):
        ctx.mesh = cv.Mesh(ctx.roles.trainer.index(ctx.rank), len(ctx.roles.trainer),
                           ctx.config.num_hidden_layers, ctx.device, ctx.roles.trainer_group)
    g = torch.Generator().manual_seed(p["seed"] + 100)
    ctx.tokens = torch.randint(1, ctx.config.vocab_size, (1, p["seq_len"]), generator=g).to(ctx.device)
    if ctx.roles.is_worker(ctx.rank):
        # the worker's stale copy; it keeps the routing bias fp32
        ctx.inference = cv.build_model(ctx.config, p["seed"] + 1, dtype=torch.bfloat16, device=ctx.device)
        if ctx.receiver == "vllm":
            start_vllm(ctx, ctx.inference)
    ctx.note(_role_words(ctx, cv.router_biases(trainer)[0][0]))


def _role_words(ctx, bias: str) -> str:
    roles, said = ctx.roles, []
    if roles.is_trainer(ctx.rank):
        owns = ctx.mesh.stage_of(bias) == ctx.mesh.rank
        said.append(f"trainer stage {ctx.mesh.rank}" + (" (owns the MoE layer and its router bias)" if owns else ""))
    if ctx.rank == SENDER:
        said.append("sender")
    if roles.is_worker(ctx.rank):
        said.append("inference worker")
    return "; ".join(said)


def forget_expectations(ctx) -> None:
    """Expectations hold for the score step only: between syncs the worker is stale by design."""
    ctx.expected.clear()


def extractor(ctx, metadata: str, reuse_tasks: bool = False) -> cv.ConversionExtractor:
    import torch

    from workbench.lab.weightsync import conversion as cv

    p = ctx.params
    return cv.ConversionExtractor(ctx.trainer, ctx.mesh, torch.bfloat16, p["bucket_bytes"], reuse_tasks, metadata)


def make_plan(ctx, metadata: str, stage: int) -> None:
    """Every trainer rank builds the metadata (walking the export: collectives); the sender keeps it."""
    from workbench.lab.weightsync import broadcast as bc

    forget_expectations(ctx)
    if not ctx.roles.is_trainer(ctx.rank):
        return  # an inference worker on its own rank waits for the update
    ctx.extractor = extractor(ctx, metadata)
    meta = ctx.extractor.get_weight_metadata()
    ctx.plan = bc.Plan.from_metadata(meta)
    if ctx.rank == SENDER:
        note_order(ctx, "plan", stage, ctx.plan.entries())
    ctx.note(f"plan: {len(ctx.plan)} names ({metadata} metadata)")


def stream(ctx, stage: int) -> None:
    """Every trainer rank walks ``extract_weights``; the sender packs the stream, the others drain it."""
    from workbench.lab.weightsync import broadcast as bc

    forget_expectations(ctx)
    if not ctx.roles.is_trainer(ctx.rank):
        return
    threshold = ctx.params["threshold_bytes"]
    chunks = ctx.extractor.extract_weights()
    if ctx.rank == SENDER:
        entries, bufs = [], []
        for k, chunk in enumerate(chunks):
            entries += [(n, d.replace("torch.", ""), s, k) for n, d, s in zip(chunk.names, chunk.dtypes, chunk.shapes)]
            bufs.append(chunk)
        ctx.buffers = list(bc.pack_stream(bufs, threshold))
        note_order(ctx, "stream", stage, entries)
        ctx.note(f"streamed {len(entries)} tensors in {len(bufs)} chunks, packed into {len(ctx.buffers)} buffer(s)")
    else:
        n = sum(len(c.names) for c in chunks)
        ctx.note(f"drained the export ({n} tensors): its collectives need every trainer rank")


def deliver(ctx, check: bool) -> None:
    """The update request (the plan) goes to the worker, then the packed bytes."""
    import torch.distributed as dist

    from workbench.lab.weightsync import broadcast as bc
    from workbench.lab.weightsync import conversion as cv

    forget_expectations(ctx)
    roles = ctx.roles
    if ctx.rank != SENDER and not roles.is_worker(ctx.rank):
        return  # a trainer rank outside the transfer group
    threshold, group = ctx.params["threshold_bytes"], roles.transfer_group
    box = [ctx.plan.to_metadata() if ctx.rank == SENDER else None]
    dist.broadcast_object_list(box, src=SENDER, group=group, device=_obj_device(ctx))
    if ctx.rank == SENDER:
        sent = bc.send_packed(ctx.buffers, group=group, src=SENDER, plan=ctx.plan, check=check, threshold=threshold)
        ctx.note(f"sent {len(sent.buffers)} buffer(s), {sent.bytes} bytes")
    elif ctx.receiver == "vllm":
        from workbench.lab.weightsync import vllm_role as vr

        plan = bc.Plan.from_metadata(box[0])
        with vr.WeightUpdate(ctx._llm) as up:
            got = bc.consume(plan, lambda n, t: vr.update_one(up, n, t), group=group, src=SENDER, threshold=threshold,
                             device=ctx.device, check=check)
        ctx.inference = vr.as_module(vr.fused_state(vr.hf_state(ctx._llm, ctx.config)))
        ctx.note(f"vLLM's loader: received {len(got.buffers)} buffer(s), {got.bytes} bytes; loaded {len(got.names)} "
                 "tensors by plan")
    else:
        plan = bc.Plan.from_metadata(box[0])
        got = bc.consume(plan, lambda n, t: cv.load_hf_weight(ctx.inference, n, t), group=group, src=SENDER,
                         threshold=threshold, device=ctx.device, check=check)
        ctx.note(f"received {len(got.buffers)} buffer(s), {got.bytes} bytes; loaded {len(got.names)} tensors by plan")


def score(ctx, sync: int) -> None:
    """The worker against the trainer: names holding the right bytes, and the log-prob gap on fixed tokens.

    Also declares the trainer's values as what every worker tensor should hold
    (``ctx.expect``), so the reference detector names each tensor that came out wrong.
    """
    import torch

    if not ctx.roles.is_worker(ctx.rank):
        return
    trainer = dict(ctx.trainer.named_parameters()) | dict(ctx.trainer.named_buffers())
    for name, _ in [*ctx.inference.named_parameters(), *ctx.inference.named_buffers()]:
        if name in trainer and "rotary_emb" not in name:
            ctx.expect(f"inference.{name}", trainer[name].detach().clone())
    gap, wrong, total = compare_vllm(ctx) if ctx.receiver == "vllm" else compare(ctx.inference, ctx.trainer, ctx.tokens)
    floor = kernel_floor(ctx) if ctx.receiver == "vllm" else float("nan")
    ctx.output("logprob_gap", torch.tensor([gap]), sync=sync, ref_max_abs_diff=gap, ref_floor=floor,
               receiver=ctx.receiver, presync_gap=getattr(ctx, "presync_gap", float("nan")))
    ctx.output("names_wrong", torch.tensor([float(len(wrong))]), sync=sync, names=total)
    who = "vLLM" if ctx.receiver == "vllm" else "stand-in"
    ctx.note(f"sync {sync} ({who}): {total - len(wrong)}/{total} names hold the trainer's bytes; log-prob gap "
             f"{gap:.3g}" + (f" (before any sync: {ctx.presync_gap:.3g}; vLLM serving these trainer weights: "
                             f"{floor:.3g})" if ctx.receiver == "vllm" else "")
             + (f"; first wrong: {', '.join(wrong[:3])}" if wrong else ""))


def start_vllm(ctx, stale: torch.nn.Module) -> None:
    """vLLM's engine serving the worker's stale copy (reused engines reload it); the round trip before any sync."""
    from workbench.lab.weightsync import model as wm
    from workbench.lab.weightsync import vllm_role as vr

    ctx._llm, took = vr.engine(stale)
    if took is None:
        vr.reload_all(ctx._llm, stale)
    ctx.presync_gap = float((vr.prompt_logprobs(ctx._llm, ctx.tokens) - wm.token_logprobs(stale, ctx.tokens))
                            .abs().mean())
    ctx.inference = vr.as_module(vr.fused_state(vr.hf_state(ctx._llm, ctx.config)))
    how = f"started in {took:.1f} s" if took is not None else "reused, every weight reloaded from this checkpoint"
    ctx.note(f"vLLM {vr.vllm_version()} engine {how}; round trip before any sync (same weights): mean "
             f"|log-prob vLLM - trainer| {ctx.presync_gap:.3g}")


def compare_vllm(ctx) -> tuple[float, list[str], int]:
    """vLLM's prompt log-probs against the trainer's on the fixed tokens; names read back from vLLM."""
    import torch

    from workbench.lab.weightsync import conversion as cv
    from workbench.lab.weightsync import model as wm
    from workbench.lab.weightsync import vllm_role as vr

    want = cv.hf_state(ctx.trainer, torch.bfloat16)
    have = vr.hf_state(ctx._llm, ctx.config)
    wrong = [n for n, t in want.items() if not _same_bytes(t, have[n].to(t.dtype))]
    gap = float((vr.prompt_logprobs(ctx._llm, ctx.tokens) - wm.token_logprobs(ctx.trainer, ctx.tokens)).abs().mean())
    return gap if gap == gap else float("inf"), wrong, len(want)


def kernel_floor(ctx) -> float:
    """The round trip for the trainer's current weights: vLLM loads them, scores, and gets its own bytes back.

    After a right sync the gap is this floor by construction; it moves with the weights (near-tied router
    picks flip between vLLM's and the trainer's kernels), so it is the level a fix must return to."""
    from workbench.lab.weightsync import model as wm
    from workbench.lab.weightsync import vllm_role as vr

    lp = vr.floor_logprobs(ctx._llm, ctx.trainer, ctx.tokens, ctx.config)
    return float((lp - wm.token_logprobs(ctx.trainer, ctx.tokens)).abs().mean())


def compare(inference: torch.nn.Module, trainer: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, list[str], int]:
    import torch

    from workbench.lab.weightsync import conversion as cv

    want = cv.hf_state(trainer, torch.bfloat16)
    have = cv.hf_state(inference, torch.bfloat16)
    wrong = [n for n, t in want.items() if not _same_bytes(t, have[n].to(t.dtype))]
    with torch.no_grad():
        a = inference(tokens).logits.float().log_softmax(-1)
        b = trainer(tokens).logits.float().log_softmax(-1)
    gap = (a - b).abs().mean().item()
    return gap if gap == gap else float("inf"), wrong, len(want)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def note_order(ctx, kind: str, stage: int, entries: list) -> None:
    ctx.note(ORDER_NOTE + json.dumps({"kind": kind, "stage": stage, "entries": [list(e) for e in entries]}))


def _obj_device(ctx):
    return ctx.device if ctx.device.type == "cuda" else None


def _metadata(ctx, drifted: bool) -> str:
    if ctx.fix in (ONE_PLAN, BOTH):
        return "one-plan"
    return "mirrored-local" if drifted else "raw"


# -- steps ------------------------------------------------------------------------------------
@SCENARIO.step
def build(ctx) -> None:
    """The tiny DeepseekV3 on every trainer rank (bf16, router bias kept fp32); the worker's stale copy."""
    build_roles(ctx)


@SCENARIO.step
def plan(ctx) -> None:
    """Stage 1: metadata in raw export order (the fix: from the one chunk plan)."""
    make_plan(ctx, _metadata(ctx, drifted=False), stage=1)


@SCENARIO.step(name="stream")
def stream_1(ctx) -> None:
    """Stage 1: extract_weights regroups each bucket by output dtype: bf16 chunk, then fp32 chunk."""
    stream(ctx, stage=1)


@SCENARIO.step(name="deliver")
def deliver_1(ctx) -> None:
    """Stage 1: plan to the worker, then the packed bytes; the worker slices by the plan."""
    deliver(ctx, check=ctx.fix in (CHECK, BOTH))


@SCENARIO.step(name="score")
def score_1(ctx) -> None:
    """Stage 1: which names hold the trainer's bytes; the log-prob gap."""
    score(ctx, sync=1)


@SCENARIO.step
def mirror_plan(ctx) -> None:
    """Stage 2: the metadata mirrors the regrouping, deciding it from what this rank owns."""
    make_plan(ctx, _metadata(ctx, drifted=True), stage=2)


@SCENARIO.step
def stream_2(ctx) -> None:
    stream(ctx, stage=2)


@SCENARIO.step
def deliver_2(ctx) -> None:
    deliver(ctx, check=ctx.fix in (CHECK, BOTH))


@SCENARIO.step
def score_2(ctx) -> None:
    score(ctx, sync=2)
