"""A directory of per-rank shards (what ``workbench.job.capture`` writes) read as one run.

Layout, one folder per rank, each written by its own rank only::

    <dir>/rank<r>/shard.json      job id, rank, world size, launcher, versions, the points so far
    <dir>/rank<r>/points.jsonl    one line per point (probe rows, outputs, trace, notes) and per
                                  exception, appended and flushed as they happen
    <dir>/rank<r>/rank<r>.jsonl   the collectives ledger (``workbench.rank.ledger``)
    <dir>/rank<r>/stacks.txt      Python stacks, where faulthandler wrote them (SIGUSR1)

The reader builds the same ``RunRecord`` a live session gives (frames built by
``Frame.build``, the ledger by ``collectives.ledger_table``), so the views, the report and
the diagnosis read it unchanged. The ranks' points pair by position, or by name where a rank took points the
others did not (rank 0 alone loading a state dict: ``_by_name``, its calls filed under the steps the others issued
them in). Ranks that disagree on a point's name otherwise, a rank with no shard,
a shard of another job, an unreadable line: one line each in ``problems`` (and the log), the
rest still opens. A call still open in a ledger when the shards are read (a hung or killed
job) becomes the run's hang: who is inside which call, and who waits.

Nothing here imports pandas or the analysis layer at module level: the job's writer imports
the layout from this module inside a training process.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from workbench.rank.shard_format import (  # noqa: F401  (the format, as the reader names it)
    FORMAT,
    MANIFEST,
    POINTS,
    SCHEMA,
    STACKS,
    dead_line,
    gone,
    host,
    ledger_file,
    plain,
    rank_dir,
    write_json_atomic,
)

STILL_INSIDE = "still inside when the shards were read"


def is_shard_dir(path: str | os.PathLike) -> bool:
    """A directory holding at least one rank's shard (and no bundle manifest of its own)."""
    p = Path(path)
    if not p.is_dir() or (p / "manifest.json").exists():
        return False
    return any((d / MANIFEST).is_file() for d in p.glob("rank*"))


# -- reading -----------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a workbench shard (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if not isinstance(doc.get("schema"), int) or doc["schema"] > SCHEMA:
        raise ValueError(f"shard schema {doc.get('schema')!r}; this workbench reads up to {SCHEMA}")
    for key in ("rank", "world_size"):
        if not isinstance(doc.get(key), int) or isinstance(doc.get(key), bool) or doc[key] < 0:
            raise ValueError(f"{key!r} is not a whole number")
    return doc


def _lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON lines of ``path`` and how many could not be read (a line cut by a kill, a flipped byte)."""
    out, bad = [], 0
    try:
        data = path.read_bytes()
    except OSError:
        return [], 0
    end = data.rfind(b"\n") + 1  # a last line still being written (or cut by a kill) is not a record
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad += 1
    return out, bad + (1 if data[end:].strip() else 0)


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ",".join(map(str, rs))


class Shards:
    """What ``read`` found: the chosen job's shards per rank, and a line per problem."""

    def __init__(self, path: Path):
        self.path = path
        self.problems: list[str] = []
        self.shards: dict[int, dict[str, Any]] = {}  # rank -> shard.json
        self.points: dict[int, list[dict[str, Any]]] = {}  # rank -> its points, in order
        self.errors: dict[int, list[dict[str, Any]]] = {}  # rank -> its exceptions
        self.released: dict[int, list[dict[str, Any]]] = {}  # rank -> where the post mortem stopped it
        self.job: str | None = None
        self.world_size = 0

    def problem(self, line: str) -> None:
        self.problems.append(line)
        logging.getLogger("workbench").warning("workbench: %s: %s", self.path, line)


