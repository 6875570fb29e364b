"""Ranks that hold the same thing, folded into one row: views that stay legible at 8-64 ranks.

Pure functions of a probe table (one step: columns ``rank, name, dtype, fingerprint, ...``).
Two ranks are *identical* when every tensor has the same status (against the reference
rank), dtype and content fingerprint on both. The incident reports showed ranks 1-15 all
holding the same garbage: that is one row, "ranks 1-15 (15 identical)", not fifteen.

Past ``max_rows`` groups the summary degrades in two stages: ranks with the same status
per tensor (contents may differ, e.g. shards) are folded next, then whatever is left
beyond the row budget goes into one "mixed" row that shows the worst status per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from workbench.analysis.findings import STATUSES, status

GROUP_COLUMNS = ["group", "label", "ranks", "first", "size", "how"]
CELL_COLUMNS = ["group", "name", "status", "detail", "dtype", "shape", "kind", "head", "contents", "present"]
_SEVERITY = {s: i for i, s in enumerate(STATUSES)}  # later in STATUSES = worse


def rank_ranges(ranks: Iterable[int], shortest: int = 2) -> str:
    """``[1, 2, 3, 5, 9, 10]`` -> ``"1-3,5,9-10"``; a run shorter than ``shortest`` ranks stays a list
    (``shortest=3``: ``"1-3,5,9,10"``)."""
    rs = sorted({int(r) for r in ranks})
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts += [f"{rs[i]}-{rs[j]}"] if j - i + 1 >= max(shortest, 2) else [str(r) for r in rs[i:j + 1]]
        i = j + 1
    return ",".join(parts)


def ranks_words(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0,1``, ``ranks 1-63`` (a run of three or more reads as a range: a sentence about
    a 64-rank mesh must stay one line)."""
    rs = {int(r) for r in ranks}
    return ("rank " if len(rs) == 1 else "ranks ") + rank_ranges(rs, shortest=3)


def rank_label(ranks: Iterable[int], how: str = "identical") -> str:
    """``rank 3``; ``ranks 1-15 (15 identical)``; ``ranks 8-63 (56, same status)``; ``... (20, mixed)``."""
    rs = sorted({int(r) for r in ranks})
    if not rs:
        raise ValueError("a rank group needs at least one rank")
    if len(rs) == 1:
        return f"rank {rs[0]}"
    what = f"{len(rs)} identical" if how == "identical" else f"{len(rs)}, {how}"
    return f"ranks {rank_ranges(rs)} ({what})"


def _check(tensors: pd.DataFrame) -> None:
    missing = [c for c in ("rank", "name", "dtype", "fingerprint") if c not in tensors]
    if missing:
        raise ValueError(f"a probe table needs columns {missing}; got {list(tensors.columns)}")
    if "step_index" in tensors and tensors["step_index"].nunique() > 1:
        raise ValueError("rank groups are per step: pass one step's rows (e.g. frame.tensors or "
                         "history[history.step_index == i]), not a whole history")


def with_status(tensors: pd.DataFrame, reference_rank: int = 0) -> pd.DataFrame:
    """The probe rows with ``status`` and ``detail`` from :func:`workbench.analysis.findings.status`."""
    _check(tensors)
    st = status(tensors, reference_rank)
    out = tensors.reset_index(drop=True).copy()
    out["status"] = list(st["status"]) if len(st) else []
    out["detail"] = list(st["detail"]) if len(st) else []
    return out


def _signatures(merged: pd.DataFrame, key: tuple[str, ...]) -> dict[int, tuple]:
    names = list(dict.fromkeys(merged["name"]))
    per: dict[int, dict[str, tuple]] = {}
    cols = [merged[c].tolist() for c in ("rank", "name", *key)]
    for rank, name, *vals in zip(*cols):
        per.setdefault(int(rank), {})[name] = tuple(str(v) for v in vals)
    return {r: tuple(d.get(n, ("missing",)) for n in names) for r, d in per.items()}


