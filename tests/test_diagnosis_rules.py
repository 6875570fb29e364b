"""Each rule of the diagnosis on its own: when it fires, what it says, and the rule above it that pre-empts it.

No engines: runs are real probe rows of small tensors, ledger rows and events written as the
ranks write them (see tests/test_diagnosis.py for whole stories and the recorded bundles).
``told(stage, rec)`` is the name of the rule that tells a stage's story.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import torch

from workbench.analysis import diagnosis
from workbench.analysis.collectives import ledger_table
from workbench.analysis.diagnosis_rules import RULES, STAGES, exception, first, story
from workbench.analysis.diagnosis_rules.exception import ExceptionFacts
from workbench.analysis.diagnosis_rules.parting import PartFacts
from workbench.analysis.diagnosis_rules.rule import Rule, always
from workbench.analysis.diagnosis_rules.story import RunFacts
from workbench.analysis.diagnosis_rules.tensor import TensorFacts
from workbench.analysis.diagnosis_run import Run, persistent_faults
from workbench.analysis.diagnosis_type import Diagnosis
from workbench.analysis.diagnosis_words import said
from workbench.analysis.frames import COLUMNS, EVENT_COLUMNS, OUTPUT_COLUMNS, table
from workbench.rank.poison import poison_
from workbench.rank.probe import probe_tensors

W = torch.linspace(-1, 1, 16)


def probed(*per_step: tuple[str, list[list[tuple]]]) -> pd.DataFrame:
    """Per step, per rank: (name, tensor[, {extra column: value}])."""
    rows = []
    for i, (step, ranks) in enumerate(per_step):
        for rank, items in enumerate(ranks):
            got = probe_tensors([(it[0], "buffer", it[1]) for it in items], rank)
            for row, it in zip(got, items):
                rows.append({"step": step, "step_index": i, **row, **(it[2] if len(it) > 2 else {})})
    return table(rows, ["step", "step_index", *COLUMNS])


def outputs(step: str, per_rank: list[torch.Tensor]) -> pd.DataFrame:
    rows = [{"step": step, "step_index": 0, **probe_tensors([("logits", "output", t)], r)[0]}
            for r, t in enumerate(per_rank)]
    return table(rows, ["step", "step_index", *OUTPUT_COLUMNS])


def call(rank: int, seq: int, op: str, step: str = "sync", group: str = "0", members=(0, 1), **kw) -> dict:
    return {"rank": rank, "session": "s", "attempt": 0, "step": step, "group": group, "group_ranks": list(members),
            "seq": seq, "op": op, "dtypes": ["float32"], "shapes": [[4]], "numel": 4, "bytes": 16,
            "src": 0 if op == "broadcast" else None, "state": "completed", "t_start": float(seq + rank / 10), **kw}


def event(step: str, rank: int, kind: str = "error", error: str = "KeyError", message: str = "'bias'") -> dict:
    return {"step": step, "step_index": 0, "rank": rank, "kind": kind, "error": error, "message": message,
            "traceback": ""}


def rec(t: pd.DataFrame, outs: pd.DataFrame | None = None, events=(), ledger=(), notes=(), ranks: int = 2,
        **manifest) -> SimpleNamespace:
    return SimpleNamespace(
        manifest={"steps_run": list(dict.fromkeys(t["step"])), "ranks": ranks, **manifest}, tensors=t,
        outputs=outs if outs is not None else pd.DataFrame(), trace=pd.DataFrame(), notes=list(notes),
        events=table(list(events), ["step", "step_index", *EVENT_COLUMNS]), ledger=ledger_table(list(ledger)))


def told(stage: str, r: SimpleNamespace) -> str:
    """The rule that tells ``stage``'s story (the story stage's told first, for the exception stage)."""
    run = Run.of(r)
    f = RunFacts(run)
    if stage == "exception":
        f = ExceptionFacts(run, story.tell(f))
    return first(stage, f).name


def same(n: int = 2, *items) -> list[list[tuple]]:
    """Every rank holds the same tensors."""
    return [[(name, t.clone(), *extra) for name, t, *extra in items] for _ in range(n)]


OK = same(2, ("x", W))
UNWRITTEN = [[("w", W)], [("w", poison_(torch.empty(16)))]]
PARTED = [call(0, 1, "all_reduce"), call(1, 1, "all_gather_into_tensor")]


# -- the list ----------------------------------------------------------------------------------------
def test_the_list_is_the_order_and_each_rule_says_when_and_what():
    table_ = diagnosis.rules()
    assert list(table_.columns) == ["stage", "rule", "adds", "fires when", "says"]
    assert list(table_["rule"]) == [r.name for r in RULES] and len(set(table_["rule"])) == len(RULES)
    assert list(dict.fromkeys(table_["stage"])) == list(STAGES)
    assert table_["fires when"].str.len().min() > 10 and table_["says"].str.len().min() > 10
    for stage, module in STAGES.items():  # the last rule that tells a stage always fires: every run gets a story
        assert {r.stage for r in module.RULES} == {stage}
        tellers = [r for r in module.RULES if not r.adds]
        assert tellers[-1].when is always and all(r.when is not always for r in tellers[:-1])
    assert [r.name for r in RULES if r.stage == "story"] == [
        "permuted", "fault-before-parting", "parted", "rank-died", "hang", "tensors-wrong", "outputs-only",
        "not-looked", "clean-so-far", "clean"]


def test_a_new_finding_is_a_rule_put_in_its_place(monkeypatch):
    """A rule inserted before `hang` tells the story of a hung run; nothing else changes."""
    r = rec(probed(("train", OK)), events=[event("train", 0, kind="timeout")])
    assert diagnosis.diagnose(r).mechanism == "hang"
    mine = Rule("story", "mine", lambda f: bool(f.stuck), lambda f: Diagnosis("mine", f"{len(f.stuck)} stuck"))
    at = next(i for i, x in enumerate(story.RULES) if x.name == "hang")
    monkeypatch.setattr(story, "RULES", (*story.RULES[:at], mine, *story.RULES[at:]))
    d = diagnosis.diagnose(r)
    assert (d.mechanism, d.sentence) == ("mine", "1 stuck")
    assert "mine" in list(diagnosis.rules()["rule"])


# -- stage "story" -----------------------------------------------------------------------------------
def order_notes(plan: list[str], stream: list[str], step: str = "deliver") -> list[dict]:
    def note(kind, names):
        doc = {"kind": kind, "stage": 1, "entries": [[n, "float32", [4]] for n in names]}
        return {"step": step, "rank": 0, "note": "order:" + json.dumps(doc)}
    return [note("plan", plan), note("stream", stream)]


def test_permuted_fires_first_and_tells_a_later_parting_after_it():
    t = probed(("deliver", OK), ("sync", OK))
    r = rec(t, notes=order_notes(["a", "b"], ["b", "a"]))
    assert told("story", r) == "permuted"
    d = diagnosis.diagnose(r)
    assert d.sentence == ("the receiver's plan and the sender's stream part at index 0 of stage 1: the plan lists "
                          "`a` there, the stream carries `b`, so 2 of 2 planned names load other tensors' bytes and "
                          "nothing raised")
    later = diagnosis.diagnose(rec(t, notes=order_notes(["a", "b"], ["b", "a"]), ledger=PARTED))
    assert later.mechanism == "permuted" and later.call["op"] == "all_gather_into_tensor"  # the deviating rank's
    assert later.sentence.startswith(d.sentence + "; later, in step `sync`: the ranks' collectives part at group 0 "
                                     "call #1 in step `sync` (different collectives)"), later.sentence
    assert told("story", rec(t, notes=order_notes(["a", "b"], ["a", "b"]))) == "clean"  # same order: no story


def test_a_fault_before_the_parting_leads_it():
    t = probed(("load", UNWRITTEN), ("sync", OK))
    r = rec(t, ledger=PARTED)
    assert told("story", r) == "fault-before-parting"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "never-written" and d.step == "load" and d.call["op"] == "all_gather_into_tensor"
    assert d.sentence.startswith("`w` on rank 1 was never written after materialisation at step `load`: still "
                                 "unwritten at the last step; later, in step `sync`: the ranks' collectives part"), \
        d.sentence
    # a fault in the parting's own step is not before it: the parting tells the story
    assert told("story", rec(probed(("sync", UNWRITTEN)), ledger=[{**c, "step": "sync"} for c in PARTED])) == "parted"


def test_parted_pre_empts_a_rank_that_died():
    r = rec(probed(("sync", OK)), ledger=PARTED, events=[event("sync", 1, kind="died")])
    assert told("story", r) == "parted"
    assert told("story", rec(probed(("sync", OK)), events=[event("sync", 1, kind="died")])) == "rank-died"


def test_rank_died_pre_empts_the_rank_it_left_hanging():
    r = rec(probed(("train", OK)), events=[event("train", 1, kind="died"), event("train", 0, kind="timeout")])
    assert told("story", r) == "rank-died"
    d = diagnosis.diagnose(r)
    assert d.sentence == "rank 1's engine died in step `train`; rank 0 hung past the step deadline"
    assert d.ranks == [1]


def test_hang_pre_empts_wrong_tensors():
    r = rec(probed(("train", UNWRITTEN)), events=[event("train", 0, kind="timeout")])
    assert told("story", r) == "hang"
    assert diagnosis.diagnose(r).sentence == ("step `train` did not finish: rank 0 hung past the step deadline; the "
                                              "ranks' ledgers agree call for call, so no collective was mispaired")


def test_tensors_wrong_pre_empts_outputs_and_skips_per_rank_tensors_when_outputs_agree():
    nan = [torch.ones(8), torch.full((8,), float("nan"))]
    assert told("story", rec(probed(("f", UNWRITTEN)), outputs("f", nan))) == "tensors-wrong"
    per_rank = [[("seed", W, {"kind": "tensor"})], [("seed", W * 2, {"kind": "tensor"})]]
    agree = outputs("f", [torch.ones(8), torch.ones(8)])
    assert told("story", rec(probed(("f", per_rank)), agree)) == "clean"  # they differ by design
    assert told("story", rec(probed(("f", per_rank)))) == "tensors-wrong"  # no outputs to say they agree


def test_outputs_only_when_every_tensor_agrees():
    r = rec(probed(("f", OK)), outputs("f", [torch.ones(8), torch.full((8,), float("nan"))]))
    assert told("story", r) == "outputs-only"
    assert diagnosis.diagnose(r).sentence == (
        "outputs depart at step `f`; output `logits` on rank 1: 8 of 8 values NaN, while every probed tensor agrees "
        "across ranks and with its reference: the cause is outside what was probed")


def test_clean_so_far_then_clean():
    part = rec(probed(("a", OK)), steps=["a", "b", "c"])
    assert told("story", part) == "clean-so-far"
    assert diagnosis.diagnose(part).sentence == ("clean so far: 1 of 3 steps ran on every rank, the ranks agree and no "
                                                 "detector fired on the latest state")
    assert diagnosis.diagnose(rec(probed(("a", OK), ("b", OK)))).sentence == (
        "clean: all 2 step(s) ran on every rank, the ranks agree and no detector fired on the final state")


# -- stage "parting" ---------------------------------------------------------------------------------
def parting(r: SimpleNamespace) -> str:
    run = Run.of(r)
    return first("parting", PartFacts(run, RunFacts(run).div)).name


def test_rank_missing():
    r = rec(probed(("sync", OK)), ledger=[call(0, 1, "all_reduce"), call(1, 1, "all_reduce"), call(0, 2, "barrier")])
    assert parting(r) == "rank-missing"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "rank-missing" and d.ranks == [1]
    assert d.sentence == ("rank 1 never issued group 0 call #2 that rank 0 issued in step `sync` (barrier #2 "
                          "float32 [4] 16 B)")


INV = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
BF = torch.linspace(-1, 1, 64).to(torch.bfloat16)


def bucketed(received: torch.Tensor) -> SimpleNamespace:
    """Rank 0 sends an extra fp32 bucket (`inv_freq`) that rank 1 receives into its bf16 bucket."""
    cast = [[("inv_freq", INV), ("w", BF)], [("inv_freq", INV.to(torch.bfloat16)), ("w", BF)]]
    wrap = [[("inv_freq", INV), ("w", BF)], [("inv_freq", received), ("w", BF.clone())]]
    led = [call(0, 1, "broadcast", step="wrap", dtypes=["float32"], numel=32, bytes=128, via="_broadcast_coalesced",
                bucket_tensors=1),
           call(0, 2, "broadcast", step="wrap", dtypes=["bfloat16"], numel=64, bytes=128, via="_broadcast_coalesced",
                bucket_tensors=1),
           call(1, 1, "broadcast", step="wrap", dtypes=["bfloat16"], numel=96, bytes=192, via="_broadcast_coalesced",
                bucket_tensors=2)]
    return rec(probed(("cast", cast), ("wrap", wrap)), ledger=led)


def test_reinterpreted_pre_empts_mispaired():
    r = bucketed(INV.view(torch.bfloat16)[:32].clone())  # rank 0's fp32 bytes, read as bf16
    assert parting(r) == "reinterpreted"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "reinterpreted" and d.step == "cast" and d.tensor == "inv_freq"
    assert d.sentence == (
        "rank 1's `inv_freq` is rank 0's fp32 bytes read as bf16: `_broadcast_coalesced` bucketed by dtype after "
        "`cast` split the dtypes, rank 0 sent an extra fp32 bucket (broadcast #1, 128 B: `inv_freq`) that rank 1 "
        "received into its bf16 bucket")


def test_mispaired_pre_empts_collective_mismatch():
    r = bucketed(torch.zeros(32, dtype=torch.bfloat16))  # nothing recognisable landed
    assert parting(r) == "mispaired"
    d = diagnosis.diagnose(r)
    assert (d.mechanism, d.ranks, d.tensor) == ("mispaired", [1], "inv_freq")
    assert d.sentence.startswith("`_broadcast_coalesced` bucketed by dtype after `cast` split the dtypes, rank 0 sent "
                                 "an extra fp32 bucket (broadcast #1, 128 B: `inv_freq`) that rank 1 received into "
                                 "its bf16 bucket"), d.sentence


def test_collective_mismatch():
    r = rec(probed(("sync", OK)), ledger=PARTED)
    assert parting(r) == "collective-mismatch"
    assert diagnosis.diagnose(r).sentence == (
        "the ranks' collectives part at group 0 call #1 in step `sync` (different collectives): rank 0: all_reduce #1 "
        "float32 [4] 16 B; rank 1: all_gather_into_tensor #1 float32 [4] 16 B")


def test_independent_groups_add_their_parting():
    led = [call(0, 1, "all_reduce", group="1", members=(0, 1)), call(1, 1, "broadcast", group="1", members=(0, 1)),
           call(2, 1, "all_reduce", group="2", members=(2, 3)), call(3, 1, "barrier", group="2", members=(2, 3))]
    d = diagnosis.diagnose(rec(probed(("sync", same(4, ("x", W)))), ledger=led, ranks=4))
    assert d.mechanism == "collective-mismatch"
    assert "; independently, on group 2 (ranks 2,3): the ranks' collectives part at call #1 (different " \
           "collectives)" in d.sentence, d.sentence
    assert d.ranks == [1, 3] and "group 2" in set(d.evidence["what"])  # each group's deviating rank
    alone = diagnosis.diagnose(rec(probed(("sync", same(4, ("x", W)))), ledger=led[:2], ranks=4))
    assert "independently" not in alone.sentence


def test_independent_groups_come_before_who_was_left_stuck_even_when_outputs_follow():
    """The groups' clause goes before the stuck clause by what the clauses are, not by matching the sentence's end:
    an outputs clause after the stuck one used to push it to the end."""
    led = [call(0, 1, "all_reduce", group="1", members=(0, 1), state="timed out"),
           call(1, 1, "broadcast", group="1", members=(0, 1)),
           call(2, 1, "all_reduce", group="2", members=(2, 3)), call(3, 1, "barrier", group="2", members=(2, 3))]
    nan = torch.full((4,), float("nan"))
    d = diagnosis.diagnose(rec(probed(("sync", same(4, ("x", W)))), outputs("sync", [W, nan, W, W]), ledger=led,
                               ranks=4))
    text = d.sentence
    groups, stuck, out = (text.index("; independently, on group 2"), text.index("; rank 0 timed out in all_reduce #1"),
                          text.index("; output `logits` on rank 1"))
    assert groups < stuck < out, text


# -- stage "tensor" ----------------------------------------------------------------------------------
def tensor_rule(r: SimpleNamespace) -> str:
    run = Run.of(r)
    return first("tensor", TensorFacts(run, persistent_faults(run), [])).name


def test_never_written_pre_empts_a_reference_departure():
    both = [[("w", W), ("b", W * 2, {"ref_diff": 1.0})], [("w", poison_(torch.empty(16))), ("b", W * 2,
                                                                                           {"ref_diff": 1.0})]]
    r = rec(probed(("load", both)))
    assert tensor_rule(r) == "never-written"
    assert diagnosis.diagnose(r).sentence == ("`w` on rank 1 was never written after materialisation at step `load`: "
                                              "still unwritten at the last step")
    every = rec(probed(("load", same(2, ("w", poison_(torch.empty(16))))), ("forward", OK)),
                outputs("forward", [torch.ones(8), torch.ones(8)]))
    assert diagnosis.diagnose(every).sentence.endswith(
        ": `forward` read the unwritten bytes; every rank holds the same garbage, so a cross-rank check sees nothing")


def test_unwritten_only_at_to_empty_and_never_looked_at_again_is_not_called_never_written():
    """The point right after ``to_empty`` reads every tensor it made unwritten: with no later point, "never written"
    cannot be known, and a raise after it leads; a later point that still reads them unwritten, or the same reading
    at a point of another name (a user's own, after their init), is "never written" as before."""
    only = rec(probed(("to_empty", UNWRITTEN)))
    assert tensor_rule(only) == "unwritten-unseen"
    assert diagnosis.diagnose(only).sentence == (
        "`w` on rank 1 was unwritten at step `to_empty`, the first point after its materialisation, and no later "
        "point looked at it: whether the job wrote it is not known")
    raised = diagnosis.diagnose(rec(probed(("to_empty", UNWRITTEN)), events=[event("after to_empty", 0)]))
    assert told("exception", rec(probed(("to_empty", UNWRITTEN)), events=[event("after to_empty", 0)])) == \
        "raised-after-unseen"
    assert raised.sentence.startswith("rank 0 raised KeyError in step `after to_empty`: 'bias'; before it: `w` on "
                                      "rank 1 was unwritten at step `to_empty`"), raised.sentence
    assert tensor_rule(rec(probed(("to_empty", UNWRITTEN), ("step1", UNWRITTEN)))) == "never-written"
    assert tensor_rule(rec(probed(("after_init", UNWRITTEN)))) == "never-written"


def test_a_tie_that_broke_adds_why_it_was_never_written():
    init = [[("embed", torch.ones(16), {"shares": "head"}), ("head", torch.ones(16), {"shares": "embed"})]
            for _ in range(2)]  # the probe's word for one tensor under two names
    mat = [[("embed", W.clone()), ("head", poison_(torch.empty(16)))] for _ in range(2)]
    d = diagnosis.diagnose(rec(probed(("init", init), ("materialize", mat))))
    assert d.mechanism == "never-written" and d.evidence["what"].iloc[0] == "tie broken"
    assert d.sentence.endswith(
        "; `head` and `embed` were one tensor (tied) until step `materialize` and are two after it: the tie broke "
        "there, so what was written into `embed` never reached `head` (tie them again after materialising, e.g. "
        "`tie_weights()` after `to_empty`)"), d.sentence
    untied = [[("embed", torch.ones(16)), ("head", torch.ones(16))] for _ in range(2)]
    assert "tie" not in diagnosis.diagnose(rec(probed(("init", untied), ("materialize", mat)))).sentence


A, B = torch.arange(4.0), torch.arange(4.0) + 10


def test_mislabeled_pre_empts_lossy_cast_and_agreed_wrong():
    rows = same(2, ("trainer.a", A), ("trainer.b", B), ("sent.a", A.to(torch.bfloat16)))
    rows = [[*x, (f"worker{r}.a", B.clone(), {"ref_diff": 10.0}), (f"worker{r}.b", A.clone(), {"ref_diff": 10.0})]
            for r, x in enumerate(rows)]  # each worker loaded `a` and `b` swapped
    r = rec(probed(("sync", rows)))
    assert tensor_rule(r) == "mislabeled"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "mislabeled" and d.evidence["what"].iloc[0] == "mislabel"
    assert d.sentence == ("worker 0 `a` holds trainer rank 0's `b`: 4 loaded name(s) hold another exported tensor's "
                          "bytes from step `sync` on, and nothing raised")


def test_lossy_cast_pre_empts_agreed_wrong():
    rows = same(2, ("trainer.a", A + 0.001), ("sent.a", (A + 0.001).to(torch.bfloat16)))
    rows = [[*x, (f"worker{r}.a", (A + 0.001).to(torch.bfloat16), {"ref_diff": 0.001})] for r, x in enumerate(rows)]
    r = rec(probed(("sync", rows)))
    assert tensor_rule(r) == "lossy-cast"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "lossy-cast"
    assert d.sentence.endswith(": 2 loaded name(s) hold the trainer's values rounded by the sync's cast from step "
                               "`sync` on, and nothing raised"), d.sentence


def test_agreed_wrong_pre_empts_wrong_value():
    r = rec(probed(("load", same(2, ("inv", INV * 2, {"ref_diff": 1.0})))))
    assert tensor_rule(r) == "agreed-wrong"
    assert diagnosis.diagnose(r).sentence == ("every rank holds the same wrong `inv` from step `load` (departs from "
                                              "its reference value by 1): a cross-rank comparison sees nothing")


def test_wrong_value_pre_empts_dtype_split():
    per = [[("inv", INV)], [("inv", (INV * 2).to(torch.bfloat16), {"ref_diff": 1.0})]]
    r = rec(probed(("load", per)))
    assert tensor_rule(r) == "wrong-value"
    assert diagnosis.diagnose(r).sentence == "`inv` on rank 1 departs from its reference value (by 1) from step `load`"


def test_dtype_split_pre_empts_diverged():
    per = [[("inv", INV)], [("inv", INV.to(torch.bfloat16))]]
    r = rec(probed(("cast", per), ("forward", per)))
    assert tensor_rule(r) == "dtype-split"
    d = diagnosis.diagnose(r)
    assert (d.mechanism, d.step, d.ranks) == ("dtype-split", "cast", [1])
    assert d.sentence == "`inv` split by dtype at step `cast` (fp32 on rank 0, bf16 on rank 1) and stayed split"


def test_diverged():
    r = rec(probed(("step", [[("w", W)], [("w", W * 3)]])))
    assert tensor_rule(r) == "diverged"
    assert diagnosis.diagnose(r).sentence == ("`w` on rank 1 differs from step `step` on (content differs from "
                                              "rank 0)")
    two = rec(probed(("step", [[("w", W), ("b", W)], [("w", W * 3), ("b", W * 3)]])))
    assert diagnosis.diagnose(two).sentence == ("`w`, `b` on rank 1 differ from step `step` on (content differs "
                                                "from rank 0)")


# -- stage "exception" -------------------------------------------------------------------------------
def test_raised_alone_pre_empts_raised_first():
    r = rec(probed(("a", OK), ("b", OK)), events=[event("b", 1)])
    assert told("exception", r) == "raised-alone"
    d = diagnosis.diagnose(r)
    assert (d.mechanism, d.sentence) == ("error", "rank 1 raised KeyError in step `b`: 'bias'")


def test_raised_independently_pre_empts_raised_leads():
    r = rec(probed(("sync", same(3, ("x", W)))), ledger=PARTED, events=[event("sync", 2)], ranks=3)
    assert told("exception", r) == "raised-independently"
    d = diagnosis.diagnose(r)
    assert d.ranks[0] == 2 and d.sentence.startswith(
        "rank 2 raised KeyError in step `sync`: 'bias'; independently, on group 0 (ranks 0,1): the ranks' "
        "collectives part"), d.sentence


def test_raised_leads_the_parting_it_caused():
    r = rec(probed(("sync", OK)), ledger=PARTED, events=[event("sync", 0)])
    assert told("exception", r) == "raised-leads"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "collective-mismatch" and d.sentence.startswith(
        "rank 0 raised KeyError in step `sync`: 'bias': the ranks' collectives part"), d.sentence


def test_raised_first_leads_what_went_wrong_later():
    r = rec(probed(("a", OK), ("b", UNWRITTEN)), events=[event("a", 0)])
    assert told("exception", r) == "raised-first"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "error" and d.sentence.startswith(
        "rank 0 raised KeyError in step `a`: 'bias'; later, in step `b`: `w` on rank 1 was never written"), d.sentence
    same_step = diagnosis.diagnose(rec(probed(("a", OK), ("b", UNWRITTEN)), events=[event("b", 0)]))
    assert "; in the same step: `w` on rank 1" in same_step.sentence


def test_a_later_exception_leaves_the_story_and_is_added_after_it():
    r = rec(probed(("a", UNWRITTEN), ("b", UNWRITTEN)), events=[event("b", 0)])
    assert told("exception", r) == "story-stands"
    d = diagnosis.diagnose(r)
    assert d.mechanism == "never-written"
    assert d.sentence.endswith("; rank 0 raised KeyError in step `b`: 'bias'"), d.sentence
    # a story that already names the raising rank adds nothing
    assert diagnosis.diagnose(rec(probed(("a", OK), ("b", OK)), events=[event("b", 1)])).sentence.count("raised") == 1


def test_an_exception_message_that_reads_like_the_sentence_changes_nothing():
    """Whether an exception is already named is read from the story's clauses, not from its words: rank 1's own
    message saying "rank 0 raised ValueError" does not hide rank 0's ValueError of a later step."""
    plain = rec(probed(("a", OK), ("b", OK)), events=[event("a", 1), event("b", 0, error="ValueError",
                                                                               message="bad shape")])
    tricky = rec(probed(("a", OK), ("b", OK)), events=[event("a", 1, message="peer says rank 0 raised ValueError"),
                                                       event("b", 0, error="ValueError", message="bad shape")])
    later = "; rank 0 raised ValueError in step `b`: bad shape"
    assert diagnosis.diagnose(plain).sentence.endswith(later)
    d = diagnosis.diagnose(tricky)
    assert d.sentence == "rank 1 raised KeyError in step `a`: peer says rank 0 raised ValueError" + later, d.sentence


def test_a_rule_added_to_a_stage_adds_to_every_story_of_it(monkeypatch):
    note = Rule("exception", "note", lambda f, d: True, lambda f, d: d.add(said(" (noted)")),
                adds=True)
    monkeypatch.setattr(exception, "RULES", (*exception.RULES, note))
    assert diagnosis.diagnose(rec(probed(("a", OK)))).sentence.endswith("final state (noted)")




def test_a_raise_before_any_point_leads_and_the_not_looked_follows_without_a_step():
    """A job that raised before its first point (a dtype error in its first forward) probed nothing: the raise
    leads, then that nothing was looked at, with no "later, in step `None`" between them."""
    t = table([], ["step", "step_index", *COLUMNS])
    raised = [event("before the first point", r, error="RuntimeError", message="mat1 and mat2") for r in (0, 1)]
    r = rec(t, events=raised, job={"optimizer_steps": 0})
    r.manifest["steps_run"] = ["before the first point"]
    d = diagnosis.diagnose(r)
    assert d.sentence.startswith("ranks 0,1 raised RuntimeError in step `before the first point`: mat1 and mat2; "
                                 "not looked: the capture probed no tensor at all"), d.sentence
    assert "None" not in d.sentence, d.sentence
