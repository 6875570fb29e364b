"""The diagnosis on hand-made runs (one per mechanism) and on every recorded bundle, CPU and GPU.

No engines: the hand-made runs are real probe rows of real tensors and ledger rows written
as the ranks write them; the recorded bundles are what the catalogue scenarios produced.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from workbench.analysis import diagnosis
from workbench.analysis.collectives import ledger_table
from workbench.analysis.frames import COLUMNS, EVENT_COLUMNS, OUTPUT_COLUMNS, table
from workbench.postmortem import bundle
from workbench.postmortem.record import RunRecord
from workbench.rank.poison import poison_
from workbench.rank.probe import probe_tensors

ROOT = Path(__file__).resolve().parent.parent
INV = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))


def steps(*per_step: tuple[str, list[list[tuple]]], **cols: dict) -> pd.DataFrame:
    """Stacked tensor rows: per step, per rank, (name, tensor[, {extra column: value}])."""
    rows = []
    for i, (step, ranks) in enumerate(per_step):
        for rank, items in enumerate(ranks):
            for item in items:
                (row,) = probe_tensors([(item[0], "buffer", item[1])], rank)
                row.update(item[2] if len(item) > 2 else {})
                rows.append({"step": step, "step_index": i, **row})
    return table(rows, ["step", "step_index", *COLUMNS])


def outputs(step: str, index: int, per_rank: list[torch.Tensor], **extra) -> pd.DataFrame:
    rows = []
    for rank, t in enumerate(per_rank):
        (row,) = probe_tensors([("logits", "output", t)], rank)
        rows.append({"step": step, "step_index": index, **row, **{k: v[rank] for k, v in extra.items()}})
    return table(rows, ["step", "step_index", *OUTPUT_COLUMNS])


def call(rank: int, seq: int, op: str, dtype: str, numel: int, step: str = "wrap", **kw) -> dict:
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return {"rank": rank, "session": "s", "attempt": 0, "step": step, "group": "0", "group_ranks": [0, 1],
            "seq": seq, "op": op, "dtypes": [dtype], "shapes": [[numel]], "numel": numel, "bytes": numel * size,
            "src": 0 if op == "broadcast" else None, "state": "completed", "t_start": float(seq + rank / 10), **kw}


def record(tensors: pd.DataFrame, outs: pd.DataFrame | None = None, events: list[dict] | None = None,
           ledger: list[dict] | None = None, hangs: list[dict] | None = None) -> RunRecord:
    steps_run = list(dict.fromkeys(tensors["step"]))
    ev = table(events or [], ["step", "step_index", *EVENT_COLUMNS])
    return RunRecord({"steps_run": steps_run, "ranks": 2, "hangs": hangs or [], "fix": None}, tensors,
                     outs if outs is not None else pd.DataFrame(), ev, ledger=ledger_table(ledger or []))


def nan_logits() -> list[torch.Tensor]:
    return [torch.ones(8), torch.full((8,), float("nan"))]


# -- one hand-made run per mechanism -------------------------------------------------------------
def test_dtype_split_then_mispaired_bucket_then_reinterpreted_bytes():
    w = torch.linspace(-1, 1, 64).to(torch.bfloat16)
    cast = [[("rotary.inv_freq", INV), ("layer.weight", w)], [("rotary.inv_freq", INV.to(torch.bfloat16)),
                                                               ("layer.weight", w)]]
    received = INV.view(torch.bfloat16)[:32].clone()  # rank 0's fp32 bytes landed in rank 1's bf16 buffer
    wrap = [[("rotary.inv_freq", INV), ("layer.weight", w)],
            [("rotary.inv_freq", received), ("layer.weight", poison_(torch.empty_like(w)))]]
    led = [call(0, 1, "broadcast", "float32", 32, via="_broadcast_coalesced", bucket=0, bucket_tensors=1),
           call(0, 2, "broadcast", "bfloat16", 64, via="_broadcast_coalesced", bucket=1, bucket_tensors=1,
                state="timed out", error="RuntimeError: Timed out"),
           call(1, 1, "broadcast", "bfloat16", 96, via="_broadcast_coalesced", bucket=0, bucket_tensors=2)]
    d = record(steps(("cast", cast), ("wrap", wrap)), ledger=led).diagnose()
    assert d.mechanism == "reinterpreted" and d.step == "cast" and d.ranks == [1] and d.tensor == "rotary.inv_freq"
    assert d.sentence.startswith(
        "rank 1's `inv_freq` is rank 0's fp32 bytes read as bf16: `_broadcast_coalesced` bucketed by dtype after "
        "`cast` split the dtypes, rank 0 sent an extra fp32 bucket (broadcast #1, 128 B: `inv_freq`) that rank 1 "
        "received into its bf16 bucket; the rest of rank 1's tensors were never written; "
        "rank 0 timed out in broadcast #2"), d.sentence
    assert d.call["seq"] == 1 and d.call["rank"] == 0
    assert {"dtype split", "broadcast #1", "never written"} <= set(d.evidence["what"])


def test_never_written_since_materialisation_not_a_repaired_transient():
    w, buf = torch.linspace(-1, 1, 16), torch.arange(8.0)
    mat = [[("w", w), ("buf", buf)], [("w", poison_(torch.empty(16))), ("buf", poison_(torch.empty(8)))]]
    fwd = [[("w", w), ("buf", buf)], [("w", w.clone()), ("buf", poison_(torch.empty(8)))]]  # w loaded, buf never
    t = steps(("materialize", mat), ("load", fwd), ("forward", fwd))
    d = record(t, outputs("forward", 2, nan_logits())).diagnose()
    assert d.mechanism == "never-written" and d.step == "materialize" and d.tensor == "buf" and d.ranks == [1]
    assert "`buf` on rank 1 was never written" in d.sentence and "`w`" not in d.sentence
    assert "`forward` read the unwritten bytes" in d.sentence and "8 of 8 values NaN" in d.sentence


def test_every_rank_agrees_on_a_wrong_value():
    bad = INV * 2
    per = [[("inv_freq", bad, {"ref_diff": 1.0})], [("inv_freq", bad.clone(), {"ref_diff": 1.0})]]
    d = record(steps(("load", per), ("forward", per))).diagnose()
    assert d.mechanism == "agreed-wrong" and d.step == "load" and d.ranks == [0, 1]
    assert "every rank holds the same wrong `inv_freq`" in d.sentence and "cross-rank" in d.sentence


def test_collective_mismatch_names_the_first_divergent_call():
    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    led = [call(0, 1, "all_reduce", "float32", 2, step="eval"), call(1, 1, "all_reduce", "float32", 2, step="eval"),
           call(0, 2, "all_reduce", "float32", 2, step="eval", state="timed out"),
           call(1, 2, "all_gather_into_tensor", "float32", 512, step="eval", state="timed out")]
    d = record(steps(("eval", ok)), ledger=led).diagnose()
    assert d.mechanism == "collective-mismatch" and d.step == "eval" and d.call["seq"] == 2
    assert "part at group 0 call #2 in step `eval` (different collectives)" in d.sentence
    assert "all_gather_into_tensor #2" in d.sentence and "timed out in all_reduce #2" in d.sentence


def test_rank_missing_from_a_collective():
    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    led = [call(0, 1, "all_reduce", "float32", 2, step="eval"), call(1, 1, "all_reduce", "float32", 2, step="eval"),
           call(0, 2, "barrier", "float32", 1, step="eval", state="started")]
    d = record(steps(("eval", ok)), ledger=led).diagnose()
    assert d.mechanism == "rank-missing" and d.ranks == [1]
    assert d.sentence.startswith("rank 1 never issued group 0 call #2 that rank 0 issued in step `eval`")


def test_a_rank_died():
    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    ev = [{"step": "train", "step_index": 0, "rank": 1, "kind": "died", "error": "EngineError", "message": "gone"}]
    d = record(steps(("train", ok)), events=ev).diagnose()
    assert d.mechanism == "rank-died" and d.ranks == [1] and d.sentence.startswith("rank 1's engine died in step")


def test_a_hang_without_a_mispaired_call():
    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    ev = [{"step": "train", "step_index": 0, "rank": 0, "kind": "timeout", "error": "Timeout", "message": "late"}]
    d = record(steps(("train", ok)), events=ev).diagnose()
    assert d.mechanism == "hang" and d.ranks == [0] and "no collective was mispaired" in d.sentence


def test_outputs_depart_while_every_tensor_agrees():
    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    d = record(steps(("forward", ok)), outputs("forward", 0, nan_logits())).diagnose()
    assert d.mechanism == "outputs-only" and d.ranks == [1]
    assert "the cause is outside what was probed" in d.sentence


@pytest.mark.parametrize("engine_floor", [0.02, 0.066])  # vLLM's floor on an AMD EPYC and on a Xeon with AMX
def test_an_engines_outputs_are_judged_against_its_own_floor(engine_floor):
    """The same right sync on two CPUs: the gap is the floor the same engine showed in the run, so it reads clean
    on both, and says both numbers; a wrong sync reads broken by its distance from that floor, not a constant."""
    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    lp = [torch.ones(8), torch.ones(8)]
    right = record(steps(("check", ok)), outputs("check", 0, lp, ref_max_abs_diff=[engine_floor] * 2,
                                                 ref_floor=[engine_floor] * 2))
    d = right.diagnose()
    assert d.mechanism == "clean", d.sentence
    assert f"`logits` {engine_floor:.3g} from the reference, the engine's own floor {engine_floor:.3g} in this run: " \
           "within it" in d.sentence, d.sentence
    assert right.findings().query("detector == 'reference'").empty
    wrong = record(steps(("check", ok)), outputs("check", 0, lp, ref_max_abs_diff=[engine_floor, 5 * engine_floor],
                                                 ref_floor=[engine_floor] * 2))
    d = wrong.diagnose()
    assert d.mechanism == "outputs-only" and d.ranks == [1], d.sentence
    assert f"departs from the reference by {5 * engine_floor:.3g}, the engine's own floor {engine_floor:.3g}" \
           in d.sentence, d.sentence
    # without a floor (outputs computed like their reference) the rounding tolerance stands
    plain = record(steps(("check", ok)), outputs("check", 0, lp, ref_max_abs_diff=[0.0, engine_floor]))
    assert plain.diagnose().mechanism == "outputs-only"


def test_clean_run_and_comparison_parting_step():
    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    fixed = record(steps(("a", ok), ("b", ok)), outputs("b", 1, [torch.ones(8), torch.ones(8)]))
    d = fixed.diagnose()
    assert d.clean and d.sentence.startswith("clean")
    bad = [[("x", torch.ones(4))], [("x", poison_(torch.empty(4)))]]
    bug = record(steps(("a", ok), ("b", bad)), outputs("b", 1, nan_logits()))
    c = diagnosis.diagnose_comparison(bug, fixed)
    assert c.mechanism == "never-written" and c.fix.clean
    assert c.parted == {"step": "b", "rank": 1, "name": "x", "what": "different bytes"}
    assert "parts from the bug path at step `b`" in c.sentence and c.sentence.endswith("and is clean")


def test_a_record_is_read_once_and_a_changed_record_again(monkeypatch):
    """The run's model (each step's status table, the expensive part) is built once per record: a comparison reuses
    the bug's and the fix's, and diagnosing the bug again (the report does, once per fix) reads nothing new. A record
    given other tables is read again."""
    from workbench.analysis import findings

    ok = [[("x", torch.ones(4))], [("x", torch.ones(4))]]
    bad = [[("x", torch.ones(4))], [("x", poison_(torch.empty(4)))]]
    bug = record(steps(("a", ok), ("b", bad)), outputs("b", 1, nan_logits()))
    fixed = record(steps(("a", ok), ("b", ok)), outputs("b", 1, [torch.ones(8), torch.ones(8)]))
    reads = []
    status = findings.status
    monkeypatch.setattr(findings, "status", lambda t, *a, **kw: reads.append(1) or status(t, *a, **kw))
    diagnosis.diagnose_comparison(bug, fixed)
    assert len(reads) == 4  # two steps of each run, once
    diagnosis.diagnose(bug)
    diagnosis.diagnose_comparison(bug, fixed)
    assert len(reads) == 4
    bug.tensors = steps(("a", ok), ("b", ok))  # the same record, other rows: read again (only the outputs depart)
    assert diagnosis.diagnose(bug).mechanism == "outputs-only" and len(reads) == 6


def test_figure_has_a_categorical_legend_and_outlines_the_first_step():
    from workbench.viz.diagnosis import figure

    bad = [[("x", torch.ones(4))], [("x", poison_(torch.empty(4)))]]
    d = record(steps(("a", bad), ("b", bad))).diagnose()
    fig = figure(d)
    assert {t.name for t in fig.data} == {"ok", "fault"} and all(t.type == "scatter" for t in fig.data)
    assert len(fig.layout.shapes) == 1 and d.step == "a"


# -- the catalogue, as recorded ----------------------------------------------------------------------
EXPECT = {  # scenario -> (mechanism, words the sentence must hold)
    "fsdp1-rotary-meta-init": ("reinterpreted", [
        "rank 1's `inv_freq` is rank 0's fp32 bytes read as bf16: `_broadcast_coalesced` bucketed by dtype after "
        "`cast` split the dtypes, rank 0 sent an extra fp32 bucket (broadcast #1, 256 B: `inv_freq`, "
        "`original_inv_freq`) that rank 1 received into its bf16 bucket; the rest of rank 1's tensors were never "
        "written; rank 0 hung in broadcast #2 (released by the workbench)"]),
    # the incident's own variant (rank0-garbage): rank 0's source was never initialised either
    "fsdp2-nonpersistent-buffer-sync": ("never-written", ["`inv_freq`, `original_inv_freq` on ranks 0,1 were never",
                                                          "same garbage"]),
    "to-empty-clobbers-buffers": ("never-written", ["`expert_bias` on ranks 0,1 was real (not meta) before step "
                                                    "`materialize`", "kept it NaN through step `train`",
                                                    "same garbage"]),
    "eval-loop-uneven-batches": ("collective-mismatch", ["call #9", "all_reduce #9", "all_gather_into_tensor #9"]),
    "weight-sync-rank0-metadata": ("mislabeled", [  # the mechanism first, then what it left
        "worker 1 sliced trainer rank 1's buffer with rank 0's metadata (names and offsets): "
        "worker 1 `model.layers.0.mlp.experts.0.gate_up_proj` holds trainer rank 1's "
        "`model.layers.0.mlp.experts.4.gate_up_proj`", "nothing raised"]),
    "router-bias-bf16": ("lossy-cast", ["`model.layers.0.mlp.gate.e_score_correction_bias` rounded to bfloat16 "
                                        "(float32 on the trainer)"]),
    # the silent stage-1 permutation is the first cause (the plan/stream split, however the bytes then look),
    # the stage-2 parting later
    "weight-sync-order-desync": ("permuted", ["part at index 33 of stage 1", "nothing raised",
                                              "; later, in step `mirror_plan`: rank 0 never issued group 0 call",
                                              "all_gather_into_tensor"]),
    # the stale cached spec named as the cause, in the issuing code's own words (ledger labels)
    "stale-conversion-cache": ("collective-mismatch", ["in step `sync_2` (different dtypes)",
                                                       "broadcast #145 bfloat16 [8] 16 B",
                                                       "receives per the spec cached at sync 1: bfloat16 [8]",
                                                       "broadcast #145 float32 [8] 32 B",
                                                       "the owner sends its current float32 [8]"]),
    # 2 ranks: a 2 x 1 mesh, two replicas of one shard; each rank seeded its fill with its global rank
    "hsdp-replicas-diverge-at-init": ("replicas-parted", [
        "differ between the replicas (mesh dim `replicate`: rank 0 vs 1) from step `materialize`",
        "output `logits` on rank 1: departs from the reference"]),
}
# Tempting non-fixes: their runs must not read clean. `check-streamed-names` alone is insurance that
# fails loudly on the permutation, yet cannot stop the stage-2 walk that parts earlier.
NON_FIXES = {"recompute-after-wrap", "check-streamed-names", "state-dict-then-sync", "sync-buffers-after-wrap"}


def test_the_non_fixes_are_the_ones_the_catalogue_declares():
    from workbench import scenarios

    assert set().union(*(scenarios.get(n).non_fixes for n in scenarios.names())) == NON_FIXES
SPLIT = "the receiver's plan and the sender's stream part at index 33 of stage 1"


def test_a_rank_that_raised_before_anything_went_wrong_leads_the_story():
    """The streamed-name check refusing a stream is the first cause; the weights it left unloaded
    (wrong at the next step) come after it, not instead of it."""
    good = [[("w", INV)], [("w", INV.clone())]]
    stale = [[("w", INV)], [("w", INV * 2, {"ref_diff": 1.0})]]
    msg = "weight stream disagrees with the plan at index 33: streamed name 'b', the plan says 'a'"
    ev = [{"step": "deliver", "step_index": 1, "rank": r, "kind": "error", "error": "StreamPlanMismatch",
           "message": msg} for r in (0, 1)]
    d = record(steps(("plan", good), ("deliver", good), ("score", stale)), events=ev).diagnose()
    assert d.mechanism == "error" and d.step == "deliver" and d.ranks == [0, 1]
    assert d.sentence.startswith("ranks 0,1 raised StreamPlanMismatch in step `deliver`: weight stream disagrees "
                                 "with the plan at index 33"), d.sentence
    assert "; later, in step `score`: `w` on rank 1 departs from its reference value" in d.sentence
    # raised in the step that left the state wrong: the exception leads, the state follows
    same = [{**e, "step": "score", "step_index": 2} for e in ev]
    d = record(steps(("plan", good), ("deliver", good), ("score", stale)), events=same).diagnose()
    assert d.mechanism == "error" and "; in the same step: `w` on rank 1 departs" in d.sentence
    # the state went wrong first: it leads, whatever raised later
    later = [{**e, "step": "report", "step_index": 3} for e in ev]
    d = record(steps(("plan", good), ("deliver", good), ("score", stale), ("report", stale)), events=later).diagnose()
    assert d.mechanism == "wrong-value" and d.step == "score"


def test_every_catalogue_scenario_has_an_expected_diagnosis():
    from workbench import scenarios

    assert set(EXPECT) == set(scenarios.names())


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_catalogue_bug_paths_name_the_cause_and_fixes_are_clean(name):
    b = bundle.load(ROOT / "fixtures" / "bundles" / f"{name}.wbundle")
    mechanism, words = EXPECT[name]
    d = b.bug.diagnose()
    assert d.mechanism == mechanism, d.sentence
    if name == "fsdp1-rotary-meta-init":  # the figure marks where the story starts: rank 1's split at `cast`
        cell = d.grid.set_index(["step", "rank"]).loc[("cast", 1)]
        assert cell["status"] == "fault" and cell["label"] == "dtype split (bf16)"
    for w in words:
        assert w in d.sentence, d.sentence
    for rec in b:
        fix = rec.manifest.get("fix")
        if fix and fix not in NON_FIXES:
            assert rec.diagnose().clean, (fix, rec.diagnose().sentence)
        elif fix == "recompute-after-wrap":
            assert rec.diagnose().mechanism == "reinterpreted"
        elif fix == "check-streamed-names":  # the split leads, then the check that caught it (loud, not fixed)
            said = rec.diagnose().sentence
            assert said.startswith(SPLIT) and "; ranks 0,1 raised StreamPlanMismatch in step `deliver`" in said, said
            assert "nothing raised" not in said
        elif fix:
            assert not rec.diagnose().clean


GPU = sorted((ROOT / "fixtures" / "gpu").glob("*.bundle"))


@pytest.mark.parametrize("path", GPU, ids=[p.stem for p in GPU])
def test_gpu_bundles_bug_named_fix_clean(path):
    rec = next(iter(bundle.load(path)))
    fix = rec.manifest.get("fix")
    d = rec.diagnose()
    fixes_here = fix == "state-dict-then-sync" and rec.manifest["params"].get("variant") == "never-synced"
    if fix and (fix not in NON_FIXES or fixes_here):  # state-dict-then-sync fixes the never-synced variant
        assert d.clean, d.sentence
        return
    assert not d.clean
    if fix == "check-streamed-names":  # insurance alone: the check fails loudly, the later walk still parts
        assert d.sentence.startswith(SPLIT) and "; ranks 0,1 raised StreamPlanMismatch in step `deliver`" \
            in d.sentence and "later, in step" in d.sentence, d.sentence
        return
    if rec.manifest["scenario"] == "fsdp1-rotary-meta-init":
        assert "rank 0 sent an extra fp32 bucket (broadcast #1, 256 B: `inv_freq`, `original_inv_freq`) that rank 1 " \
               "received into its bf16 bucket" in d.sentence
        assert d.step == "cast"
        if "3.4MB" in path.name:  # NCCL returned silently: rank 1's weights are rank 0's stream slid by 64 elements
            assert d.mechanism == "reinterpreted" and d.sentence.startswith(
                "rank 1's `layers.0.self_attn.q_proj.weight` and 14 more of its tensors hold rank 0's bytes slid by "
                "64 bf16 elements (128 B):"), d.sentence
    else:
        assert d.mechanism == EXPECT[rec.manifest["scenario"]][0], d.sentence


def test_report_opens_with_what_happened_and_lists_each_finding_once(recorded_report):
    page = recorded_report("fsdp1-rotary-meta-init")  # report.render of the recorded bundle, once a run (conftest)
    head = page[:page.index("id='environment'")]
    assert "What happened" in head and "rank 1&#x27;s `inv_freq` is rank 0&#x27;s fp32 bytes read as bf16" in head
    assert "wb-fig-1" in head  # the diagnosis figure comes before any other
    assert "first seen at `cast`, still there at `forward`" in page
    assert "It parts from the bug path at step `cast`" in head
    bug = page[page.index("id='run-0'"):page.index("id='run-1'")]
    assert bug.count("2 tensor(s) with bfloat16 on rank 1, float32 on rank 0") == 1  # was once per step


def test_rank_lists_in_sentences_stay_short_at_scale():
    from workbench.analysis.diagnosis import _ranks

    assert _ranks([1]) == "rank 1" and _ranks([1, 0]) == "ranks 0,1"
    assert _ranks(range(1, 64)) == "ranks 1-63"
    assert _ranks([0, 1, 2, 5, 7, 8, 9, 10]) == "ranks 0-2,5,7-10"


def test_the_demo_says_what_the_diagnosis_says():
    """`make demo`'s closing line and the headline's diagnosis tell one story: rank 0's call was released by
    the workbench (a deadlock proven from the ledgers), not timed out."""
    d = bundle.load(ROOT / "fixtures" / "bundles" / "fsdp1-rotary-meta-init.wbundle").bug.diagnose()
    assert "rank 0 hung in broadcast #2 (released by the workbench)" in d.sentence, d.sentence
    demo = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    said = " ".join(line for line in demo.splitlines() if "echo" in line)
    assert "released by the workbench" in said and "timed out" not in said, said


def test_no_ranks_exception_is_left_out_of_the_sentence():
    """A fault the story starts from, then a user's exception in a later step: both are in the sentence."""
    poisoned = poison_(torch.empty(8))
    t = steps(("materialize", [[("w", torch.ones(8))], [("w", poisoned)]]),
              ("later", [[("w", torch.ones(8))], [("w", poisoned)]]))
    tb = 'Traceback (most recent call last):\n  File "/w/my.py", line 30, in later\n'
    ev = [{"step": "later", "step_index": 1, "rank": 1, "kind": "error", "error": "KeyError", "message": "'bias'",
           "traceback": tb}]
    d = diagnosis.diagnose(record(t, events=ev))
    assert d.sentence.startswith("`w` on rank 1 was never written"), d.sentence
    assert d.sentence.endswith("; rank 1 raised KeyError at w/my.py:30 later in step `later`: 'bias'"), d.sentence
