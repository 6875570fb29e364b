"""Rerun a postmortem: the recorded scenario, fix, parameters, seed, poison setting and world
size on live ranks, then the new record compared with the old one.

Three verdicts, because a colleague's machine is not the recorder's:

- "reproduced exactly": every rank held the same bytes (fingerprints and dtypes) for every
  tensor, output and traced activation at every step, and the same ranks failed the same way;
- "reproduced: same story": the bytes differ but the run tells the same story: the same steps
  ran, the same steps failed on the same ranks with the same kind of failure (raised or timed
  out, which is a race for a survivor of a dead peer, against died), the same findings, the
  same diagnosis mechanism, and every tensor, output and activation within rounding (the
  tolerance ``workbench.postmortem.closeness`` states: NaN and poison patterns exactly);
- "differs": another story, named at its first step, rank and tensor.

Either way the versions that changed in between (CPU, torch, transformers, ...) are named.
``strict=True`` (``workbench rerun --strict``) asks for bit-exact: bytes that differ read "differs".

The cluster is duck-typed (anything with ``world_size`` and ``session(scenario, fix=,
poison=, **params)``), so the postmortem layer never imports the live one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from workbench.analysis.diagnosis import parted, short
from workbench.errors import LOST, BundleError
from workbench.postmortem import closeness
from workbench.postmortem.record import FINDINGS_FAULTS, RunRecord, versions

EXACT, SAME_STORY, DIFFERS = "reproduced exactly", "reproduced: same story", "differs"


@dataclass
class Rerun:
    """One recorded run against its rerun: the verdict, where they first part, what changed."""

    old: RunRecord
    new: RunRecord
    first_difference: dict[str, Any] | None  # step, rank, name, what: set when the verdict is "differs"
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # setting -> (recorded, now)
    verdict: str = EXACT
    worst: dict[str, Any] | None = None  # the gap nearest its tolerance: step, rank, name, delta, tol, ratio
    bytes_differ: int = 0  # rows (tensors, outputs, activations) whose bytes differ
    rows: int = 0  # rows compared
    garbage: int = 0  # never-written rows without poison: values not compared
    strict: bool = False

    @property
    def exact(self) -> bool:
        return self.verdict == EXACT

    @property
    def reproduced(self) -> bool:
        """Exactly, or (unless strict) the same story within rounding."""
        return self.verdict != DIFFERS

    @property
    def message(self) -> str:
        label, changed = self.old.label, self._changed_words()
        if self.exact:
            return f"{label}: {EXACT}" + (f" (changed since the recording: {changed})" if changed else "")
        if self.verdict == SAME_STORY:
            return (f"{label}: {SAME_STORY}, values within rounding ({self._worst_words()}); "
                    + (f"changed: {changed}" if changed else "no recorded version changed"))
        d = self.first_difference or {}
        where = f"step `{d.get('step')}`" + (f", rank {d['rank']}" if d.get("rank") is not None else "") + \
            (f", `{short(d['name'], self._names())}`" if d.get("name") else "") + _call_words(d)
        return (f"{label}: differs from the recording from {where}: {d.get('what')}"
                + (f"; changed since the recording: {changed}" if changed else "; no recorded version changed"))

    def _names(self) -> list[str]:
        return list(dict.fromkeys(self.old.tensors["name"])) if "name" in self.old.tensors else []

    def _changed_words(self) -> str:
        return "; ".join(f"{k} {_word(a)} -> {_word(b)}" for k, (a, b) in self.changed.items())

    def _worst_words(self) -> str:
        w = self.worst
        at = ""
        if w:
            at = f" at step `{w['step']}`, rank {w['rank']}, `{short(str(w['name']), self._names())}`{_call_words(w)}"
        out = f"max |Δ| {w['delta']:.3g} ({100 * w['ratio']:.2g}% of its tolerance){at}" if w else "max |Δ| 0"
        if w and w["delta"] == 0:
            out += " (the bytes that differ are not among the kept values)"
        out += f"; bytes differ in {self.bytes_differ} of {self.rows} rows"
        if self.garbage:
            out += f"; {self.garbage} never-written without poison, not compared"
        return out

    def __str__(self) -> str:
        return self.message


def _call_words(d: dict[str, Any]) -> str:
    return f" (traced call {d['call']})" if d.get("call") is not None else ""


def _word(v: Any) -> str:
    return "unset" if v is None else str(v)


def settings(rec: RunRecord) -> dict[str, Any]:
    """What a rerun must match: scenario, fix, params (seed included), poison, world size, collective timeout."""
    m = rec.manifest
    return {"scenario": m.get("scenario"), "fix": m.get("fix"), "params": _params(rec),
            "poison": bool(m.get("poison", True)), "ranks": int(m.get("ranks") or 0), "timeout_s": m.get("timeout_s"),
            "backend": m.get("backend")}


def _params(rec: RunRecord) -> dict[str, Any]:
    """The recorded parameters, with the receiver the recording actually used: a bundle from before the
    ``receiver`` parameter ran the stand-in, and ``auto`` means whatever the recorder's ranks had (its
    outputs say which), not whatever this machine has."""
    from workbench import scenarios

    params = dict(rec.manifest.get("params") or {})
    name = rec.manifest.get("scenario")
    if name not in scenarios.names() or "receiver" not in scenarios.get(name).params:
        return params
    if params.get("receiver", "auto") == "auto":
        used = rec.outputs["receiver"].dropna() if "receiver" in rec.outputs.columns else []
        params["receiver"] = str(used.iloc[0]) if len(used) else "workbench"
    return params


def check(rec: RunRecord, world_size: int | None = None) -> None:
    """One clear error before any rank starts: a scenario this workbench lacks, a fix it lacks, too many ranks."""
    from workbench import scenarios

    s = settings(rec)
    if s["scenario"] not in scenarios.names():
        raise BundleError(f"the bundle's scenario {s['scenario']!r} is not in this workbench "
                          f"(it has: {', '.join(scenarios.names())}); a user scenario must be rerun from its file")
    scenarios.get(s["scenario"]).check_fix(s["fix"])
    if world_size is not None and s["ranks"] > world_size:
        raise BundleError(f"the bundle was recorded on {s['ranks']} ranks; only {world_size} can run here")


def rerun_record(rec: RunRecord, cluster: Any, strict: bool = False) -> Rerun:
    """Run ``rec``'s scenario again on ``cluster`` exactly as recorded and compare the two records."""
    s = settings(rec)
    check(rec, getattr(cluster, "world_size", None))
    if s["ranks"] and getattr(cluster, "world_size", s["ranks"]) != s["ranks"]:
        raise BundleError(f"the bundle was recorded on {s['ranks']} ranks; this cluster has {cluster.world_size}")
    session = cluster.session(s["scenario"], fix=s["fix"], poison=s["poison"], **s["params"])
    try:
        session.run()
        new = session.record()
    finally:
        session.close()
    return diff(rec, new, strict=strict)


