"""Stage ``parting``: how the first call on which the ranks' ledgers disagree reads.

A rank that never issued it (named dead where a captured job's shard says so); a receiving rank
whose tensor now holds the sender's bytes (an extra coalesced bucket received into another dtype's);
the extra bucket alone; different calls. Then each other group that parted in the same step on its own.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import pandas as pd

from workbench.analysis import collectives, findings
from workbench.analysis.collectives import is_number
from workbench.analysis.diagnosis_rules.rule import Rule, always, outcome_rows, walk
from workbench.analysis.diagnosis_run import Run, bucket_names, independent, split_before
from workbench.analysis.diagnosis_type import Clause, Diagnosis
from workbench.analysis.diagnosis_words import (
    PART_WORDS,
    by_value,
    calls_by_group,
    dt,
    ev_frame,
    named,
    outputs_clause,
    parting,
    possessive,
    said,
    short,
    size_of,
    stuck_clause,
    tensors,
)
from workbench.analysis.rankgroups import ranks_words


class PartFacts:
    """What the parting stage reads: one divergence, the calls on each side, what it left on the receivers."""

    def __init__(self, run: Run, div: collectives.Divergence) -> None:
        self.run, self.div = run, div
        self.among = run.names
        self.calls = dict(div.calls)
        self.sender = div.rank
        self.call = self.calls.get(self.sender) or {}
        self.absent = [r for r, c in self.calls.items() if c is None]
        others = [r for r in self.calls if r != self.sender]
        self.receiver = others[0] if others else self.sender
        self.rcall = self.calls.get(self.receiver) or {}
        self.receivers = [r for r in others if (self.calls.get(r) or {}).get("dtypes") == self.rcall.get("dtypes")] \
            or [self.receiver]

    @property
    def stuck(self) -> list[dict[str, Any]]:
        return self.run.stuck

    @cached_property
    def split(self) -> tuple[str, list[str], dict] | None:
        """Where tensors of the calls' dtypes split by dtype across ranks and stayed split into the call's step."""
        return split_before(self.run, self.div.step, {str(c.get("dtypes")) for c in self.calls.values() if c})

    @cached_property
    def bucket(self) -> list[str]:
        """The tensors the sender's coalesced bucket held."""
        return bucket_names(self.run, self.sender, self.call) if self.call.get("via") else []

    @property
    def extra_bucket(self) -> bool:
        """The sender issued a coalesced bucket the others did not."""
        return self.div.kind == "extra" and bool(self.call.get("via"))

    @cached_property
    def tensors(self) -> pd.DataFrame:
        return self.run.at(self.run.tensors, self.div.step)

    @cached_property
    def re_rows(self) -> list[dict[str, Any]]:
        """Tensors on ranks other than the sender holding another tensor's (or dtype's) bytes."""
        t = self.tensors
        return [m for m in findings.reinterpretations(t) if m["rank"] != self.sender] if len(t) else []

    @cached_property
    def never(self) -> list[str]:
        """The receiver's tensors never written in the call's step."""
        st = self.status
        return st[(st["rank"] == self.receiver) & (st["status"] == "poison")]["name"].tolist() if len(st) else []

    @cached_property
    def status(self) -> pd.DataFrame:
        return self.run.status.get(self.div.step, pd.DataFrame(columns=["rank", "name", "status"]))

    def call_rows(self) -> list[dict[str, Any]]:
        """Each rank's call (or its absence), then who timed out, hung or died."""
        div = self.div
        return [{"step": div.step, "rank": r, "what": f"{c['op']} #{c['seq']}" if c else "(no call)",
                 "fact": collectives.describe(c) if c else f"never issued call #{div.seq} on group {div.group}"}
                for r, c in sorted(self.calls.items())] + outcome_rows(self.stuck)

    def evidence(self) -> pd.DataFrame:
        """The dtype split first, the calls and outcomes, then what the transfer left behind."""
        rows, div, among = self.call_rows(), self.div, self.among
        if self.split:
            split = self.split
            per = by_value(sorted(split[2].items()))
            rows.insert(0, {"step": split[0], "rank": None, "what": "dtype split",
                            "fact": f"{named(split[1], among)}: " + ", ".join(
                                f"{dt(d)} on {ranks_words(rs)}" for d, rs in per.items())})
        rows += [{"step": div.step, "rank": m["rank"], "what": m["name"], "fact": m["finding"]} for m in self.re_rows]
        if self.never:
            rows.append({"step": div.step, "rank": self.receiver, "what": "never written",
                         "fact": f"{len(self.never)} tensor(s): {named(self.never, among, 5)}"})
        return ev_frame(rows)

    @cached_property
    def tail(self) -> list[Clause]:
        """The rest of the receivers' tensors never written; who then hung or died; the outputs."""
        rest = []
        if self.never:
            st = self.status
            never_on = sorted(set(st[(st["status"] == "poison") & st["name"].isin(self.never)]["rank"]))
            rest = [said(f"; the rest of {possessive(never_on)} tensors were never written")]
        return [*rest, stuck_clause(self.stuck), outputs_clause(self.run.bad_outputs)]

    @property
    def first_step(self) -> str:
        return self.split[0] if self.split else self.div.step

    @property
    def bucket_what(self) -> str:
        call, rcall, receivers = self.call, self.rcall, self.receivers
        return (f"rank {self.sender} sent an extra {dt(call.get('dtypes'))} bucket ({call['op']} #{call['seq']}, "
                f"{size_of(call)}" + (f": {named(self.bucket, self.among)}" if self.bucket else "") + ")"
                f" that {ranks_words(receivers)} received into {'its' if len(receivers) == 1 else 'their'} "
                f"{dt(rcall.get('dtypes'))} bucket")

    @property
    def bucket_how(self) -> str:
        return f"`{self.call['via']}` bucketed by dtype" + (f" after `{self.split[0]}` split the dtypes"
                                                            if self.split else "")

    @cached_property
    def also(self) -> list[collectives.Divergence]:
        """The other groups that part in the same step and share no rank with this one."""
        return independent(self.run, self.div)


