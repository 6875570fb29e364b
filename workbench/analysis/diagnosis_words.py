"""What the diagnosis says: a ``Diagnosis`` is a list of clauses, each its words and the facts it tells.

A rule builds its story from clauses (``Clause``): the words, and as data what they name: the ranks
that raised what (``raised``), who was left stuck where (``stuck``), the groups that parted on their
own (``groups``), the tensors (``tensors``), the outputs (``outputs``). The sentence is the clauses'
words, rendered in one place (``Diagnosis.sentence``); a rule that asks what the story already says
reads the clauses (``Diagnosis.raisers``, ``Diagnosis.insert_before``), never the sentence, so a
user's exception message that happens to read "rank 1 raised KeyError" changes nothing. The type itself
(``Diagnosis``, ``Clause``) is ``workbench.analysis.diagnosis_type``, which imports no pandas.

The small words the rules share live here too: short tensor names, rank groups, dtypes, a call, a
group's parting, the exception clauses. The run they read is ``workbench.analysis.diagnosis_run``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pandas as pd

from workbench.analysis import cause, collectives, floor
from workbench.analysis.diagnosis_type import EVIDENCE_COLUMNS, Clause, Diagnosis
from workbench.analysis.frames import fmt
from workbench.analysis.rankgroups import ranks_words

if TYPE_CHECKING:
    from workbench.analysis.diagnosis_run import Run

SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
GRID_STATUSES = ["ok", "fault", "failed", "hung", "not run"]
PART_WORDS = {"op": "different collectives", "dtype": "different dtypes", "size": "different sizes",
              "root": "different roots"}  # how two sides of a parted call differ (else: "an extra call")


def said(text: str) -> Clause:
    return Clause(text)


def raised(text: str, pairs: Iterable[tuple[int, str]]) -> Clause:
    """A clause that names ranks raising exceptions: ``pairs`` are (rank, exception type)."""
    return Clause(text, "raised", frozenset((int(r), str(e)) for r, e in pairs))


def ev_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=EVIDENCE_COLUMNS)
    df["rank"] = df["rank"].astype("Int64")
    return df


# -- small words --------------------------------------------------------------------------
def dt(dtype: Any) -> str:
    return SHORT_DTYPES.get(str(dtype), str(dtype))


def short(name: str, among: list[str] | None = None) -> str:
    """The shortest dotted suffix of ``name`` that no other name in ``among`` ends with (never starting at a
    bare index: ``layers.0.mlp``, not ``0.mlp``)."""
    parts = str(name).split(".")
    others = [n for n in (among or []) if n != name]
    for k in range(1, len(parts) + 1):
        if k < len(parts) and parts[-k].isdigit():
            continue
        tail = ".".join(parts[-k:])
        if not any(o == tail or o.endswith("." + tail) for o in others):
            return tail
    return str(name)


def named(names: list[str], among: list[str], n: int = 3) -> str:
    out = ", ".join(f"`{short(x, among)}`" for x in names[:n])
    return out + (f" and {len(names) - n} more" if len(names) > n else "")


def tensors(text: str, names: Iterable[str]) -> Clause:
    """A clause about tensors: its words, and the names it is about."""
    return Clause(text, "tensors", tuple(names))


def possessive(ranks: list[int]) -> str:
    """``rank 1's``, ``ranks 1-7's``: whose tensor a sentence is about, as one group."""
    return ranks_words(ranks) + "'s"


def by_value(pairs: Iterable[tuple[int, Any]]) -> dict[Any, list[int]]:
    """``(rank, value)`` pairs -> ``{value: [ranks]}``, values in the order they first come."""
    out: dict[Any, list[int]] = {}
    for r, v in pairs:
        out.setdefault(v, []).append(int(r))
    return out


def calls_by_group(calls: dict[int, Any]) -> str:
    """Where ranks part, one clause per distinct call: ``rank 0: all_reduce #9 …; ranks 1-7: all_gather …``.

    At 8 or 64 ranks the ranks on one side issue the same call; listing each would bury the two sides."""
    groups = by_value((r, collectives.describe(c)) for r, c in sorted(calls.items()) if c)
    return "; ".join(f"{ranks_words(rs)}: {text}" for text, rs in groups.items())


def size_of(call: dict[str, Any]) -> str:
    return collectives.human_bytes(call.get("bytes"))


def outputs_clause(bad: list[dict[str, Any]]) -> Clause:
    """``; output `logits` on rank 1: 8 of 8 values NaN``: the bad outputs (the first two kinds)."""
    if not bad:
        return Clause("", "outputs", ())
    by: dict[tuple[str, str], list[int]] = {}
    for b in bad:
        by.setdefault((b["name"], b["how"]), []).append(b["rank"])
    parts = [f"`{n}` on {ranks_words(rs)}: {how}" for (n, how), rs in list(by.items())[:2]]
    return Clause("; output " + "; ".join(parts), "outputs", tuple(bad))


def stuck_clause(stuck: list[dict[str, Any]]) -> Clause:
    """``; rank 0 hung in …; ranks 1-7 …``: ranks stuck the same way read as one group."""
    text = "".join(f"; {ranks_words(rs)} {how}" for how, rs in by_value((s["rank"], s["how"]) for s in stuck).items())
    return Clause(text, "stuck", tuple(stuck))


def floor_clause(run: Run) -> Clause:
    """For outputs judged against an engine's own floor: both numbers, so a reader on another CPU sees why
    0.066 reads clean (``; output `logprobs` 0.066 from the reference, the engine's own floor 0.066 ...``)."""
    o = run.outputs
    if o.empty or "ref_floor" not in o:
        return Clause("", "floor")
    o = o[o["ref_floor"].map(floor.floor_of).notna()]
    if "step_index" in o and len(o):
        o = o[o["step_index"] == o["step_index"].max()]
    parts = []
    for name, g in o.groupby("name", sort=False):
        worst = g.loc[g["ref_max_abs_diff"].map(lambda v: floor.number(v) or 0.0).idxmax()]
        parts.append(floor.within_words(name, worst["ref_max_abs_diff"], worst["ref_floor"]))
    return Clause("; output " + "; ".join(parts[:2]) if parts else "", "floor", tuple(parts[:2]))


def parting(run: Run, div: collectives.Divergence) -> Clause:
    """One group's parting, on its own: ``; independently, on group 3 (ranks 0,3): the ranks' collectives part at
    call #1 (different roots): rank 0: …; rank 3: …``."""
    from workbench.analysis.diagnosis_run import members

    head = f"; independently, on group {div.group} ({ranks_words(sorted(members(run, div)))}): "
    absent = [r for r, c in div.calls.items() if c is None]
    if absent:
        present = [r for r, c in div.calls.items() if c is not None]
        text = (head + f"{ranks_words(absent)} never issued call #{div.seq} that {ranks_words(present)} issued "
                f"({collectives.describe(div.calls[present[0]])})")
    else:
        words = PART_WORDS.get(div.kind, "an extra call")
        text = head + f"the ranks' collectives part at call #{div.seq} ({words}): {calls_by_group(div.calls)}"
    return Clause(text, "groups", div)


def real_before(run: Run, step: str, names: list[str], ranks: list[int]) -> str:
    """How the never-written tensors looked one step earlier, when every one of them was already real
    memory (not meta) on every rank: then materialisation replaced a live tensor, not a placeholder.
    Empty when any of them was meta, absent or not probed there."""
    from workbench.analysis.diagnosis_run import _true

    i = run.index(step)
    if i == 0 or i >= len(run.steps):
        return ""
    t = run.at(run.tensors, run.steps[i - 1])
    if t.empty or "is_meta" not in t:
        return ""
    rows = t[t["name"].isin(names) & t["rank"].isin(ranks)]
    if len(rows) != len(names) * len(ranks) or rows["is_meta"].map(_true).any():
        return ""
    first = rows.iloc[0]
    head = first.get("head") if "head" in rows else None
    head = [fmt(float(x)) for x in list(head)[:4]] if head is not None and not isinstance(head, str) else []
    values = f", first values [{', '.join(head)}]" if head else ""
    return f"{dt(first['dtype'])} on {first.get('device', '?')}{values}"


# -- exceptions -------------------------------------------------------------------------------------
def from_error(run: Run, step: str) -> Diagnosis:
    """Ranks that raised in ``step``: one sentence for one error, the others named by rank."""
    ev = run.events
    errors = ev[(ev["kind"] == "error") & (ev["step"] == step)]
    e = errors.iloc[0]
    same = errors[(errors["error"] == e["error"]) & (errors["message"] == e["message"])]
    ranks = sorted(int(r) for r in same["rank"])
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
    clauses = [raised(f"{who} raised {e['error']} in step `{step}`: {str(e['message'])[:200]}",
                      [(r, e["error"]) for r in ranks])]
    others = errors[~errors.index.isin(same.index)]
    clauses += [raised(f"; rank {int(o.rank)} raised {o.error}", [(o.rank, o.error)])
                for o in others.itertuples(index=False)]
    return Diagnosis("error", clauses, step, sorted(int(r) for r in errors["rank"]), None, None,
                     ev_frame([{"step": x.step, "rank": x.rank, "what": x.error, "fact": str(x.message)[:300]}
                               for x in ev[ev["kind"] == "error"].itertuples(index=False)]))


def told(errors: list[dict[str, Any]], step: str, sep: str = "; ") -> list[Clause]:
    """One clause per distinct exception, its ranks together (``cause.told``'s words), each naming its raisers;
    every clause but the first starts with ``sep``."""
    return [raised((sep if i else "") + text, [(r, err) for r in rs])
            for i, (text, err, rs) in enumerate(cause.alike(errors, step))]


def lead(errors: list[dict[str, Any]], step: str, waiting: list[int]) -> list[Clause]:
    """``rank 1 raised AssertionError at f.py:30 check in step `s`: msg; it left rank 0 waiting``."""
    out = told(errors, step)
    if waiting:
        who = "it" if len({int(e["rank"]) for e in errors}) == 1 else "they"
        out.append(said(f"; {who} left {'rank' if len(waiting) == 1 else 'ranks'} {','.join(map(str, waiting))} "
                        "waiting"))
    return out
