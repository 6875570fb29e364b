"""Stage ``tensor``: how the first wrong tensors read, at the step they went wrong in and stayed wrong from.

Never written since materialisation; mislabeled or rounded by a weight sync; the same wrong value
on every rank (only the reference sees it); another value; a dtype split; plain divergence. Then a
tie that broke there (why a never-written tensor was never written).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import pandas as pd

from workbench.analysis import weightsync
from workbench.analysis.collectives import is_number
from workbench.analysis.diagnosis_rules.rule import Rule, always, walk
from workbench.analysis.diagnosis_run import Run, broken_tie
from workbench.analysis.diagnosis_type import Clause, Diagnosis
from workbench.analysis.diagnosis_words import (
    dt,
    ev_frame,
    named,
    outputs_clause,
    real_before,
    said,
    short,
    tensors,
)
from workbench.analysis.findings import clobbered
from workbench.analysis.frames import fmt
from workbench.analysis.rankgroups import rank_ranges, ranks_words


class TensorFacts:
    """What the tensor stage reads: faults (rank, name, status, since, ...) and the last step's bad outputs."""

    def __init__(self, run: Run, faults: pd.DataFrame, bad_out: list[dict[str, Any]]) -> None:
        self.run, self.bad_out, self.among = run, bad_out, run.names
        self.faults = faults.assign(order=faults["since"].map(run.index)).sort_values(["order", "rank"])
        self.first = self.faults.iloc[0]
        self.step = self.first["since"]
        self.at_first = self.faults[self.faults["since"] == self.step]  # the faults of the first step

    def rows(self) -> list[dict[str, Any]]:
        """The evidence: each fault (at most 50), then each bad output."""
        ev = [{"step": f.since, "rank": f.rank, "what": f.name, "fact": f"{f.status} since `{f.since}`: {f.detail}"}
              for f in self.faults.itertuples(index=False)][:50]
        return ev + [{"step": b["step"], "rank": b["rank"], "what": b["name"], "fact": b["how"]} for b in self.bad_out]

    @cached_property
    def out(self) -> Clause:
        return outputs_clause(self.bad_out)

    @cached_property
    def never(self) -> pd.DataFrame:
        """Tensors never written since materialisation (poison, or NaN computed from poison)."""
        a = self.at_first
        return a[(a["status"] == "poison") | (a["since_status"] == "poison")]

    @cached_property
    def ref(self) -> pd.DataFrame:
        """Tensors that depart from their reference value."""
        return self.at_first[self.at_first["status"] == "reference"]

    @cached_property
    def synced(self) -> pd.DataFrame:
        """A weight sync's loaded names against the trainer's exported tensors (only when a reference departs)."""
        return weightsync.match_matrix(self.run, self.step) if len(self.ref) \
            else pd.DataFrame(columns=weightsync.MATCH_COLUMNS)

    def hits(self, status: str) -> list[str]:
        return list(self.synced[self.synced["status"] == status]["finding"])

    @cached_property
    def ref_rows(self) -> pd.DataFrame:
        """The first departing tensor's rows on every rank."""
        t = self.run.at(self.run.tensors, self.step)
        return t[t["name"] == self.ref["name"].iloc[0]]

    @property
    def agreed(self) -> bool:
        """Every rank holds the same bytes of it."""
        g, all_ranks = self.ref_rows, self.run.ranks
        return set(g["rank"]) == set(all_ranks) and g["fingerprint"].nunique() == 1 and len(all_ranks) > 1

    @property
    def worst(self) -> float:
        return max((float(x) for x in self.ref_rows["ref_diff"] if is_number(x) and float(x) == float(x)),
                   default=float("nan"))

    @cached_property
    def split(self) -> pd.DataFrame:
        """Tensors whose run of wrong steps began with a dtype split."""
        return self.at_first[self.at_first["since_status"] == "dtype"]

    @cached_property
    def tie(self) -> tuple[str, str] | None:
        """(name, partner): a never-written tensor that was one tensor with ``partner`` the step before."""
        return broken_tie(self.run, self.step, list(dict.fromkeys(self.never["name"]))) if len(self.never) else None


MATERIALISED = "to_empty"  # the automatic point right after ``to_empty`` (``job/hooks.py``): every tensor it made
# reads unwritten there, whatever the job writes next