def scan(path: str | os.PathLike) -> Shards:
    """Read every rank folder under ``path``; keep the shards of one job (the one most ranks wrote)."""
    path = Path(path)
    found = Shards(path)
    docs: dict[str, dict[str, Any]] = {}
    for d in sorted(path.glob("rank*"), key=lambda p: (len(p.name), p.name)):
        if not (d / MANIFEST).is_file():
            continue
        try:
            doc = _read_json(d / MANIFEST)
        except (OSError, ValueError) as exc:
            found.problem(f"{d.name}/{MANIFEST} is unreadable ({' '.join(str(exc).split())[:160]}): left out")
            continue
        if d.name != f"rank{doc['rank']}":
            found.problem(f"{d.name}/{MANIFEST} says it is rank {doc['rank']}: left out")
            continue
        docs[d.name] = doc
    if not docs:
        from workbench.errors import BundleError

        raise BundleError(f"{path}: no readable shard (rank<r>/{MANIFEST}) in this directory")
    jobs = Counter(str(doc.get("job")) for doc in docs.values())
    latest = {j: max(float(doc.get("started_at") or 0) for doc in docs.values() if str(doc.get("job")) == j)
              for j in jobs}
    found.job = max(jobs, key=lambda j: (jobs[j], latest[j]))
    for name, doc in docs.items():
        if str(doc.get("job")) != found.job:
            found.problem(f"{name} is a shard of another job ({doc.get('job')}; the others are job {found.job}): "
                          "left out")
            continue
        found.shards[doc["rank"]] = doc
    sizes = Counter(doc["world_size"] for doc in found.shards.values())
    found.world_size = max(max(sizes), max(found.shards) + 1)
    if len(sizes) > 1:
        found.problem("the shards disagree on the world size (" + ", ".join(
            f"{_ranks([r for r, d in found.shards.items() if d['world_size'] == n])}: {n}" for n in sorted(sizes))
            + f"); read as {found.world_size}")
    missing = [r for r in range(found.world_size) if r not in found.shards]
    if missing:
        found.problem(f"{_ranks(missing)} of {found.world_size} left no shard of job {found.job}: "
                      "no rows for them (the rank never reached capture, or wrote elsewhere)")
    for r in sorted(found.shards):
        lines, bad = _lines(rank_dir(path, r) / POINTS)
        if bad:
            found.problem(f"rank{r}/{POINTS}: {bad} line(s) unreadable (cut by a kill?): skipped")
        found.points[r] = [x for x in lines if x.get("kind") == "point"]
        # a waiting rank the post mortem stopped (``postmortem.Released``) did not raise: a note, not an error
        found.errors[r] = [x for x in lines if x.get("kind") == "error" and not x.get("released")]
        found.released[r] = [x for x in lines if x.get("kind") == "error" and x.get("released")]
    return found


def _step_names(found: Shards) -> tuple[list[str], dict[int, list[int]]]:
    """One name per step, and where each rank's points fall among them (rank -> each of its point's step index).
    Ranks whose names agree at each position pair by position; where a rank took points the others did not (rank 0
    alone loading a state dict), by name (``_by_name``); where names differ otherwise, by position again, said."""
    by_name = _by_name(found)
    if by_name is not None:
        order, where = by_name
        return _unique(order), where
    names: list[str] = []
    depth = max((len(p) for p in found.points.values()), default=0)
    for k in range(depth):
        said = {r: str(p[k].get("point")) for r, p in found.points.items() if len(p) > k}
        count = Counter(said.values())
        name = max(count, key=lambda n: (count[n], -min(r for r, x in said.items() if x == n)))
        if len(count) > 1:
            found.problem(f"the ranks disagree on point {k}'s name: " + "; ".join(
                f"{_ranks([r for r, x in said.items() if x == n])} {n!r}" for n in count)
                + f" (read as {name!r}; the rows are kept by position)")
        names.append(name)
    return _unique(names), {r: list(range(len(p))) for r, p in found.points.items()}


def _unique(names: list[str]) -> list[str]:
    """A name reused (a point per iteration) gets its count: the views key steps by name."""
    out: list[str] = []
    for name in names:
        if name in out:
            n = 2
            while f"{name} ({n})" in out:
                n += 1
            name = f"{name} ({n})"
        out.append(name)
    return out


