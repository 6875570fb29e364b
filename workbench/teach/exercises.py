"""The exercises: which incident, what the variant changes, where the learner's step goes, the hints.

Client side and light (no torch, no pandas at import): a declaration per notebook 01-08 and 11. Each exercise
is the incident's catalogue scenario with one thing changed that the notebook did not show (a step
swapped for one in ``teach/steps.py`` or a parameter), and a *slot*: the learner's step runs after a
named step, or in place of one. ``teach/solutions.py`` holds the reference solution and a known
non-fix for each; the grader (``teach/grade.py``) is tested against both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workbench import scenarios
from workbench.errors import UnknownName, WorkbenchError
from workbench.scenario import Scenario
from workbench.teach import solutions, steps

FIXED, NOT_FIXED, SYMPTOM_ONLY = "fixed", "not fixed", "fixed the symptom only"
SLOT_STEP = "your_fix"  # the name the learner's step runs under
WARM_DEADLINE_S = 180.0


@dataclass
class Exercise:
    """One graded exercise: a variant of the incident, the slot for the learner's step, hints, reference."""

    id: str
    title: str
    base: str  # the catalogue scenario it varies
    variant: str  # one line: what changed against the notebook
    slot: tuple[str, str]  # ("after" | "replace", step name)
    hints: list[str]
    reference: Callable[[Any], None]
    nonfix: Callable[[Any], None]
    nonfix_slot: tuple[str, str] | None = None  # where the known non-fix runs, when not in the slot
    nonfix_verdict: str = NOT_FIXED
    swap: dict[str, Callable[[Any], None]] = field(default_factory=dict)  # step name -> variant step
    only: list[str] | None = None  # keep only these steps of the base (in its order)
    params: dict[str, Any] = field(default_factory=dict)
    symptom: str = ""  # the name of the check that says the notebook's symptom is gone (grade.SYMPTOMS)

    def scenario(self) -> Scenario:
        """The variant's bug path, no learner step: what ``exercise.session(cluster)`` steps through."""
        base = scenarios.get(self.base)
        kept = [(n, self.swap.get(n, fn)) for n, fn in base.steps if self.only is None or n in self.only]
        # the learner's step and its hints are written against the workbench's own receiver (its tensor names,
        # its exact read-back); vLLM's real loader is the notebook's own section, not the exercise's
        stand_in = {"receiver": "workbench"} if "receiver" in base.params else {}
        return Scenario(name=f"exercise-{self.id}", title=f"Exercise {self.id}: {self.title}",
                        doc=f"{self.variant}\n\nVariant of `{self.base}`.",
                        params={**base.params, **stand_in, **self.params},
                        probe=base.probe, incident=base.incident, steps=kept)

    def session(self, cluster: Any, poison: bool = True) -> Any:
        """A session of the variant's bug path on ``cluster``: step it, read it, ``s.diagnose()`` it."""
        from workbench.live.session import Session

        warm(cluster)
        return Session(cluster, self.scenario(), poison=poison)

    def with_step(self, fn: Callable[[Any], None], after: str | None = None, replace: str | None = None) -> Scenario:
        """The variant with ``fn`` as a step named ``your_fix``, after or instead of a step (default: the slot)."""
        if after and replace:
            raise WorkbenchError("your step goes after a step or replaces one: give after= or replace=, not both")
        sc = self.scenario()
        mode, where = ("after", after) if after else ("replace", replace) if replace else self.slot
        if where not in sc.step_names:
            raise UnknownName(f"step of exercise {self.id}", where, sc.step_names)
        i = sc.step_names.index(where)
        cut = i + 1 if mode == "after" else i
        sc.steps = [*sc.steps[:cut], (SLOT_STEP, fn), *sc.steps[i + 1:]]
        return sc

    def bug_step(self) -> Callable[[Any], None]:
        """What the slot holds on the bug path: the step it replaces, or nothing."""
        mode, where = self.slot
        if mode == "replace":
            return dict(scenarios.get(self.base).steps)[where] if where not in self.swap else self.swap[where]
        return steps.nothing

    def slot_text(self) -> str:
        mode, where = self.slot
        return f"runs on every rank {'right after' if mode == 'after' else 'in place of'} step `{where}`"


