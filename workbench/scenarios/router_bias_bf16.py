"""router-bias-bf16: the sync casts the fp32 router bias to bf16 and routing changes.

Incident 002 (SkyRL, PR #1816). DeepseekV3-style routers pick experts with
``topk(sigmoid(logits) + e_score_correction_bias)``. The bias learns a large per-layer
offset (25-57 was reported) with tiny per-expert differences (std ~7e-4), and it is those
differences that move tokens between experts. A weight sync that casts every tensor to the
inference dtype sends it as bf16, whose spacing at that magnitude is 0.125-0.25: the eight
values collapse to one or two, the worker loads them into its fp32 buffer, and every top-k
decision the bias should make is made by ``sigmoid(logits)`` alone. Nothing fails;
the outputs drift.

The router logits are scaled down here (``router_scale``) so that ``sigmoid(logits)``
differs between experts by about as much as the bias does: then the bias decides a good
share of the picks, as it does in a trained MoE whose load balancing leans on it. With
unscaled toy logits the scores differ by ~1e-2 and the bias would decide almost nothing.

Same transport and roles as ``weight-sync-rank0-metadata`` with its fix in place (every
worker slices with its own metadata): only the dtype differs.

Under ``receiver=vllm`` (the default where vLLM imports) the bias lands in vLLM's own float32
``e_score_correction_bias`` parameter, and the routing compared is vLLM's: its router scores for
the fixed tokens with its loaded bias against the same scores with the trainer's fp32 bias.

Fix ``keep-fp32-routing-params``: names ending with a routing-critical suffix
(``e_score_correction_bias``) keep their native dtype through the sync. A bucket then holds
bf16 and fp32 tensors, so it is packed per dtype: two buffers, two handles and two update
requests per bucket, each with its own metadata.
"""

from __future__ import annotations

from workbench.lab.weightsync.defaults import DEFAULT_BUCKET_BYTES, RECEIVERS, TINY
from workbench.scenario import Scenario
from workbench.scenarios import weight_sync_rank0_metadata as colocated

# torch and the rank helpers are imported inside the steps, which run on the ranks: the client imports
# this module only for its declaration (tests/test_client_imports.py keeps it that way).

SCENARIO = Scenario(
    name="router-bias-bf16",
    title=("Weight sync casts the fp32 MoE router bias to bf16: per-expert offsets collapse, routing changes"
           " [vLLM's loader where it imports]"),
    doc=__doc__,
    params={**TINY, "seed": 0, "seq_len": 32, "layout": "ep", "bucket_bytes": DEFAULT_BUCKET_BYTES,
            "router_scale": 0.01, "receiver": "auto"},
    probe=None,  # trainer, sent, worker<w> (loaded, by HF name), worker<w>_model
    incident="002_79cad179003d2dbf",
)
SCENARIO.mesh("any N >= 2 that divides n_routed_experts (expert parallel over every rank)",
              lambda n, p: p["n_routed_experts"] % n == 0)
SCENARIO.require("receiver", lambda v: v in RECEIVERS, f"must be one of {', '.join(RECEIVERS)} "
                 "(auto: vLLM where it imports, else the workbench's stand-in)")
KEEP_FP32 = SCENARIO.fix(
    "keep-fp32-routing-params",
    "Names ending with a routing-critical suffix (e_score_correction_bias) keep their native fp32 through the sync; "
    "the mixed-dtype bucket is packed per dtype (two buffers, each with its own metadata).",
)


@SCENARIO.step
def build(ctx) -> None:
    """Trainer shard (router bias fp32: offset ~41, per-expert std 7e-4), the worker's stale copy."""
    from workbench.lab.weightsync import model as wm

    colocated.build(ctx)
    for name, b in wm.router_biases(ctx._trainer_model):
        ctx.note(f"trainer {name}: {wm.distinct_values(b)} distinct values, mean {float(b.mean()):.4f}, "
                 f"spread {float(b.max() - b.min()):.2e}")


@SCENARIO.step
def pack(ctx) -> None:
    """Export and cast for the sync: everything to bf16 (the fix: the router bias keeps fp32, packed apart)."""
    from workbench.lab.weightsync import pack as wp

    colocated.pack(ctx, wp.ROUTING_SUFFIXES if ctx.fix == KEEP_FP32 else ())


@SCENARIO.step
def share(ctx) -> None:
    """One handle per buffer, each with its own rank's metadata (the rank-0 metadata bug is fixed here)."""
    colocated.share(ctx, per_rank=True)


@SCENARIO.step
def load(ctx) -> None:
    """The worker loads by name; a bf16 bias lands in its fp32 buffer with the bf16 values."""
    from workbench.lab.weightsync import model as wm

    colocated.load(ctx)
    for name, b in colocated.worker_router(ctx)[1].items():
        ctx.note(f"worker {ctx.worker} {name}.{wm.BIAS_SUFFIX} ({b.dtype}, "
                 f"{'vLLM' if ctx.receiver == 'vllm' else 'stand-in'}): {wm.distinct_values(b)} distinct values "
                 "after the sync")


@SCENARIO.step
def check(ctx) -> None:
    """Per token, the expert set with the trainer's fp32 bias vs the synced one; the log-prob gap."""
    colocated.check(ctx)
