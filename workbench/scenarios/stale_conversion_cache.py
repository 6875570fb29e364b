"""stale-conversion-cache: reused conversion tasks carry a cached pipeline-broadcast spec into the next sync.

Incident 004 (SkyRL PR #1345, Megatron -> vLLM, DeepSeek-V3-style models at PP > 1).
Megatron-Bridge's mapping objects cache each pipeline broadcast's tensor spec (shape,
dtype, owner) after the first call (``_tensor_spec_output_cache``) and skip that
all-gather later: a stage that does not own a parameter allocates
``torch.empty(shape, dtype)`` from the cached spec and receives the owner's broadcast.
The extractor built its conversion tasks (frozen, each holding its mapping) once and
reused them on every sync, so the caches lived across train / offload / reload cycles.

The cycle here, on 2 ranks (rank 0: pipeline stage 0 and the sender; rank 1: stage 1,
owner of the MoE layer, and the inference worker; on N >= 4 ranks the workers get ranks of
their own, as in ``weight-sync-order-desync``, and every stage but the MoE layer's receives
the bias from a stale spec): sync 1 exports the router bias as
bf16 (as after the mixed-precision wrapper's cast) and is right; a train step changes
every value and the owner keeps the bias fp32 again (Megatron-Core's
``_maintain_float32_expert_bias``); offload to CPU and reload; sync 2 allocates the
bias on stage 0 from the stale bf16 spec (16 bytes) while the owner broadcasts 32 bytes
of fp32. What the mis-sized broadcast does depends on the backend: gloo aborts the
receiving process (``op.preamble.length <= op.nbytes. 32 vs 16``), a dead engine here;
the incident on NCCL was silent, with training collapsing later. Either way the ledger
shows the pair: a bfloat16 broadcast of 16 bytes on one rank, float32 of 32 bytes on the other.

Fix ``rebuild-tasks-per-sync``: keep only the bucket index groups and build fresh tasks
(fresh mappings, empty caches) on every sync; the spec all-gather runs again and sees
fp32. Control: ``--set bias_dtype_sync2=bfloat16`` (only values change): the stale
spec still fits, sync 2 is right, and the bug stays invisible. Reverse direction:
``--set bias_dtype_sync1=float32 --set bias_dtype_sync2=bfloat16``: the stale buffer is
larger than what arrives, gloo fills its first half and returns, and sync 2 loads wrong
bias values without any error (the silent outcome the incident saw on NCCL).
"""

from __future__ import annotations

from workbench.lab.weightsync.defaults import DEFAULT_BUCKET_BYTES, DEFAULT_THRESHOLD, RECEIVERS, TOY_SHAPE
from workbench.scenario import Scenario
from workbench.scenarios.weight_sync_order_desync import (
    build_roles,
    deliver,
    extractor,
    forget_expectations,
    score,
    stream,
)

# torch and the rank helpers are imported inside the steps, which run on the ranks: the client imports
# this module only for its declaration (tests/test_client_imports.py keeps it that way).