def _by_signature(sigs: dict[int, tuple], ranks: list[int]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for r in ranks:
        groups.setdefault(sigs[r], []).append(r)
    return sorted(groups.values(), key=lambda g: g[0])


def group_identical_ranks(tensors: pd.DataFrame, reference_rank: int = 0, max_rows: int | None = None,
                          merged: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per group of ranks: ``group, label, ranks, first, size, how``.

    ``how`` is ``identical`` (same status, dtype and fingerprint for every tensor),
    ``same status`` (folded only once identical groups exceed ``max_rows``) or ``mixed``
    (the rest, beyond the row budget). Groups are ordered by their lowest rank.
    """
    if max_rows is not None and max_rows < 2:
        raise ValueError(f"max_rows must be at least 2 (one group and the 'mixed' rest), got {max_rows}")
    if merged is None:
        merged = with_status(tensors, reference_rank)
    if merged.empty:
        return pd.DataFrame(columns=GROUP_COLUMNS)
    ranks = sorted({int(r) for r in merged["rank"]})
    groups = [(g, "identical") for g in _by_signature(_signatures(merged, ("status", "dtype", "fingerprint")), ranks)]
    if max_rows is not None and len(groups) > max_rows:
        by_status = _by_signature(_signatures(merged, ("status",)), ranks)
        groups = [(g, "identical") if len(g) == 1 or _same(g, groups) else (g, "same status") for g in by_status]
        if len(groups) > max_rows:
            keep, rest = groups[: max_rows - 1], groups[max_rows - 1:]
            folded = sorted(r for g, _ in rest for r in g)
            groups = [*keep, (folded, "mixed" if len(rest) > 1 else rest[0][1])]
    rows = []
    for i, (g, how) in enumerate(groups):
        how = "identical" if len(g) == 1 else how
        rows.append({"group": i, "label": rank_label(g, how), "ranks": list(g), "first": g[0], "size": len(g),
                     "how": how})
    return pd.DataFrame(rows, columns=GROUP_COLUMNS)


def _same(g: list[int], identical: list[tuple[list[int], str]]) -> bool:
    return any(set(g) == set(h) for h, _ in identical)


def group_cells(merged: pd.DataFrame, groups: pd.DataFrame) -> pd.DataFrame:
    """Per (group, tensor): the group's status (the worst when members differ) and a detail line.

    ``contents`` counts distinct fingerprints among the members; ``present`` how many of
    them hold the tensor at all (the others count as ``missing``).
    """
    names = list(dict.fromkeys(merged["name"]))
    member = {r: int(g) for g, rs in zip(groups["group"], groups["ranks"]) for r in rs}
    sizes = dict(zip(groups["group"], groups["size"]))
    how = dict(zip(groups["group"], groups["how"]))
    m = merged.assign(group=merged["rank"].map(lambda r: member[int(r)]))
    # identical groups: every member holds what the first one holds (no per-cell work)
    firsts = {int(f): int(g) for g, f, h in zip(groups["group"], groups["first"], groups["how"]) if h == "identical"}
    rep = m[m["rank"].map(lambda r: firsts.get(int(r)) is not None)]
    out = [{"group": int(g), "name": n, "status": s, "detail": str(d), "dtype": dt, "shape": sh, "kind": k,
            "head": h, "contents": 1, "present": int(sizes[g])}
           for g, n, s, d, dt, sh, k, h in zip(rep["group"], rep["name"], rep["status"], rep["detail"], rep["dtype"],
                                               _col(rep, "shape"), _col(rep, "kind"), _col(rep, "head"))]
    for (gid, name), g in m[m["group"].map(lambda g: how[g] != "identical")].groupby(["group", "name"], sort=False):
        first = g.iloc[0]
        n, present = int(sizes[gid]), len(g)
        counts = g["status"].value_counts()
        if present < n:
            counts["missing"] = n - present
        worst = max(counts.index, key=lambda s: _SEVERITY.get(s, 0))
        if len(counts) == 1 and present == n and g["detail"].nunique() == 1:
            detail = str(first["detail"])
        else:
            detail = ", ".join(f"{s} on {int(c)} rank{'s' if c > 1 else ''}"
                               for s, c in sorted(counts.items(), key=lambda kv: -_SEVERITY.get(kv[0], 0)))
        lead = g[g["status"] == worst].iloc[0] if (g["status"] == worst).any() else first
        out.append({"group": int(gid), "name": name, "status": worst, "detail": detail,
                    "dtype": lead["dtype"], "shape": lead.get("shape", ""), "kind": lead.get("kind", ""),
                    "head": lead.get("head", None), "contents": int(g["fingerprint"].nunique()),
                    "present": present})
    cells = pd.DataFrame(out, columns=CELL_COLUMNS)
    # every (group, tensor) pair gets a cell: a group where nobody holds the tensor is 'missing'
    have = set(zip(cells["group"], cells["name"]))
    extra = [{"group": int(gid), "name": nm, "status": "missing", "detail": "no rank in this group holds it",
              "dtype": "", "shape": "", "kind": "", "head": None, "contents": 0, "present": 0}
             for gid in groups["group"] for nm in names if (int(gid), nm) not in have]
    if extra:
        cells = pd.concat([cells, pd.DataFrame(extra, columns=CELL_COLUMNS)], ignore_index=True)
    return cells


def _col(df: pd.DataFrame, name: str) -> list:
    return df[name].tolist() if name in df else [""] * len(df)


def group_values(rows: pd.DataFrame, max_lines: int | None = None) -> list[dict]:
    """One tensor on one step: ranks with the same dtype, fingerprint and first values, folded.

    Returns ``[{label, ranks, row}]`` ordered by lowest rank; past ``max_lines`` the rest
    is one entry with ``rows`` (a representative row per folded group) and ``how='mixed'``.
    """
    keys: dict[tuple, list] = {}
    for row in rows.itertuples(index=False):
        head = tuple(float(v) for v in (list(row.head) if row.head is not None else []))
        key = (str(row.dtype), str(row.fingerprint), repr(head))
        keys.setdefault(key, []).append(row)
    groups = sorted(keys.values(), key=lambda g: int(g[0].rank))
    out = [{"label": rank_label([r.rank for r in g]), "ranks": sorted(int(r.rank) for r in g), "row": g[0],
            "how": "identical"} for g in groups]
    if max_lines is not None and len(out) > max_lines:
        keep, rest = out[: max_lines - 1], out[max_lines - 1:]
        ranks = sorted(r for e in rest for r in e["ranks"])
        keep.append({"label": f"ranks {rank_ranges(ranks)} ({len(ranks)}, {len(rest)} distinct)", "ranks": ranks,
                     "rows": [e["row"] for e in rest], "labels": [e["label"] for e in rest], "how": "mixed"})
        out = keep
    return out


# -- meshes: where each rank sits, and which replica of a tensor parted ---------------------------------------
def mesh_coords(tensors: pd.DataFrame) -> dict[int, tuple[tuple[str, int], ...]]:
    """rank -> its coordinate on the run's device mesh, ``(("replicate", 1), ("shard", 0))``, read from the
    ``mesh_coord`` column a DTensor's row carries (the mesh of most dimensions when a run holds several). Empty
    when the run has no mesh of two or more dimensions (a 1-D mesh's coordinate is the rank itself), or when a
    rank's coordinate is unknown (a recording made before the column existed)."""
    if "mesh_coord" not in tensors or "rank" not in tensors:
        return {}
    best: dict[int, tuple[tuple[str, int], ...]] = {}
    for rank, text in zip(tensors["rank"], tensors["mesh_coord"]):
        if not isinstance(text, str) or not text:
            continue
        try:
            coord = tuple((d.strip(), int(c)) for d, c in (part.rsplit("=", 1) for part in text.split(",")))
        except ValueError:
            continue
        r = int(rank)
        if len(coord) > len(best.get(r, ())):
            best[r] = coord
    ranks = {int(r) for r in tensors["rank"]}
    dims = {tuple(d for d, _ in c) for c in best.values()}
    if set(best) != ranks or len(dims) != 1 or len(next(iter(dims))) < 2:
        return {}
    return best


def coord_label(coord: tuple[tuple[str, int], ...]) -> str:
    """``replicate 0 · shard 1``."""
    return " · ".join(f"{d} {c}" for d, c in coord)


def replica_parting(tensors: pd.DataFrame) -> dict[str, str]:
    """tensor name -> which replica group parted, for a tensor replicated along mesh dims whose replicas hold
    different bytes: ``"replica group parted: `replicate` 1 (ranks 2,3) differs from `replicate` 0 (ranks 0,1)"``.

    One step's rows with ``status`` (:func:`with_status`) and the ``agree_by`` / ``replica`` columns
    (``rank/agree.py``); a replica is the set of ranks with one value of ``replica``, and a replica parted when
    its ranks' rows read ``differs`` (compared with the lowest rank of their agree group)."""
    need = ("status", "agree_by", "replica", "name", "rank")
    if any(c not in tensors for c in need):
        return {}
    out: dict[str, str] = {}
    rows = tensors[tensors["agree_by"].map(lambda b: isinstance(b, str) and b.startswith("mesh dim"))]
    for name, g in rows.groupby("name", sort=False):
        if not (g["status"] == "differs").any():
            continue
        by = str(g["agree_by"].iloc[0])
        dims = by.split(" ", 2)[2] if by.count(" ") >= 2 else by  # "`replicate`" or "`a`, `b`"
        reps: dict[str, list[int]] = {}
        for r, rep in zip(g["rank"], g["replica"]):
            if isinstance(rep, str) and rep:
                reps.setdefault(rep, []).append(int(r))
        parted = sorted({str(rep) for rep, st in zip(g["replica"], g["status"]) if st == "differs"})
        held = [rep for rep in reps if rep not in parted]
        if not parted or not held:
            continue
        first = min(held, key=lambda rep: min(reps[rep]))
        said = {rep: f"{dims} {rep} ({ranks_words(ranks)})" for rep, ranks in reps.items()}
        out[str(name)] = (f"replica group parted: {', '.join(said[p] for p in parted)} "
                          f"differ{'s' if len(parted) == 1 else ''} from {said[first]}")
    return out