def _dead(f: PartFacts) -> dict[int, str]:
    """The ranks a captured job's shards name dead (no close, the process gone): rank -> their line
    (``postmortem/shards.py`` words it). Not a rank whose ledger ends inside a call: it was waiting there when its
    process ended (the workbench ends every rank of a deadlock its ledgers proved), and where it waits is the
    fact (rank 1 in its final barrier while rank 0 waits for its send)."""
    job = f.run.manifest.get("job") or {}
    waiting = {int(s["rank"]) for s in f.stuck}
    return {int(r): str(d.get("line")) for r, d in (job.get("dead") or {}).items() if int(r) not in waiting}


def when_rank_dead(f: PartFacts) -> bool:
    """the ranks that never issued the call are dead: their shards end without a close and their processes are
    gone (a captured job's rank killed or crashed)"""
    dead = _dead(f)
    return bool(f.absent) and all(r in dead for r in f.absent)


def says_rank_dead(f: PartFacts) -> Diagnosis:
    """rank R stopped after point `P` (its shard ends without a close: killed or crashed); each other rank where
    it failed or hung, with its own error"""
    dead = _dead(f)
    parts = [dead[r] for r in sorted(f.absent)]
    for s in f.stuck:
        if s["rank"] not in f.absent:
            error = (s.get("call") or {}).get("error")
            parts.append(f"rank {s['rank']} {s['how']}" + (f": {error}" if isinstance(error, str) and error else ""))
    return Diagnosis("rank-dead", [said("; ".join(parts))], f.div.step, f.absent, None, f.call,
                     ev_frame(f.call_rows()))


def when_rank_missing(f: PartFacts) -> bool:
    """a rank never issued the call the others issued"""
    return bool(f.absent)


def says_rank_missing(f: PartFacts) -> Diagnosis:
    """rank R never issued group G call #N that ranks Q issued in step `S` (the call); who then hung or died"""
    div = f.div
    clauses = [said(f"{ranks_words(f.absent)} never issued group {div.group} call #{div.seq} that "
                    f"{ranks_words(div.ranks)} issued in step `{div.step}` ({collectives.describe(f.call)})"),
               stuck_clause(f.stuck)]
    return Diagnosis("rank-missing", clauses, div.step, f.absent, None, f.call, ev_frame(f.call_rows()))


def when_reinterpreted(f: PartFacts) -> bool:
    """an extra coalesced bucket was received, and a receiving rank's tensor holds the sender's bytes"""
    return f.extra_bucket and bool(f.re_rows)