def _by_name(found: Shards) -> tuple[list[str], dict[int, list[int]]] | None:
    """The steps and each rank's place in them where the ranks' names line up once the points some ranks alone took
    are set among the others' (each said); None where position pairs them, or where no such insertion explains the
    names (a point named otherwise on one rank)."""
    seqs = {r: [str(p.get("point")) for p in pts] for r, pts in sorted(found.points.items())}
    depth = max(map(len, seqs.values()), default=0)
    if all(len({s[k] for s in seqs.values() if len(s) > k}) <= 1 for k in range(depth)):
        return None
    order: list[str] = []
    for seq in seqs.values():
        merged: list[str] = []
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, order, seq, autojunk=False).get_opcodes():
            if op == "replace":
                return None
            merged += seq[j1:j2] if op == "insert" else order[i1:i2]
        order = merged
    where: dict[int, list[int]] = {}
    for r, seq in seqs.items():
        at = [-1] * len(seq)
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, order, seq, autojunk=False).get_opcodes():
            if op == "equal":
                at[j1:j2] = range(i1, i2)
            elif op != "delete":
                return None
        where[r] = at
    own = _inverse(where)
    for i, name in enumerate(order):
        takers = [r for r in where if i in own[r]]
        skipped = [r for r, at in where.items() if at and i < at[-1] and i not in own[r]]  # not those that stopped
        if skipped:
            others = "the others" if len(takers) + len(skipped) == len(where) else _ranks(skipped)
            found.problem(f"{_ranks(takers)} took a point {others} did not: {name!r} (point "
                          f"{own[takers[0]][i]} of rank {takers[0]}); the points are paired by name")
    return order, where


def _inverse(where: dict[int, list[int]]) -> dict[int, dict[int, int]]:
    """Per rank, step index -> the rank's own point index there (the steps it took)."""
    return {r: {i: j for j, i in enumerate(at)} for r, at in where.items()}


def _step_index(where: list[int], token: Any) -> Any:
    """A rank's own point index (a ledger row's ``step``, an error's ``index``) as the run's step index; a token
    past its last point counts on from there."""
    try:
        k = int(token)
    except (TypeError, ValueError):
        return token
    if k < len(where):
        return where[k]
    return (where[-1] if where else -1) + 1 + k - len(where)


def _windows(calls: list[dict[str, Any]], where: dict[int, list[int]], names: list[str]) -> None:
    """A call a rank issued between two of its points that stand more than one step apart (it did not take the
    points between: ``_by_name``) gets the step in which the ranks that took them issued the same call (its group
    and number), where that step lies between: every rank issues a collective at once, so that is where it was."""
    def span(c: dict[str, Any]) -> list[str]:
        at = where.get(int(c.get("rank", -1)), [])
        try:
            k = int(c["own"])
        except (KeyError, TypeError, ValueError):
            return []
        if k >= len(at):
            return []
        return names[(at[k - 1] if k else -1) + 1: at[k] + 1]

    key = ("session", "attempt", "group", "seq")
    spans = [(c, span(c)) for c in calls]
    single = {tuple(c.get(x) for x in key): c["step"] for c, sp in spans if len(sp) == 1}
    for c, sp in spans:
        if len(sp) > 1 and single.get(tuple(c.get(x) for x in key)) in sp:
            c["step"] = single[tuple(c.get(x) for x in key)]


def _step_of(token: Any, names: list[str], planned: list[str] | None = None) -> str:
    """A ledger row's or error's point index (what the capture writes while on the way to point k): its
    name, the job's declared name for it where no rank reached it, else ``after <the last point>``."""
    try:
        k = int(token)
    except (TypeError, ValueError):
        return str(token)
    if k < len(names):
        return names[k]
    if planned and k < len(planned) and planned[k] not in names:
        return planned[k]
    return f"after {names[-1]}" if names else "before the first point"