def diff(old: RunRecord, new: RunRecord, strict: bool = False) -> Rerun:
    """Compare two records of the same scenario: the story first (steps, failures, values beyond rounding,
    findings, diagnosis), then the bytes (exact, or with ``strict`` the first byte that differs)."""
    walk = _Walk(old, new)
    story = walk.story()
    r = Rerun(old, new, story, changed(old, new), strict=strict, worst=walk.worst, bytes_differ=walk.bytes_differ,
              rows=walk.rows, garbage=walk.garbage)
    if story is not None:
        r.verdict = DIFFERS
        return r
    first_bytes = _first_byte_difference(old, new)
    if first_bytes is None and not walk.bytes_differ:
        r.verdict = EXACT
    elif strict:
        r.verdict, r.first_difference = DIFFERS, first_bytes or walk.first_bytes
    else:
        r.verdict = SAME_STORY
    return r


def failure_keys(rec: RunRecord, exact: bool = False) -> set[tuple[str, int, str]]:
    """Where ranks failed: (step, rank, kind). How a survivor of a dead peer fails (a reset connection or its
    own timeout) is a race, so unless ``exact``, 'error' and 'timeout' count as one kind, 'failed'."""
    e = rec.events
    if e is None or e.empty:
        return set()
    return {(str(r.step), int(r.rank), str(r.kind) if exact or r.kind in LOST else "failed")
            for r in e.itertuples(index=False)}


def finding_keys(found: pd.DataFrame) -> set[tuple]:
    """What a run found, without wording or numbers: (step, severity, rank, tensor, detector)."""
    out = set()
    for row in found.to_dict(orient="records"):
        rank = row.get("rank")
        rank = None if rank is None or rank is pd.NA or rank != rank else int(rank)
        out.add((row["step"], row["severity"], rank, row.get("name") or "", row["detector"]))
    return out


