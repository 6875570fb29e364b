"""Rerun a postmortem: the recorded scenario, fix, parameters, seed, poison setting and world
size on live ranks, then the new record diffed against the old one.

What makes a postmortem reproducible: "reproduced exactly" means every rank held the same
bytes (fingerprints and dtypes) for every tensor and output at every step, and the same
ranks failed the same way; otherwise the first step, rank and tensor where the two part is
named, with the versions (torch, transformers, backend, ...) that changed in between.

The cluster is duck-typed (anything with ``world_size`` and ``session(scenario, fix=,
poison=, **params)``), so the postmortem layer never imports the live one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.analysis.diagnosis import parted, short
from workbench.errors import BundleError
from workbench.postmortem.record import RunRecord, versions


@dataclass
class Rerun:
    """One recorded run against its rerun: equal, or where they first part and what changed."""

    old: RunRecord
    new: RunRecord
    first_difference: dict[str, Any] | None
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # setting -> (recorded, now)

    @property
    def exact(self) -> bool:
        return self.first_difference is None

    @property
    def message(self) -> str:
        label = self.old.label
        changed = "; ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *v) for k, v in self.changed.items()))
        if self.exact:
            return f"{label}: reproduced exactly" + (f" (changed since the recording: {changed})" if changed else "")
        d = self.first_difference
        names = list(dict.fromkeys(self.old.tensors["name"])) if "name" in self.old.tensors else []
        where = f"step `{d['step']}`" + (f", rank {d['rank']}" if d.get("rank") is not None else "") + \
            (f", `{short(d['name'], names)}`" if d.get("name") else "")
        return (f"{label}: differs from the recording from {where}: {d['what']}"
                + (f"; changed since the recording: {changed}" if changed else "; no recorded version changed"))

    def __str__(self) -> str:
        return self.message


def settings(rec: RunRecord) -> dict[str, Any]:
    """What a rerun must match: scenario, fix, params (seed included), poison, world size, collective timeout."""
    m = rec.manifest
    return {"scenario": m.get("scenario"), "fix": m.get("fix"), "params": dict(m.get("params") or {}),
            "poison": bool(m.get("poison", True)), "ranks": int(m.get("ranks") or 0), "timeout_s": m.get("timeout_s"),
            "backend": m.get("backend")}


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


def rerun_record(rec: RunRecord, cluster: Any) -> Rerun:
    """Run ``rec``'s scenario again on ``cluster`` exactly as recorded and diff the two records."""
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
    return diff(rec, new)


def diff(old: RunRecord, new: RunRecord) -> Rerun:
    """Compare two records of the same scenario: steps run, failures, then bytes step by step."""
    first = None
    a, b = old.manifest.get("steps_run") or [], new.manifest.get("steps_run") or []
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        step = (a + b)[at] if at < len(a) else b[at]
        first = {"step": step, "rank": None, "name": None,
                 "what": f"steps run {' -> '.join(a) or '(none)'} then, {' -> '.join(b) or '(none)'} now"}
    if first is None:
        first = parted(old, new, ("the recording", "the rerun"))
    if first is None:
        fa, fb = _failures(old), _failures(new)
        if fa != fb:
            (step, rank, kind) = sorted(fa ^ fb)[0]
            first = {"step": step, "rank": rank, "name": None,
                     "what": f"{kind} {'in the recording only' if (step, rank, kind) in fa else 'in the rerun only'}"}
    return Rerun(old, new, first, changed(old, new))


def _failures(rec: RunRecord) -> set[tuple[str, int, str]]:
    e = rec.events
    if e.empty:
        return set()
    return {(str(r.step), int(r.rank), str(r.kind)) for r in e.itertuples(index=False)}


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