def when_unwritten_unseen(f: TensorFacts) -> bool:
    """the never-written tensors were seen unwritten only at the point right after ``to_empty`` made them (where any
    tensor it made reads so), and no later point looked at them"""
    if not len(f.never) or f.step != MATERIALISED:
        return False
    run, step, names = f.run, f.step, set(f.never["name"])
    if real_before(run, step, list(names), sorted(set(f.never["rank"]))):
        return False  # real before: replaced by unwritten memory there, which is itself the finding
    return not any(run.at(run.tensors, s)["name"].isin(names).any() for s in run.steps[run.index(step) + 1:])


def says_unwritten_unseen(f: TensorFacts) -> Diagnosis:
    """`t` on rank R were unwritten at step `to_empty`, the first point after their materialisation, and no later
    point looked at them: whether the job wrote them is not known"""
    names = list(dict.fromkeys(f.never["name"]))
    ranks = sorted(set(f.never["rank"]))
    were, their, them = ("was", "its", "it") if len(names) == 1 else ("were", "their", "them")
    head = (f"{named(names, f.among)} on {ranks_words(ranks)} {were} unwritten at step `{f.step}`, the first point "
            f"after {their} materialisation, and no later point looked at {them}: whether the job wrote {them} is not "
            "known")
    return Diagnosis("unwritten-unseen", [tensors(head, names), f.out], f.step, ranks, names[0], None,
                     ev_frame(f.rows()))


def when_never_written(f: TensorFacts) -> bool:
    """a tensor holds memory never written since materialisation (poison, or NaN computed from it)"""
    return len(f.never) > 0


def says_never_written(f: TensorFacts) -> Diagnosis:
    """`t` on rank R was never written after materialisation at step `S` (or: was real (not meta) before step
    `S` and was replaced there by memory never written since): `forward` read the unwritten bytes; output …;
    every rank holds the same garbage, so a cross-rank check sees nothing"""
    run, never, step, among = f.run, f.never, f.step, f.among
    all_ranks = run.ranks
    names = list(dict.fromkeys(never["name"]))
    ranks = sorted(set(never["rank"]))
    read = [s for s in run.steps[run.index(step):] if len(run.at(run.outputs, s))]
    agree = set(ranks) == set(all_ranks) and len(all_ranks) > 1
    real = real_before(run, step, names, ranks)
    was = "was" if len(names) == 1 else "were"
    head = (f"{named(names, among)} on {ranks_words(ranks)} {was} real (not meta) before step `{step}` "
            f"({real}) and {was} replaced there by memory never written since"
            if real else
            f"{named(names, among)} on {ranks_words(ranks)} {was} never written after materialisation at "
            f"step `{step}`")
    head = clobbered_head(run, names, ranks, step) or head
    kept = never[never["status"] == "nan"]
    clauses = [tensors(head, names),
               said((f": `{read[0]}` read the unwritten bytes" if read else ": still unwritten at the last step")
                    + (f"; in-place updates kept it NaN through step `{kept['last'].iloc[0]}`" if len(kept) else "")),
               f.out, said("; every rank holds the same garbage, so a cross-rank check sees nothing" if agree else "")]
    return Diagnosis("never-written", clauses, step, ranks, names[0], None, ev_frame(f.rows()))


def clobbered_head(run: Run, names: list[str], ranks: list[int], step: str) -> str:
    """The capture's own sentence on the first of ``names`` that ``to_empty`` replaced although it was real (its
    library's and user's lines), the rest named after it; empty when the capture saw no such call."""
    told = clobbered(run.notes)
    hit = [n for n in names if _told_of(n, told)]
    if not hit:
        return ""
    sentence = _told_of(hit[0], told)
    rest = [n for n in names if n != hit[0]]
    also = f"; so {'was' if len(rest) == 1 else 'were'} {named(rest, run.names)}" if rest else ""
    return f"{sentence} (on {ranks_words(ranks)}{also}; seen at step `{step}`)"


def _told_of(name: str, told: dict[str, tuple[str, list[int]]]) -> str:
    """The note's sentence on ``name`` (as probed: ``model.`` + its path from the module the note names it by)."""
    return next((sentence for path, (sentence, _) in told.items() if name == path or name.endswith("." + path)), "")


def _synced(f: TensorFacts, status: str, mechanism: str, what: str) -> Diagnosis:
    """A weight sync loaded names with the wrong content: say whose tensor each one now holds."""
    hits, ref, step = f.hits(status), f.ref, f.step
    ranks = sorted(set(ref["rank"]))
    clauses = [tensors(f"{hits[0]}: {len(hits)} loaded name(s) {what} from step `{step}` on, and nothing raised",
                       list(dict.fromkeys(ref["name"]))), f.out]
    via = weightsync.sliced_with(f.run, step) if status == "mislabel" else None
    if via is not None:
        ws = via["workers"]
        who = (f"worker {ws[0]} sliced trainer rank {ws[0]}'s buffer" if len(ws) == 1 else
               f"{ranks_words(ws).replace('ranks', 'workers', 1)} sliced their own trainer ranks' buffers")
        clauses.insert(0, said(f"{who} with rank {via['rank']}'s metadata (names and offsets): "))
    ev = [{"step": step, "rank": None, "what": status, "fact": m} for m in hits[:20]] + f.rows()
    return Diagnosis(mechanism, clauses, step, ranks, str(ref["name"].iloc[0]), None, ev_frame(ev))