def _first_byte_difference(old: RunRecord, new: RunRecord) -> dict[str, Any] | None:
    first = parted(old, new, ("the recording", "the rerun"))
    if first is None:
        fa, fb = failure_keys(old, exact=True), failure_keys(new, exact=True)
        if fa != fb:
            (step, rank, kind) = sorted(fa ^ fb)[0]
            first = {"step": step, "rank": rank, "name": None,
                     "what": f"{kind} {'in the recording only' if (step, rank, kind) in fa else 'in the rerun only'}"}
    return first


class _Walk:
    """The two runs side by side, step by step, in the order the story happened."""

    def __init__(self, old: RunRecord, new: RunRecord):
        self.old, self.new = old, new
        self.poison = bool(old.manifest.get("poison", True))
        self.floor = closeness.floor_dtype(old.tensors, old.outputs, old.trace)
        self.worst: dict[str, Any] | None = None
        self.first_bytes: dict[str, Any] | None = None
        self.bytes_differ = self.rows = self.garbage = 0
        self.garbage_since: dict[int, str] = {}  # rank -> first step holding never-written memory (poison off)

    def story(self) -> dict[str, Any] | None:
        a, b = self.old.steps, self.new.steps
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"step": (a + b)[at] if at < len(a) else b[at], "rank": None, "name": None,
                    "what": f"steps run {' -> '.join(a) or '(none)'} then, {' -> '.join(b) or '(none)'} now"}
        fa, fb = failure_keys(self.old), failure_keys(self.new)
        first = None
        for step in a:
            first = (self._failures(step, fa, fb) or self._rows(step, "tensors", ["rank", "name"])
                     or self._rows(step, "outputs", ["rank", "name"])
                     or self._rows(step, "trace", ["rank", "run", "call", "module"]))
            if first is not None:
                break
        if first is None and not self.bytes_differ and failure_keys(self.old, True) == failure_keys(self.new, True):
            return None  # the same bytes and failures: the same findings and diagnosis (they read only those)
        before = a[: a.index(first["step"])] if first is not None else a
        found = self._first_finding(before)
        if found is not None:
            return found
        return self._tainted(first) if first is not None else self._diagnosis()

    def _first_finding(self, steps: list[str]) -> dict[str, Any] | None:
        """The first step (of ``steps``) whose findings differ; never-written memory without poison holds
        whatever the allocator left (NaN or not), so what is found in it is not the story."""
        found_a, found_b = _findings(self.old), _findings(self.new)
        if found_a is None or found_b is None:
            return None
        if not self.poison:
            junk = _garbage(self.old) | _garbage(self.new)
            found_a, found_b = ({k for k in f if (k[0], k[2], k[3]) not in junk} for f in (found_a, found_b))
        for step in steps:
            d = self._findings(step, found_a, found_b)
            if d is not None:
                return d
        return None

    def _failures(self, step: str, fa: set, fb: set) -> dict[str, Any] | None:
        odd = sorted(k for k in fa ^ fb if k[0] == step)
        if not odd:
            return None
        _, rank, kind = odd[0]
        return {"step": step, "rank": rank, "name": None,
                "what": f"rank {rank} {kind} {'in the recording only' if odd[0] in fa else 'in the rerun only'}"}

    def _rows(self, step: str, table: str, key: list[str]) -> dict[str, Any] | None:
        ta, tb = _at(getattr(self.old, table), step), _at(getattr(self.new, table), step)
        if not len(ta) and not len(tb):
            return None
        if any(k not in df.columns for df in (ta, tb) if len(df) for k in key):
            return None
        m = ta.merge(tb, on=key, how="outer", suffixes=("_a", "_b"), indicator="side", sort=False)
        m = m.sort_values(["rank"], kind="stable")
        cols = [c[:-2] for c in m.columns if c.endswith("_a")]
        for r in m.to_dict(orient="records"):
            where = {"step": step, "rank": int(r["rank"]), "name": r["name"] if "name" in key else r["module"]}
            if table == "trace":
                where["call"] = _call(r["call"])
            if r["side"] != "both":
                return {**where, "what": f"only {'the recording' if r['side'] == 'left_only' else 'the rerun'} "
                                         f"has it" + (" (a traced call)" if table == "trace" else "")}
            ra = {c: r[c + "_a"] for c in cols}
            rb = {c: r[c + "_b"] for c in cols}
            gap = (closeness.compare_trace(ra, rb, self.floor) if table == "trace"
                   else closeness.compare(ra, rb, self.floor, self.poison))
            self._count(where, gap, table)
            if gap.story is not None:
                return {**where, "what": ("output " if table == "outputs" else "") + gap.story}
        return None

    def _count(self, where: dict[str, Any], gap: closeness.Gap, table: str) -> None:
        self.rows += 1
        if gap.garbage:
            self.garbage += 1
            self.garbage_since.setdefault(where["rank"], where["step"])
        if gap.same_bytes:
            return
        self.bytes_differ += 1
        if self.first_bytes is None:
            self.first_bytes = {**where, "what": "different bytes" if table != "outputs" else "different outputs"}
        if gap.story is not None or gap.garbage:
            return
        ratio = gap.delta / gap.tol if gap.tol else 0.0
        if self.worst is None or (ratio, gap.delta) > (self.worst["ratio"], self.worst["delta"]):
            self.worst = {**where, "delta": gap.delta, "tol": gap.tol, "ratio": ratio}

    def _findings(self, step: str, a: set | None, b: set | None) -> dict[str, Any] | None:
        if a is None or b is None:
            return None
        odd = sorted((k for k in a ^ b if k[0] == step), key=str)
        if not odd:
            return None
        k = odd[0]
        side = "the recording" if k in a else "the rerun"
        return {"step": step, "rank": k[2], "name": k[3] or None,
                "what": f"a `{k[4]}` finding ({k[1]}) in {side} only"}

    def _diagnosis(self) -> dict[str, Any] | None:
        try:
            da, db = self.old.diagnose(), self.new.diagnose()
        except FINDINGS_FAULTS:  # a record without the tables the diagnosis reads: nothing to compare
            return None
        if (da.mechanism, da.step) == (db.mechanism, db.step):
            return None
        return {"step": da.step or db.step, "rank": None, "name": None,
                "what": f"diagnosis {da.mechanism} at `{da.step}` then, {db.mechanism} at `{db.step}` now"}

    def _tainted(self, d: dict[str, Any]) -> dict[str, Any]:
        since = self.garbage_since.get(d.get("rank"))
        if since is not None and self.old.steps.index(since) <= self.old.steps.index(d["step"]):
            d = {**d, "what": d["what"] + f" (rank {d['rank']} held never-written memory without poison from "
                                          f"`{since}`: its values are whatever the allocator left; rerun with poison)"}
        return d