EXERCISES: dict[str, Exercise] = {e.id: e for e in [
    Exercise(
        "01", "the dtype split in fp16", "fsdp1-rotary-meta-init",
        "The meta ranks' trainer casts to fp16 (`model.half()`), not bf16; rank 0 still loads bf16, `inv_freq` fp32.",
        ("after", "cast"),
        ["Step the bug path and look at `dtype` per rank after `cast`: how many dtypes does rank 0 hold, how many "
         "does rank 1? `_broadcast_coalesced` makes one bucket per dtype.",
         "The broadcast pairs up only if every rank holds every tensor in the same dtype as rank 0. Which dtypes does "
         "`from_pretrained(dtype=bf16)` leave on rank 0, for parameters and for non-persistent buffers?",
         "On rank != 0, after `cast` (still on meta): parameters and persistent buffers `.to(torch.bfloat16)`, "
         "buffers named in `module._non_persistent_buffers_set` `.to(torch.float32)`. Recomputing `inv_freq` after "
         "the wrap is too late: the broadcast already mispaired."],
        solutions.ref_01, solutions.nonfix_01, ("after", "wrap_fsdp1"), SYMPTOM_ONLY,
        swap={"cast": steps.cast_fp16}, symptom="inv_freq"),
    Exercise(
        "02", "a model with linear rope scaling", "fsdp2-nonpersistent-buffer-sync",
        "`rank0-garbage` (every rank builds on meta) on a Qwen3 with `rope_type=\"linear\"`, factor 4.",
        ("replace", "sync_buffers"),
        ["Run the bug path: where do the NaN logits start (`s.findings()`, the forward trace)? Which tensors were "
         "never written after `load_state_dict`?",
         "Rank 0 has nothing right to broadcast: its `inv_freq` came out of `to_empty` too. It has to compute it "
         "first. How does the rotary embedding compute it in `__init__` for this config?",
         "`compute_default_rope_parameters` ignores `rope_type`. Use the module's own init: "
         "`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[module.rope_type](module.config)` returns "
         "`(inv_freq, scaling)`; set `inv_freq` and `original_inv_freq` on rank 0, then broadcast "
         "(`workbench.lab.buffers.sync_non_persistent_buffers`)."],
        solutions.ref_02, solutions.nonfix_02, None, SYMPTOM_ONLY,
        swap={"load": steps.load_scaled_rope}, params={"variant": "rank0-garbage"}, symptom="finite-logits"),
    Exercise(
        "03", "a second buffer clobbered", "to-empty-clobbers-buffers",
        "The router also has a `gate_scale` (ones) registered with an explicit device, multiplied into the gates.",
        ("replace", "materialize"),
        ["Step to after `materialize`: which tensors were real before it and are never-written after it?",
         "Re-writing the buffers you know about after `to_empty` only works for the ones you know about. What "
         "decides whether a tensor needs fresh memory at all?",
         "Per module, replace only tensors that are on meta: `module._apply(lambda t: torch.empty_like(t, "
         "device=ctx.device) if t.is_meta else t, recurse=False)` (or "
         "`workbench.scenarios.to_empty_clobbers_buffers.materialize_meta_only`), then `reset_parameters()`; "
         "seed with `torch.manual_seed(ctx.params['seed'])` first so the ranks agree."],
        solutions.ref_03, solutions.nonfix_03, None, SYMPTOM_ONLY,
        swap={"build": steps.build_scaled_moe, "route": steps.route_scaled}, symptom="routing"),
    Exercise(
        "04", "the deadlock under FSDP1", "eval-loop-uneven-batches",
        "The same uneven loop with `wrapper=\"fsdp1\"` (FULL_SHARD, a unit per decoder layer).",
        ("replace", "evaluate"),
        ["Run the bug path and read `frame.hang`: which collective does each rank wait in?",
         "Every forward is a collective under FSDP: the ranks must agree, before each batch, whether there is one. "
         "And the loss every rank reports must be the same number.",
         "Loop: take the next batch or None, all-reduce a has-data flag with `op=dist.ReduceOp.MIN`, stop when it "
         "is 0; sum `loss * tokens` and tokens; after the loop all-reduce `torch.stack([loss_sum, tokens])` and "
         "`ctx.output('loss', total[0] / total[1])`. Use `ctx.net` and `ctx.batches`."],
        solutions.ref_04, solutions.nonfix_04, None, SYMPTOM_ONLY,
        params={"wrapper": "fsdp1"}, symptom="no-hang"),
    Exercise(
        "05", "four experts, small buckets", "weight-sync-rank0-metadata",
        "4 routed experts (2 per rank) and 4 KiB buckets: several buffers, several requests per sync.",
        ("replace", "share"),
        ["Run the bug path and read the `load` notes: which worker loads names that are not its own?",
         "A worker slices its own buffer with the request's metadata. Whose metadata is in the request, and "
         "whose buffer is being sliced?",
         "Per pack: gather `{key: {'handle': ipc.make_handle(pk.data, pk.names[0]), 'metadata': pk.metadata()}}` "
         "with `ipc.gather_handles(entry, device=ctx.device)`; rank 0 builds `ipc.request_per_rank(gathered)`; "
         "`ipc.broadcast_request(req, src=0, device=ctx.device)` into `ctx.requests` "
         "(`from workbench.lab.weightsync import ipc`, `key = ipc.device_key(ctx.device, ctx.rank)`)."],
        solutions.ref_05, solutions.nonfix_05, ("replace", "load"), SYMPTOM_ONLY,
        params={"n_routed_experts": 4, "bucket_bytes": 4096}, symptom="own-names"),
    Exercise(
        "06", "two MoE layers", "router-bias-bf16",
        "Two MoE layers, so two router biases, each with its own offset and tiny per-expert spread.",
        ("replace", "pack"),
        ["Run the bug path: how many distinct values does each router bias have on the trainer and on the worker?",
         "bf16 keeps 8 bits of precision: at ~41 its steps are 0.25. Is any 16-bit float fine enough for a spread "
         "of 7e-4 at that offset?",
         "Keep names ending with `e_score_correction_bias` in their native fp32 (`wp` is "
         "`workbench.lab.weightsync.pack`): `dict(wp.cast_for_sync(exported, torch.bfloat16, "
         "wp.ROUTING_SUFFIXES))` into `ctx.sent` and "
         "`wp.pack_for_sync(exported, torch.bfloat16, wp.ROUTING_SUFFIXES, ctx.params['bucket_bytes'])` into "
         "`ctx.packs`, with `exported = list(ctx.trainer.items())`."],
        solutions.ref_06, solutions.nonfix_06, None, NOT_FIXED,
        params={"num_hidden_layers": 2}, symptom="routing-sets"),
    Exercise(
        "07", "a third dtype in the bucket", "weight-sync-order-desync",
        "Three layers: one router bias fp32, the other fp16, the rest bf16; one sync (the first stage only).",
        ("replace", "plan"),
        ["Run the bug path and compare the plan's order with the stream's (`frame.notes`, `wb.viz.order_view`).",
         "The stream regroups each bucket by output dtype, in the order dtypes are first seen. With three dtypes "
         "there are three chunks. A plan written separately has to reproduce that exactly, or be the same thing.",
         "Build the plan from the one chunk generator the stream uses: "
         "`workbench.scenarios.weight_sync_order_desync.make_plan(ctx, 'one-plan', stage=1)`. Checking the "
         "streamed names makes the failure loud, it does not make the sync right."],
        solutions.ref_07, solutions.nonfix_07, ("replace", "deliver"), NOT_FIXED,
        swap={"build": steps.build_three_dtypes}, only=["build", "plan", "stream", "deliver", "score"],
        params={"num_hidden_layers": 3}, symptom="names-right"),
    Exercise(
        "08", "the router bias goes fp32 -> fp16", "stale-conversion-cache",
        "Sync 1 exports the bias fp32, the train step leaves it fp16: the cached spec is now the larger one.",
        ("after", "offload_reload"),
        ["Run the bug path: nothing fails. Compare the sync 2 broadcasts in `s.ledger` rank by rank (dtype, bytes).",
         "Stage 0 allocates the bias from a spec cached in sync 1. Which object holds that cache, and how long "
         "does it live?",
         "Before sync 2, build fresh conversion tasks: `ctx.extractor = workbench.scenarios."
         "weight_sync_order_desync.extractor(ctx, 'one-plan', reuse_tasks=False)`. Patching the worker's bias "
         "after the sync repairs the worker, not the broadcast."],
        solutions.ref_08, solutions.nonfix_08, ("after", "sync_2"), SYMPTOM_ONLY,
        params={"bias_dtype_sync1": "float32", "bias_dtype_sync2": "float16"}, symptom="names-right"),
    Exercise(
        "11", "the seed is the global RNG's", "hsdp-replicas-diverge-at-init",
        "`build` seeds the global RNG per rank (`torch.manual_seed(seed * 1000 + rank)`, for dropout); "
        "`materialize` draws every local shard from it.",
        ("replace", "materialize"),
        ["Run the bug path and read the diagnosis: which ranks' copies of a shard disagree, and along which mesh "
         "dim? `wb.viz.status_matrix` of the `materialize` frame orders the ranks by their mesh coordinates.",
         "Every replica of a shard must draw the same numbers; the global RNG was seeded per rank before "
         "`materialize` ran. Making the replicas agree is not enough: the logits are checked against the model the "
         "seeds intend (one seed per shard coordinate).",
         "In place of `materialize`: `ctx.model.to_empty(device=ctx.device)`, "
         "`workbench.lab.buffers.recompute_rope(ctx.model)`, then `torch.manual_seed(shard_seed(ctx, "
         "ctx.mesh.get_local_rank('shard')))` and fill `local_shards(ctx.model)` with `torch.randn(t.shape) * "
         "ctx.params['std']` (both from `workbench.scenarios.hsdp_replicas_diverge_at_init`). Averaging the "
         "replicas makes them agree on weights nobody meant."],
        solutions.ref_11, solutions.nonfix_11, None, SYMPTOM_ONLY,
        swap={"build": steps.build_seeded_per_rank, "materialize": steps.materialize_global_rng},
        symptom="replicas-agree"),
]}


def warm(cluster: Any) -> None:
    """Import FSDP and the model families on the ranks now, under a generous deadline: on fresh engines of a
    loaded machine those imports alone can outlast a step's deadline (the collective timeout x 1.5 + 10 s),
    and the exercise would then be graded on an import, not on the learner's step. Milliseconds when warm."""
    from workbench.rank.byname import RankFn

    cluster.run(RankFn("workbench.rank.remote", "warm"), timeout=max(WARM_DEADLINE_S, cluster.deadline))


def get(exercise: str | int) -> Exercise:
    """``"01"``, ``1`` or ``"exercise-01"`` -> the exercise (one line naming the valid ids otherwise)."""
    key = str(exercise).removeprefix("exercise-")
    key = key.zfill(2) if key.isdigit() else key
    if key not in EXERCISES:
        raise UnknownName("exercise", str(exercise), sorted(EXERCISES))
    return EXERCISES[key]