def says_reinterpreted(f: PartFacts) -> Diagnosis:
    """rank R's `t` is rank S's fp32 bytes read as bf16 (or: slid by K elements): `via` bucketed by dtype after
    `step` split the dtypes, rank S sent an extra … bucket that rank R received into its … bucket; the rest"""
    re_rows, bucket, t, sender, among, call = f.re_rows, f.bucket, f.tensors, f.sender, f.among, f.call
    pick = next((m for m in re_rows if m["name"] == m["source"]), None) or \
        next((m for m in re_rows if m["source"] in bucket), re_rows[0])
    row = t[(t["rank"] == pick["rank"]) & (t["name"] == pick["name"])].iloc[0]
    src = t[(t["rank"] == sender) & (t["name"] == pick["source"])].iloc[0]
    same = pick["source"] == pick["name"]
    shift = f" from byte {pick['offset']}" if pick["offset"] else ""
    read_as = f" read as {dt(row['dtype'])}" if src["dtype"] != row["dtype"] else ""
    of = "" if same else f" of `{short(pick['source'], among)}`"
    alike_on = sorted({int(m["rank"]) for m in re_rows if (m["name"], m["source"], m["offset"])
                       == (pick["name"], pick["source"], pick["offset"])})  # the same mispairing on each
    head = f"{possessive(alike_on)} `{short(pick['name'], among)}` is rank {sender}'s {dt(src['dtype'])} bytes" \
           f"{of}{shift}{read_as}"
    if pick.get("shift"):
        slid = abs(int(pick["shift"]))
        es = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dt(row["dtype"]))
        amount = f"{slid // es} {dt(row['dtype'])} elements ({slid} B)" if es and slid % es == 0 else f"{slid} B"
        why = " (the extra bucket's size)" if is_number(call.get("bytes")) and int(call["bytes"]) == slid else ""
        alike = [m for m in re_rows if m.get("shift") == pick["shift"] and m["rank"] == pick["rank"]]
        more = f" and {len(alike) - 1} more of its tensors" if len(alike) > 1 else ""
        head = (f"rank {pick['rank']}'s `{short(pick['name'], among)}`{more} hold rank {sender}'s bytes slid by "
                f"{amount}{why}")
    clauses = [tensors(head, [pick["name"]]), said(f": {f.bucket_how}, {f.bucket_what}"), *f.tail]
    return Diagnosis("reinterpreted", clauses, f.first_step, alike_on, pick["name"], call, f.evidence())


def when_mispaired(f: PartFacts) -> bool:
    """a rank issued an extra coalesced bucket (FSDP buckets by dtype) that the others received into theirs"""
    return f.extra_bucket


def says_mispaired(f: PartFacts) -> Diagnosis:
    """`via` bucketed by dtype after `step` split the dtypes, rank S sent an extra fp32 bucket (…) that rank R
    received into its bf16 bucket; the rest"""
    clauses = [said(f"{f.bucket_how}, {f.bucket_what}"), *f.tail]
    tensor = f.bucket[0] if f.bucket else None
    return Diagnosis("mispaired", clauses, f.first_step, [f.receiver], tensor, f.call, f.evidence())


def says_collective_mismatch(f: PartFacts) -> Diagnosis:
    """the ranks' collectives part at group G call #N in step `S` (different collectives, dtypes, sizes, roots,
    or an extra call): rank 0: …; ranks 1-7: …; the rest"""
    div = f.div
    words = PART_WORDS.get(div.kind, "an extra call")
    how = f"the ranks' collectives part at group {div.group} call #{div.seq} in step `{div.step}` ({words})"
    clauses = [said(f"{how}: {calls_by_group(f.calls)}"), *f.tail]
    return Diagnosis("collective-mismatch", clauses, div.step, sorted(div.ranks), None, f.call, f.evidence())


def when_independent_groups(f: PartFacts, d: Diagnosis) -> bool:
    """other groups part in the same step, sharing no rank with this one"""
    return bool(f.also)


def says_independent_groups(f: PartFacts, d: Diagnosis) -> Diagnosis:
    """…; independently, on group G (ranks …): that group's parting; then what the ranks were left doing, then the
    outputs"""
    d.insert_before("stuck", *[parting(f.run, o) for o in f.also])
    d.ranks = d.ranks + [r for o in f.also for r in sorted(o.ranks) if r not in d.ranks]
    d.evidence = pd.concat([d.evidence, ev_frame([{"step": o.step, "rank": None, "what": f"group {o.group}",
                                                   "fact": o.message} for o in f.also])], ignore_index=True)
    return d


# -- the order: tried top to bottom (a teller's name is the mechanism it says: exception.PARTED reads them) -------
RULES: tuple[Rule, ...] = (
    Rule("parting", "rank-dead", when_rank_dead, says_rank_dead),
    Rule("parting", "rank-missing", when_rank_missing, says_rank_missing),
    Rule("parting", "reinterpreted", when_reinterpreted, says_reinterpreted),
    Rule("parting", "mispaired", when_mispaired, says_mispaired),
    Rule("parting", "collective-mismatch", always, says_collective_mismatch),
    Rule("parting", "independent-groups", when_independent_groups, says_independent_groups, adds=True),
)


def tell(facts: Any) -> Diagnosis:
    """This stage's story: its rules walked in order."""
    return walk(RULES, facts)