def read(path: str | os.PathLike) -> tuple[Any, list[str]]:
    """The run the shards hold as a ``RunRecord``, and the problems found on the way."""

    from workbench.analysis import collectives
    from workbench.analysis.frames import Frame
    from workbench.analysis.frames import stack as frame_stack
    from workbench.errors import RankFailure
    from workbench.postmortem.record import SCHEMA_VERSION, RunRecord

    found = scan(path)
    path = Path(path)
    names, where = _step_names(found)
    ranks = list(range(found.world_size))
    first = found.shards[min(found.shards)]
    scenario = str(first.get("name") or path.name)
    reader = collectives.LedgerReader([str(ledger_file(path, r)) for r in sorted(found.shards)])
    reader.poll()
    calls = [dict(c) for c in reader.calls()]  # each rank's ledger starts empty at its capture: this job's
    planned = [str(p) for p in first.get("planned") or []]
    def step_of(rank: int, token: Any) -> str:  # a rank's own point index as the run's step
        return _step_of(_step_index(where.get(rank, []), token), names, planned)

    for c in calls:
        c["own"] = c.get("step")
        c["step"] = step_of(int(c.get("rank", -1)), c.get("step"))
    _windows(calls, where, names)
    ledger = collectives.ledger_table(calls)
    errors = {r: [{**e, "step": step_of(r, e.get("index"))} for e in es] for r, es in found.errors.items()}
    steps = list(names)
    extra = {c["step"] for c in calls} | {e["step"] for es in errors.values() for e in es}
    for s in sorted(extra - set(steps)):
        steps.append(s)  # calls or an exception past the last point some rank reached
    declared = steps + [p for p in planned[len(steps):] if p not in steps]  # what the job meant to reach
    frames = []
    inverse = _inverse(where)
    for i, step in enumerate(steps):
        values: dict[int, dict[str, Any]] = {}
        for r in sorted(found.shards):
            pts = found.points[r]
            j = inverse.get(r, {}).get(i)
            p = pts[j] if i < len(names) and j is not None else None
            err = next((e for e in errors[r] if e["step"] == step), None)
            if p is None and err is None:
                continue
            p = p or {}
            values[r] = {"tensors": p.get("tensors", []), "outputs": p.get("outputs", []),
                         "trace": p.get("trace", []), "elapsed": float(p.get("elapsed") or 0.0),
                         "notes": list(p.get("notes", [])),
                         "error": None if err is None else {k: err.get(k) for k in ("error", "message", "traceback")}}
        frames.append(Frame.build(step, i, scenario, None, values, {}))
    hangs = []
    open_calls = ledger[ledger["state"] == collectives.OPEN] if len(ledger) else ledger
    finished = {r for r, d in found.shards.items() if d.get("status") == "finished"}
    if len(open_calls):
        # a rank that closed its capture went past every call it issued: an end it never wrote (a shard of an
        # older writer, an NCCL call still queued when the process ended) is no hang
        done = open_calls[open_calls["rank"].astype(int).isin(finished)]
        for row in done.itertuples():
            found.problem(f"rank {row.rank}'s {row.op} #{row.seq} on group {row.group} has no end in its ledger, "
                          "but the rank closed its capture after it: read as issued, not as a hang")
        ledger.loc[done.index, "state"] = "issued"
        open_calls = open_calls[~open_calls["rank"].astype(int).isin(finished)]
    if len(open_calls):
        step = min(open_calls["step"], key=steps.index)
        failures = {int(r): RankFailure(int(r), "timeout", "Hung", STILL_INSIDE)
                    for r in open_calls["rank"] if int(r) not in finished}
        hang = collectives.diagnose(step, ledger[ledger["step"] == step], failures, ranks)
        hang.caught_by = STILL_INSIDE
        hang.stacks = {r: text for r in sorted(found.shards) if (text := _stacks(path, r))}
        entry = hang.to_dict()
        lines = entry["message"].splitlines()  # its headline names the live ways a hang is caught; not this one
        lines[0] = f"step {step!r}: did not finish on every rank: a call was {STILL_INSIDE} (the job hung there, " \
                   "or was killed)"
        entry["message"] = "\n".join(lines)
        hangs.append(entry)
    dead = {str(r): {"after": (found.points[r][-1].get("point") if found.points.get(r) else None),
                     "line": dead_line(r, found.points[r][-1].get("point") if found.points.get(r) else None)}
            for r, d in sorted(found.shards.items()) if gone(d)}
    notes = [{"step": f.step, "rank": r, "note": n} for f in frames for r, ns in f.notes.items() for n in ns]
    notes += [{"step": step_of(r, e.get("index")), "rank": r,
               "note": "released by the workbench's post mortem (its communicators aborted); it ended there"}
              for r, es in sorted(found.released.items()) for e in es[:1]]
    notes += [{"step": None, "rank": None, "note": f"shards: {p}"} for p in found.problems]
    t0 = min(float(d.get("started_at") or 0) for d in found.shards.values())
    t1 = max(float(d.get("updated_at") or 0) for d in found.shards.values())
    manifest = {
        "schema": SCHEMA_VERSION,
        "scenario": scenario,
        "title": f"{scenario}: the job's own capture ({first.get('launcher') or 'no launcher'}, "
                 f"{found.world_size} rank(s))",
        "incident": None,
        "fix": None,
        "fixes": {},
        "poison": bool(first.get("poison")),
        "params": {},
        "steps": declared,
        "steps_run": steps,
        "hangs": hangs,
        "elapsed": [{str(r): t for r, t in f.elapsed.items()} for f in frames],
        "ranks": found.world_size,
        "backend": str(first.get("backend") or "unknown"),
        "devices": {str(r): str(found.shards[r].get("device")) if r in found.shards else "no shard" for r in ranks},
        "timeout_s": None,
        "seed": None,
        "started_at": t0,
        "saved_at": t1,
        "versions": dict(first.get("versions") or {}),
        "job": {"id": found.job, "launcher": first.get("launcher"), "argv": first.get("argv"),
                "hosts": sorted({str(d.get("host")) for d in found.shards.values()}),
                "status": {str(r): d.get("status") for r, d in sorted(found.shards.items())}, "dead": dead,
                "followed": _followed(found.shards),
                "group_outlived": {str(r): d["group_outlived"] for r, d in sorted(found.shards.items())
                                   if isinstance(d.get("group_outlived"), dict)}},
        "problems": list(found.problems),
    }

    rec = RunRecord(manifest, *(frame_stack(frames, t) for t in ("tensors", "outputs", "events")), notes,
                    trace=frame_stack(frames, "trace"), ledger=ledger)
    return rec, list(found.problems)


def _followed(docs: dict[int, dict[str, Any]]) -> dict[str, int] | None:
    """How far the automatic step points followed the job (``job/hooks.py``), over the ranks that closed: the most
    optimizer steps any ran and the earliest last point (None: no automatic step points, or no rank closed)."""
    got = [d["followed"] for d in docs.values() if isinstance(d.get("followed"), dict)]
    if not got:
        return None
    return {"optimizer_steps": max(int(g.get("optimizer_steps") or 0) for g in got),
            "last_step_point": min(int(g.get("last_step_point") or 0) for g in got),
            "every": max(int(g.get("every") or 0) for g in got)}


def _stacks(path: Path, rank: int) -> str:
    try:
        text = (rank_dir(path, rank) / STACKS).read_text(errors="replace")
    except OSError:
        return ""
    return text[-20000:]


def read_checked(path: str | os.PathLike) -> tuple[Any, list[str]]:
    """``read``, where anything damaged shards provoke is one ``BundleError`` line, as for a bundle."""
    from workbench.errors import BundleError
    from workbench.postmortem.record import damage_faults

    try:
        return read(path)
    except BundleError:
        raise
    except damage_faults() as exc:
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise BundleError(f"{path}: unreadable shards ({msg})") from None