def when_mislabeled(f: TensorFacts) -> bool:
    """a weight sync loaded names holding another exported tensor's bytes"""
    return bool(f.hits("mislabel"))


def says_mislabeled(f: TensorFacts) -> Diagnosis:
    """(worker W sliced trainer rank W's buffer with rank R's metadata (names and offsets):) `a` holds `b`: N
    loaded name(s) hold another exported tensor's bytes from step `S` on, and nothing raised"""
    return _synced(f, "mislabel", "mislabeled", "hold another exported tensor's bytes")


def when_lossy_cast(f: TensorFacts) -> bool:
    """a weight sync loaded names holding the trainer's values rounded by its cast"""
    return bool(f.hits("cast"))


def says_lossy_cast(f: TensorFacts) -> Diagnosis:
    """`a` …: N loaded name(s) hold the trainer's values rounded by the sync's cast from step `S` on, and nothing
    raised"""
    return _synced(f, "cast", "lossy-cast", "hold the trainer's values rounded by the sync's cast")


def when_agreed_wrong(f: TensorFacts) -> bool:
    """a tensor departs from its reference value with the same bytes on every rank"""
    return len(f.ref) > 0 and f.agreed


def says_agreed_wrong(f: TensorFacts) -> Diagnosis:
    """every rank holds the same wrong `t` from step `S` (departs from its reference value by X): a cross-rank
    comparison sees nothing"""
    names, ranks = list(dict.fromkeys(f.ref["name"])), sorted(set(f.ref["rank"]))
    clauses = [tensors(f"every rank holds the same wrong {named(names, f.among)} from step `{f.step}` (departs "
                       f"from its reference value by {fmt(f.worst)}): a cross-rank comparison sees nothing", names),
               f.out]
    return Diagnosis("agreed-wrong", clauses, f.step, ranks, names[0], None, ev_frame(f.rows()))


def when_wrong_value(f: TensorFacts) -> bool:
    """a tensor departs from its reference value"""
    return len(f.ref) > 0


def says_wrong_value(f: TensorFacts) -> Diagnosis:
    """`t` on rank R departs from its reference value (by X) from step `S`"""
    names, ranks = list(dict.fromkeys(f.ref["name"])), sorted(set(f.ref["rank"]))
    clauses = [tensors(f"{named(names, f.among)} on {ranks_words(ranks)} departs from its reference value "
                       f"(by {fmt(f.worst)}) from step `{f.step}`", names), f.out]
    return Diagnosis("wrong-value", clauses, f.step, ranks, names[0], None, ev_frame(f.rows()))


def when_dtype_split(f: TensorFacts) -> bool:
    """a tensor's dtype split across ranks and stayed split"""
    return len(f.split) > 0


def says_dtype_split(f: TensorFacts) -> Diagnosis:
    """`t` split by dtype at step `S` (fp32 on rank 0, bf16 on rank 1) and stayed split"""
    names = list(dict.fromkeys(f.split["name"]))
    t = f.run.at(f.run.tensors, f.step)
    g = t[t["name"] == names[0]]
    per = ", ".join(f"{dt(d)} on rank {int(r)}" for r, d in zip(g["rank"], g["dtype"]))
    clauses = [tensors(f"{named(names, f.among)} split by dtype at step `{f.step}` ({per}) and stayed split", names),
               f.out]
    return Diagnosis("dtype-split", clauses, f.step, sorted(set(f.split["rank"])), names[0], None, ev_frame(f.rows()))


def _replicas(f: TensorFacts) -> tuple[str, list[list[int]]] | None:
    """(mesh dims, the replicas' ranks) when the first diverging tensor is a DTensor replicated along mesh dims
    whose replicas hold different bytes: ``("mesh dim `replicate`", [[0, 1], [2, 3]])``."""
    if f.first["status"] != "differs":
        return None
    t = f.run.at(f.run.tensors, f.step)
    if "replica" not in t or "agree_by" not in t:
        return None
    g = t[t["name"] == f.first["name"]]
    by = [b for b in g["agree_by"] if isinstance(b, str) and b.startswith("mesh dim")]
    if not by or g["replica"].map(lambda v: isinstance(v, str) and v != "").sum() < len(g):
        return None
    groups: dict[str, list[int]] = {}
    for r, rep in sorted(zip(g["rank"], g["replica"])):
        groups.setdefault(rep, []).append(int(r))
    return (by[0], list(groups.values())) if len(groups) > 1 else None