SCENARIO = Scenario(
    name="stale-conversion-cache",
    title=("Weight sync: reused conversion tasks keep a stale pipeline-broadcast spec (bias bf16 -> fp32)"
           " [vLLM's loader where it imports]"),
    doc=__doc__,
    params={**TOY_SHAPE, "seed": 0, "bucket_bytes": DEFAULT_BUCKET_BYTES, "threshold_bytes": DEFAULT_THRESHOLD,
            "seq_len": 16, "lr": 0.02, "bias_dtype_sync1": "bfloat16", "bias_dtype_sync2": "float32",
            "receiver": "auto"},
    probe=["inference"],
    incident="004_eff6b9a8f1171dcd",
)
SCENARIO.mesh("N = 2 (rank 0: stage 0; rank 1: stage 1 and the inference worker), or even N >= 4 with N/2 "
              "dividing n_routed_experts (trainer ranks 0..N/2-1, inference workers N/2..N-1)",
              lambda n, p: n == 2 or (n % 2 == 0 and p["n_routed_experts"] % (n // 2) == 0))
SCENARIO.require("receiver", lambda v: v in RECEIVERS, f"must be one of {', '.join(RECEIVERS)} "
                 "(auto: vLLM where it imports, else the workbench's stand-in)")
REBUILD = SCENARIO.fix(
    "rebuild-tasks-per-sync",
    "Store only the bucket index groups; build fresh conversion tasks (fresh mappings, empty spec caches) on every "
    "sync, so each pipeline broadcast re-gathers the owner's current shape and dtype.",
)


def sync(ctx, n: int) -> None:
    """Metadata walk, stream walk and delivery, as one sync; notes what the mapping caches hold."""
    from workbench.lab.weightsync import broadcast as bc
    from workbench.lab.weightsync import conversion as cv

    forget_expectations(ctx)
    if not ctx.roles.is_trainer(ctx.rank):  # an inference worker on its own rank: the delivery only
        deliver(ctx, check=False)
        return
    ex = ctx.extractor
    before = ex.task_builds
    meta = ex.get_weight_metadata()
    ctx.plan = bc.Plan.from_metadata(meta)
    stream(ctx, stage=n)
    deliver(ctx, check=False)
    bias = cv.router_biases(ctx.trainer)[0][0]
    task = next(t for t in ex.last_tasks if t.global_param_name == bias)
    spec = task.mapping._tensor_spec_output_cache.get(bias)
    owner = next((r for r, s in enumerate(spec or []) if s is not None), None)
    dtype = None if owner is None else str(spec[owner][1]).replace("torch.", "")
    ctx.note(f"sync {n}: {'reused' if ex.task_builds == before else 'built'} conversion tasks "
             f"(built {ex.task_builds}x so far); cached spec of the router bias: {dtype} from stage {owner}")


@SCENARIO.step
def build(ctx) -> None:
    """Trainer replica (bf16, the router bias bf16 as after the mixed-precision wrapper); the worker's copy."""
    from workbench.lab.weightsync.pack import dtype_of

    build_roles(ctx, bias_dtype=dtype_of(ctx.params["bias_dtype_sync1"]))
    if ctx.roles.is_trainer(ctx.rank):
        ctx.extractor = extractor(ctx, "one-plan", reuse_tasks=ctx.fix != REBUILD)


@SCENARIO.step
def sync_1(ctx) -> None:
    """First sync: every pipeline broadcast all-gathers its spec once and caches it."""
    sync(ctx, 1)


@SCENARIO.step
def score_1(ctx) -> None:
    score(ctx, sync=1)


@SCENARIO.step
def train_step(ctx) -> None:
    """Every value moves; the owner keeps the router bias fp32 again (same object, new data).

    (``bias_dtype_sync2`` picks the bias dtype after the step; every replica follows it,
    only the owner's copy is exported.)"""
    import torch

    from workbench.lab.weightsync import conversion as cv
    from workbench.lab.weightsync.pack import dtype_of

    forget_expectations(ctx)
    g = torch.Generator().manual_seed(ctx.params["seed"] + 1000)
    biases = {id(b) for _, b in cv.router_biases(ctx.trainer)}
    with torch.no_grad():
        for _, t in cv.hf_tensors(ctx.trainer):
            delta = torch.randn(t.shape, generator=g).to(t.device)
            if id(t) in biases:
                delta = delta * 1e-3  # the bias moves by its own small steps
                t.data = t.data.to(dtype_of(ctx.params["bias_dtype_sync2"]))
            t.data += (ctx.params["lr"] * delta).to(t.dtype)
    dtypes = sorted({str(b.dtype).replace("torch.", "") for _, b in cv.router_biases(ctx.trainer)})
    ctx.note(f"trained one step; router bias now {', '.join(dtypes)}")


@SCENARIO.step
def offload_reload(ctx) -> None:
    """Offload the trainer's weights to CPU and back: new storage, the same parameter objects."""
    forget_expectations(ctx)
    for t in [*ctx.trainer.parameters(), *ctx.trainer.buffers()]:
        t.data = t.data.to("cpu", copy=True)
    for t in [*ctx.trainer.parameters(), *ctx.trainer.buffers()]:
        t.data = t.data.to(ctx.device, copy=True)


@SCENARIO.step
def sync_2(ctx) -> None:
    """Second sync: with reused tasks every spec comes from the cache, the bias's included."""
    sync(ctx, 2)


@SCENARIO.step
def score_2(ctx) -> None:
    score(ctx, sync=2)