def _call(v: Any) -> Any:
    try:
        return int(v)
    except (TypeError, ValueError):
        return v


def _at(df: pd.DataFrame | None, step: str) -> pd.DataFrame:
    if df is None or not len(df) or "step" not in df:
        return pd.DataFrame()
    return df[df["step"] == step].drop(columns=[c for c in ("step", "step_index") if c in df])


def _garbage(rec: RunRecord) -> set[tuple[str, int, str]]:
    """(step, rank, name) of tensors holding never-written memory."""
    t = rec.tensors
    if t is None or not len(t) or "written" not in t:
        return set()
    g = t[t["written"].isin(closeness.GARBAGE)]
    return {(str(s), int(r), str(n)) for s, r, n in zip(g["step"], g["rank"], g["name"])}


def _findings(rec: RunRecord) -> set | None:
    try:
        return finding_keys(rec.findings())
    except FINDINGS_FAULTS:  # a record without the columns the detectors need
        return None


def changed(old: RunRecord, new: RunRecord) -> dict[str, tuple[Any, Any]]:
    """Versions and run settings that differ between two records (recorded value, new value)."""
    out: dict[str, tuple[Any, Any]] = {}
    va, vb = old.manifest.get("versions") or {}, new.manifest.get("versions") or versions()
    for k in sorted(set(va) | set(vb)):
        if va.get(k) != vb.get(k):
            out[k] = (va.get(k), vb.get(k))
    for k in ("backend", "ranks", "devices"):
        if old.manifest.get(k) != new.manifest.get(k):
            out[k] = (old.manifest.get(k), new.manifest.get(k))
    return out