def when_replicas_parted(f: TensorFacts) -> bool:
    """a DTensor replicated along mesh dims holds different bytes on its replicas"""
    return _replicas(f) is not None


def replica_sides(groups: list[list[int]]) -> str:
    """``ranks 0,1 vs 2,3``; ``ranks 0-3 vs 4-7``: every side shortened alike, so a 64-rank mesh stays one line."""
    return " vs ".join(rank_ranges(g, shortest=3) if i else ranks_words(g) for i, g in enumerate(groups))


def says_replicas_parted(f: TensorFacts) -> Diagnosis:
    """`t` differs between the replicas (mesh dim `replicate`: ranks 0,1 vs 2,3) from step `S`"""
    by, groups = _replicas(f)
    names = list(dict.fromkeys(f.at_first[f.at_first["status"] == "differs"]["name"]))
    ranks = sorted(set(f.at_first["rank"]))
    sides = replica_sides(groups)
    verb = "differs" if len(names) == 1 else "differ"
    clauses = [tensors(f"{named(names, f.among)} {verb} between the replicas ({by}: {sides}) from step `{f.step}`",
                       names), f.out]
    return Diagnosis("replicas-parted", clauses, f.step, ranks, names[0], None, ev_frame(f.rows()))


def says_diverged(f: TensorFacts) -> Diagnosis:
    """`t` on rank R <status> from step `S` on (detail)"""
    names, ranks = list(dict.fromkeys(f.at_first["name"])), sorted(set(f.at_first["rank"]))
    status = "differ" if f.first["status"] == "differs" and len(names) > 1 else f.first["status"]
    clauses = [tensors(f"{named(names, f.among)} on {ranks_words(ranks)} {status} from step `{f.step}` "
                       f"on ({f.first['detail']})", names), f.out]
    return Diagnosis("diverged", clauses, f.step, ranks, names[0], None, ev_frame(f.rows()))


def when_tie_broken(f: TensorFacts, d: Diagnosis) -> bool:
    """the never-written tensor was one tensor with another (tied) the step before and is its own after"""
    return d.mechanism == "never-written" and f.tie is not None


def says_tie_broken(f: TensorFacts, d: Diagnosis) -> Diagnosis:
    """…; `a` and `b` were one tensor (tied) until step `S` and are two after it: the tie broke there, so what
    was written into `b` never reached `a` (tie them again after materialising, …)"""
    (name, partner), step, among = f.tie, f.step, f.among
    d.add(tensors(f"; `{short(name, among)}` and `{short(partner, among)}` were one tensor (tied) until step "
                  f"`{step}` and are two after it: the tie broke there, so what was written into "
                  f"`{short(partner, among)}` never reached `{short(name, among)}` (tie them again after "
                  "materialising, e.g. `tie_weights()` after `to_empty`)", (name, partner)))
    d.evidence = pd.concat([ev_frame([{"step": step, "rank": None, "what": "tie broken",
                                       "fact": f"{name} shared {partner}'s tensor before step `{step}`, holds its own "
                                               "after"}]), d.evidence], ignore_index=True)
    return d


# -- the order: tried top to bottom ------------------------------------------------------------------
RULES: tuple[Rule, ...] = (
    Rule("tensor", "unwritten-unseen", when_unwritten_unseen, says_unwritten_unseen),
    Rule("tensor", "never-written", when_never_written, says_never_written),
    Rule("tensor", "mislabeled", when_mislabeled, says_mislabeled),
    Rule("tensor", "lossy-cast", when_lossy_cast, says_lossy_cast),
    Rule("tensor", "agreed-wrong", when_agreed_wrong, says_agreed_wrong),
    Rule("tensor", "wrong-value", when_wrong_value, says_wrong_value),
    Rule("tensor", "dtype-split", when_dtype_split, says_dtype_split),
    Rule("tensor", "replicas-parted", when_replicas_parted, says_replicas_parted),
    Rule("tensor", "diverged", always, says_diverged),
    Rule("tensor", "tie-broken", when_tie_broken, says_tie_broken, adds=True),
)


def tell(facts: Any) -> Diagnosis:
    """This stage's story: its rules walked in order."""
    return walk(RULES, facts)
