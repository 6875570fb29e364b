"""Findings across ranks: what differs, what is broken, and on which rank.

Pure functions of frame tables, so a live session and a loaded bundle get the same
answers. Each detector returns rows ``(step, severity, rank, name, finding)``.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

import pandas as pd

from workbench.analysis import floor

STATUSES = ["ok", "sharded", "apart", "meta", "differs", "dtype", "reference", "inf", "nan", "poison", "missing"]
APART = "differs, not expected to agree"  # a neutral status: a difference no expectation asked to be absent
FINDING_COLUMNS = ["step", "severity", "rank", "name", "detector", "finding"]


# The columns ``status`` reads of a row: the rows it walks carry only these (a tensors table has ~25).
_STATUS_COLUMNS = ("rank", "name", "dtype", "numel", "is_meta", "fingerprint", "sharded", "poisoned", "written", "nan",
                   "inf", "ref_diff", "agree", "agree_by")


@lru_cache(maxsize=64)
def _row_type(fields: tuple[str, ...]) -> type:
    return namedtuple("Pandas", fields, rename=True)


def _rows(df: pd.DataFrame, columns: tuple[str, ...]) -> Iterator[Any]:
    """``df[columns].itertuples(index=False)`` (those of ``columns`` it has), the same values: a string column is
    read in one conversion instead of one pyarrow scalar an element (that made ``status`` the slowest part of a
    run's diagnosis: ~1 ms a row); every other column as ``itertuples`` reads it."""
    cols = [c for c in columns if c in df.columns]
    arrays: list[Any] = []
    for c in cols:
        values = df[c]
        arr = values.array
        if isinstance(values.dtype, pd.StringDtype) and type(arr).__name__ == "ArrowStringArray":
            arrays.append(arr.to_numpy(dtype=object, na_value=values.dtype.na_value))
        else:
            arrays.append(values)
    return map(_row_type(tuple(cols))._make, zip(*arrays))


def _rank0(tensors: pd.DataFrame, reference_rank: int = 0) -> pd.DataFrame:
    return tensors[tensors["rank"] == reference_rank].set_index("name")


def status(tensors: pd.DataFrame, reference_rank: int = 0) -> pd.DataFrame:
    """One status per (rank, tensor): the worst thing the rank's copy shows.

    ``poison``: NaN that is still the bit pattern ``to_empty`` was filled with (never
    written); ``nan``/``inf``: non-finite values; ``dtype``/``differs``: not what the
    reference rank holds for a tensor every rank should hold whole.
    """
    if tensors.empty:
        return pd.DataFrame(columns=["rank", "name", "status", "detail"])
    if "agree" in tensors:  # the probe said what must agree (rank/agree.py): compare only there
        return _status_learned(tensors, reference_rank)
    ref = _rank0(tensors, reference_rank)
    # one dict lookup per row (a .loc per row took ~1 s at 64 ranks x 60 tensors)
    ref_rows = dict(zip(ref.index, ref[["dtype", "numel", "is_meta", "fingerprint"]].to_dict("records")))
    out = []
    for row in _rows(tensors, _STATUS_COLUMNS):
        st, detail = "ok", ""
        r0 = ref_rows.get(row.name)
        own = _own_health(row)
        if own:
            st, detail = own
        elif _flag(getattr(row, "sharded", None)):
            st, detail = "sharded", "this rank's own (a shard or a role's copy): checked on its own, not against rank 0"
        elif r0 is None:
            st, detail = "missing", f"rank {reference_rank} has no such tensor"
        elif row.rank != reference_rank and r0["dtype"] != row.dtype:
            st, detail = "dtype", f"{row.dtype} here, {r0['dtype']} on rank {reference_rank}"
        elif row.rank != reference_rank and r0["numel"] != row.numel:
            st, detail = "sharded", f"{row.numel} elements here, {r0['numel']} on rank {reference_rank}"
        elif row.rank != reference_rank and not r0["is_meta"] and r0["fingerprint"] != row.fingerprint:
            st, detail = "differs", f"content differs from rank {reference_rank}"
        out.append({"rank": row.rank, "name": row.name, "status": st, "detail": detail})
    return pd.DataFrame(out)


def _own_health(row: Any) -> tuple[str, str] | None:
    """What a rank's copy shows on its own, before any comparison with another rank (the same order for both
    statuses): meta, never written, NaN, Inf, off its first-principles reference; None when nothing."""
    if row.is_meta:
        return "meta", "on the meta device: no data"
    if _count(row.poisoned) > 0:
        return "poison", f"{row.poisoned} of {row.numel} elements never written since to_empty"
    if getattr(row, "written", None) == "never written":
        return "poison", "bytes unchanged since to_empty handed them out"
    if _count(row.nan) > 0:
        return "nan", f"{row.nan} NaN of {row.numel}"
    if _count(row.inf) > 0:
        return "inf", f"{row.inf} Inf of {row.numel}"
    if _bad_ref(getattr(row, "ref_diff", None)):
        return "reference", f"departs from the value computed from first principles by {row.ref_diff:.3g}"
    return None


def agree_ranks(v: object) -> list[int]:
    """The ranks an ``agree`` cell names (``"0,2"``); none for ``""``, None or NaN (this rank's own)."""
    if not isinstance(v, str) or not v:
        return []
    return [int(x) for x in v.split(",") if x.strip().lstrip("-").isdigit()]


def _by_words(by: object, ranks: list[int], world: int) -> str:
    """`` (mesh dim `replicate`)``: why a group must agree, when it is not simply every rank (today's words)."""
    if not isinstance(by, str) or not by or (len(ranks) == world and not by.startswith(("mesh", "DDP", "DeepSpeed"))):
        return ""
    return f" ({by})"


def _status_learned(tensors: pd.DataFrame, reference_rank: int = 0) -> pd.DataFrame:
    """``status`` where each row says the ranks it must agree across (``agree``): a copy is compared with the
    lowest rank of its group that holds it; a row of no group that differs from the reference rank is
    ``apart`` (neutral: "differs, not expected to agree"), never ``differs``."""
    cols = ["dtype", "numel", "is_meta", "fingerprint"]
    held = {(int(r), n): v for r, n, *v in _rows(tensors, ("rank", "name", *cols))}
    world = tensors["rank"].nunique()
    out = []
    for row in _rows(tensors, _STATUS_COLUMNS):
        st, detail = "ok", ""
        group = agree_ranks(getattr(row, "agree", None))
        by = getattr(row, "agree_by", None)
        rank = int(row.rank)
        own = _own_health(row)
        if own:
            st, detail = own
        elif group:
            ref_rank = next((r for r in sorted(group) if (r, row.name) in held), rank)
            ref = held.get((ref_rank, row.name))
            why = _by_words(by, group, world)
            if ref_rank == rank or ref is None:
                pass
            elif ref[0] != row.dtype:
                st, detail = "dtype", f"{row.dtype} here, {ref[0]} on rank {ref_rank}{why}"
            elif ref[1] != row.numel:
                st, detail = "differs", f"{row.numel} elements here, {ref[1]} on rank {ref_rank}{why}"
            elif not ref[2] and ref[3] != row.fingerprint:
                st, detail = "differs", f"content differs from rank {ref_rank}{why}"
        elif _flag(getattr(row, "sharded", None)):
            st, detail = "sharded", "this rank's own (a shard or a role's copy): checked on its own, not against rank 0"
        else:
            ref = held.get((reference_rank, row.name))
            if ref is None:
                st, detail = "missing", f"rank {reference_rank} has no such tensor"
            elif rank != reference_rank and not ref[2] and \
                    (ref[0] != row.dtype or ref[1] != row.numel or ref[3] != row.fingerprint):
                st = "apart"
                detail = (f"{APART}: differs from rank {reference_rank}, and nothing (a placement, a wrapper, a "
                          "collective, a declaration) says the ranks hold it whole" if not by else
                          f"{APART}: differs from rank {reference_rank} ({by})")
        out.append({"rank": rank, "name": row.name, "status": st, "detail": detail})
    return pd.DataFrame(out)


REF_TOL = 1e-6


def _flag(v: object) -> bool:
    return v is not None and v is not pd.NA and v == v and bool(v)


def _bad_ref(diff: object) -> bool:
    """A real comparison that failed (NaN in the tensor arrives as inf; NaN/None: no expectation)."""
    return diff is not None and diff is not pd.NA and diff == diff and float(diff) > REF_TOL


def _count(v: object) -> int:
    return 0 if v is None or v is pd.NA or v != v else int(v)


# -- detectors ----------------------------------------------------------------------
def rank_failures(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    return [{"severity": "error", "rank": int(e.rank), "name": "", "detector": "failure",
             "finding": f"{e.kind}: {e.error}: {str(e.message)[:300]}"} for e in events.itertuples()]


def dtype_split(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Tensors whose dtype is not the same on every rank, one row per pattern of dtypes."""
    patterns: dict[str, list[str]] = {}
    for name, g in tensors.groupby("name", sort=False):
        if g["dtype"].nunique() > 1:
            per = ", ".join(f"{d} on rank {_ranks(sorted(int(r) for r in gg['rank']))}" for d, gg in g.groupby("dtype"))
            patterns.setdefault(per, []).append(name)
    return [{"severity": "warning", "rank": None, "name": names[0], "detector": "dtype split",
             "finding": f"{len(names)} tensor(s) with {per}: {_some(names)}"} for per, names in patterns.items()]


def divergence(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Per rank, the tensors whose status is not ok, summarised to one line."""
    st = status(tensors)
    rows = []
    for (rank, s), g in st[~st["status"].isin(["ok", "meta", "sharded", "apart"])].groupby(["rank", "status"]):
        names = list(g["name"])
        rows.append({"severity": "error" if s in ("nan", "poison", "inf") else "warning", "rank": int(rank),
                     "name": names[0], "detector": f"status {s}",
                     "finding": f"{len(names)} tensor(s) {s}: {_some(names)}"})
    return rows


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


def output_health(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Non-finite outputs, outputs that depart from the reference, or from rank 0."""
    rows = []
    if outputs.empty:
        return rows
    ref = _rank0(outputs)
    learned = "agree" in outputs  # the probe said which outputs must agree, and across which ranks
    held = output_held(outputs)
    for o in outputs.itertuples(index=False):
        if _count(o.nan) > 0:
            rows.append({"severity": "error", "rank": int(o.rank), "name": o.name, "detector": "outputs",
                         "finding": f"{o.nan} of {o.numel} values NaN"})
        diff, fl = getattr(o, "ref_max_abs_diff", None), getattr(o, "ref_floor", None)
        if floor.departs(diff, fl):
            rows.append({"severity": "error", "rank": int(o.rank), "name": o.name, "detector": "reference",
                         "finding": f"max |output - reference| = {diff:.3g}"
                         + (f" (the engine's own floor in this run: {fl:.3g})" if floor.floor_of(fl) else "")})
        elif learned:
            apart = output_apart(o, held)
            if apart is not None:
                rows.append({"severity": "warning", "rank": int(o.rank), "name": o.name, "detector": "outputs",
                             "finding": apart})
        elif o.rank != 0 and o.name in ref.index and ref.loc[o.name]["fingerprint"] != o.fingerprint \
                and not _flag(getattr(o, "sharded", None)):
            rows.append({"severity": "warning", "rank": int(o.rank), "name": o.name, "detector": "outputs",
                         "finding": "differs from rank 0"})
    return rows


def output_held(outputs: pd.DataFrame) -> dict[tuple[int, str], tuple[object, object]]:
    """(rank, name) -> (fingerprint, inputs digest) of a step's outputs: what ``output_apart`` compares."""
    fed = outputs["inputs"] if "inputs" in outputs else [None] * len(outputs)
    return {(int(r), n): (f, i) for r, n, f, i in zip(outputs["rank"], outputs["name"], outputs["fingerprint"], fed)}


def output_apart(o: object, held: dict[tuple[int, str], tuple[object, object]], by_inputs: bool = True) -> str | None:
    """How an output departs from the ranks it must agree with, or None: ``differs from rank 0`` (the lowest rank
    of its group that has it). Its group: the ranks its ``agree`` names; else, when nothing was said of it
    (``agree_by`` empty) and ``by_inputs``, the ranks whose forwards were fed the same inputs in the step."""
    group = agree_ranks(getattr(o, "agree", None))
    fed = getattr(o, "inputs", None)
    if not group and by_inputs and not getattr(o, "agree_by", None) and isinstance(fed, str) and fed \
            and floor.number(getattr(o, "ref_max_abs_diff", None)) is None:
        group = sorted(r for (r, n), (_, i) in held.items() if n == o.name and i == fed)
        group = group if len(group) > 1 else []
    rank = int(o.rank)
    ref_rank = next((r for r in sorted(group) if (r, o.name) in held), rank)
    if not group or ref_rank == rank or held[(ref_rank, o.name)][0] == o.fingerprint:
        return None
    return f"differs from rank {ref_rank}"


def reference_check(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Tensors that depart from a value computable from the config, even when all ranks agree."""
    if "ref_diff" not in tensors:
        return []
    rows = []
    # A boolean Series, never a bare list: an empty list would select no *columns* and lose "name".
    bad = tensors[tensors["ref_diff"].map(_bad_ref).astype(bool)]
    for name, g in bad.groupby("name", sort=False):
        ranks = sorted(int(r) for r in g["rank"])
        agree = g["fingerprint"].nunique() == 1 and len(ranks) == tensors["rank"].nunique() > 1
        worst = max(float(d) for d in g["ref_diff"])
        rows.append({"severity": "error", "rank": ranks[0] if len(ranks) == 1 else None, "name": name,
                     "detector": "reference",
                     "finding": (f"rank(s) {_ranks(ranks)} depart from the value computed from the config "
                                 f"(max diff {worst:.3g})" + ("; all ranks agree on the same wrong bytes, so a "
                                                              "cross-rank check sees nothing" if agree else ""))})
    return rows


def never_written(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """Tensors to_empty handed out and nobody wrote; worse when this step ran a forward over them."""
    if "written" not in tensors:
        return []
    rows = []
    todo = tensors[tensors["written"].isin(["never written", "partly written"])]
    read = len(outputs) > 0
    for (rank, state), g in todo.groupby(["rank", "written"], sort=False):
        names = list(g["name"])
        verb = "a forward read" if read else "holding"
        rows.append({"severity": "error" if read else "warning", "rank": int(rank), "name": names[0],
                     "detector": "written since materialisation",
                     "finding": f"{verb} {len(names)} tensor(s) {state} since to_empty: {_some(names)}"})
    return rows


def reinterpretation(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame) -> list[dict]:
    """A rank whose bytes are rank 0's bytes of another dtype, or shifted: a mispaired transfer."""
    return [{"severity": "error", "rank": m["rank"], "name": m["name"], "detector": "reinterpretation",
             "finding": m["finding"]} for m in reinterpretations(tensors)]


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)


MIN_MATCH = 16  # bytes: shorter windows match by chance


def _informative(b: bytes) -> bool:
    return len(set(b)) >= 4


def _byte_windows(row: object) -> list[tuple[int, bytes]]:
    """(byte offset, bytes) the probe kept of one tensor: its first bytes, then the fixed-offset windows."""
    from workbench.rank.columns import WINDOW, WINDOW_OFFSETS

    out = [(0, bytes.fromhex(getattr(row, "raw", None) or ""))]
    win = getattr(row, "windows", None)
    if isinstance(win, str) and win:
        b = bytes.fromhex(win)
        out += [(off, b[i * WINDOW:(i + 1) * WINDOW]) for i, off in enumerate(WINDOW_OFFSETS)
                if (i + 1) * WINDOW <= len(b)]
    return [(o, b) for o, b in out if b]


def reinterpretations(tensors: pd.DataFrame, reference_rank: int = 0) -> list[dict]:
    """Each diverging (rank, tensor) whose kept bytes occur in a reference-rank tensor's kept bytes.

    Every kept window of the diverging copy (its first bytes, then the fixed-offset windows) is
    looked for in every kept window of the reference rank, the same tensor first: bytes of
    another dtype (fp32 read as bf16), of another tensor, or of the same tensor at another offset
    (a stream that slid by a bucket's worth of bytes) are all named.
    """
    if tensors.empty or "raw" not in tensors:
        return []
    st = status(tensors, reference_rank).set_index(["rank", "name"])["status"]
    ref = tensors[tensors["rank"] == reference_rank]
    ref_raw = [(r.name, r.dtype, _byte_windows(r)) for r in ref.itertuples(index=False)]
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4}
    out = []
    for row in tensors[tensors["rank"] != reference_rank].itertuples(index=False):
        if st.get((row.rank, row.name)) not in ("differs", "dtype", "nan", "inf", "poison", "reference"):
            continue
        hit = _find(_byte_windows(row), sorted(ref_raw, key=lambda x: x[0] != row.name), (row.name, row.dtype))
        if hit is None:
            continue
        at, name, dtype, src_at = hit
        shift = at - src_at
        if name == row.name and shift and dtype == row.dtype:
            es = sizes.get(str(row.dtype))
            elems = f" ({abs(shift) // es} {row.dtype} elements)" if es and shift % es == 0 else ""
            what = (f"rank {reference_rank}'s own bytes shifted {'up' if shift > 0 else 'down'} by {abs(shift)} B"
                    f"{elems}: byte {at} here is byte {src_at} there")
        else:
            mine = f" from byte {at}" if at else ""
            where = f" from byte {src_at}" if src_at else ""
            what = (f"rank {reference_rank} {dtype} bytes of `{name}`{where} reinterpreted as {row.dtype}"
                    if dtype != row.dtype else f"rank {reference_rank} bytes of `{name}`{where}")
            what = what + (f" (seen{mine})" if mine else "")
        out.append({"rank": int(row.rank), "name": row.name, "source": name, "offset": src_at, "at": at,
                    "shift": shift if name == row.name else None,
                    "finding": f"rank {row.rank} `{row.name}` ({row.dtype}) = {what}"})
    return out


def _find(mine: list[tuple[int, bytes]], refs: list[tuple[str, str, list[tuple[int, bytes]]]],
          me: tuple[str, str]) -> tuple[int, str, str, int] | None:
    """(my byte offset, source tensor, its dtype, source byte offset) of the first window of mine found in refs;
    a window equal to the reference's same bytes of the same tensor (the part that is right) is no answer."""
    for at, b in mine:
        probe = b[:MIN_MATCH]
        if len(probe) < MIN_MATCH or not _informative(probe):
            continue
        for name, dtype, windows in refs:
            for off, theirs in windows:
                pos = theirs.find(probe)
                if pos < 0:
                    continue
                n = min(len(b), len(theirs) - pos)
                if (name, dtype, off + pos) == (*me, at):
                    continue
                if b[:n] == theirs[pos: pos + n]:
                    return at, name, dtype, off + pos
    return None


def _forward_trace(*args, **kwargs) -> list[dict]:
    from workbench.analysis.trace import forward_trace

    return forward_trace(*args, **kwargs)


DETECTORS: list[Callable[..., list[dict]]] = [
    rank_failures, dtype_split, divergence, reference_check, never_written, reinterpretation, output_health,
    _forward_trace,
]


def _extras(detect: Callable, extra: dict) -> dict:
    """The keyword tables (``trace=``, ...) a detector accepts: by name or through ``**kwargs``."""
    import inspect

    params = inspect.signature(detect).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return extra
    return {k: v for k, v in extra.items() if k in params}


def findings(step: str, tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame,
             **extra: pd.DataFrame) -> pd.DataFrame:
    """Every detector's rows for one step; ``extra`` tables (``trace=``) go to detectors that take them."""
    rows = []
    for detect in DETECTORS:
        for row in detect(step, tensors, outputs, events, **_extras(detect, extra)):
            rows.append({"step": step, **row})
    out = pd.DataFrame(rows, columns=FINDING_COLUMNS)
    out["rank"] = out["rank"].astype("Int64")  # None (all ranks) stays <NA>, ranks stay integers
    return out


def history_findings(tensors: pd.DataFrame, outputs: pd.DataFrame, events: pd.DataFrame,
                     **extra: pd.DataFrame) -> pd.DataFrame:
    """Findings of every step of a run, from its stacked tables (``step`` column); then ties that broke
    between one step and the next (``broken_ties``)."""
    parts = []
    steps = list(dict.fromkeys(tensors["step"])) if "step" in tensors else []
    for step in dict.fromkeys(steps + (list(events["step"]) if "step" in events else [])):
        def pick(df, s=step):
            return (df[df["step"] == s].drop(columns=["step", "step_index"]) if "step" in df else df)
        more = {k: pick(v) for k, v in extra.items() if v is not None}
        parts.append(findings(step, pick(tensors), pick(outputs), pick(events), **more))
    broke = broken_ties(tensors)
    if len(broke):
        parts.append(broke)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=FINDING_COLUMNS)


def ties(t: pd.DataFrame) -> set[frozenset[str]]:
    """The pairs of names one tensor is held under in a step's rows (the probe's ``shares``), any rank."""
    if t.empty or "shares" not in t:
        return set()
    out: set[frozenset[str]] = set()
    for name, shared in zip(t["name"], t["shares"]):
        if isinstance(shared, str) and shared:
            out |= {frozenset((name, other)) for other in shared.split(",") if other and other != name}
    return out


def broken_ties(tensors: pd.DataFrame) -> pd.DataFrame:
    """A tie that held in one step and not in the next, while both names are still probed: ``head.weight`` and
    ``embed.weight`` one tensor until ``to_empty`` re-created each module's parameter. Whatever is then written
    into one never reaches the other (a tied checkpoint, an optimizer step)."""
    if tensors.empty or "shares" not in tensors or "step" not in tensors:
        return pd.DataFrame(columns=FINDING_COLUMNS)
    rows, before = [], set()
    for step in dict.fromkeys(tensors["step"]):
        t = tensors[tensors["step"] == step]
        now, held = ties(t), set(t["name"])
        for pair in sorted(before - now, key=sorted):
            if pair <= held:
                a, b = sorted(pair)
                rows.append({"step": step, "severity": "warning", "rank": None, "name": a, "detector": "tie broken",
                             "finding": f"`{a}` and `{b}` were one tensor (tied) before step `{step}` and are two "
                                        "after it: what is written into one no longer reaches the other"})
        before = now
    out = pd.DataFrame(rows, columns=FINDING_COLUMNS)
    out["rank"] = out["rank"].astype("Int64")
    return out


def deduplicated(found: pd.DataFrame, steps: list[str] | None = None) -> pd.DataFrame:
    """One row per finding repeated across steps, with where it was first and last seen.

    A dtype split found at ``cast`` is found again at every later step; a reader wants it
    once: "first seen at `cast`, still there at `forward`".
    """
    cols = ["severity", "rank", "name", "detector", "finding", "seen"]
    if found.empty:
        return pd.DataFrame(columns=cols)
    steps = steps or list(dict.fromkeys(found["step"]))
    last = steps[-1] if steps else None
    rows = []
    keys = ["severity", "rank", "name", "detector", "finding"]
    for key, g in found.fillna({"name": ""}).groupby(keys, sort=False, dropna=False):
        at = list(dict.fromkeys(g["step"]))
        if len(at) == 1:
            seen = f"at `{at[0]}`" + (" (the last step)" if at[0] == last and len(steps) > 1 else "")
        else:
            seen = f"first seen at `{at[0]}`, " + (f"still there at `{at[-1]}`" if at[-1] == last
                                                   else f"last seen at `{at[-1]}`")
        rows.append({**dict(zip(keys, key)), "seen": seen, "_order": steps.index(at[0]) if at[0] in steps else 0})
    out = pd.DataFrame(rows).sort_values("_order", kind="stable").drop(columns="_order").reset_index(drop=True)
    out["rank"] = out["rank"].astype("Int64")
    return out[cols]


CLOBBERED = "clobbered: "  # the head of a capture's note on a tensor to_empty replaced although it was real


def clobbered(notes: list[dict[str, Any]]) -> dict[str, tuple[str, list[int]]]:
    """name -> (the sentence, the ranks that said it) from a run's notes on tensors ``to_empty`` replaced although
    they were real (``workbench/job/materialise.py``: "clobbered: `name` was real (zeros) before ...")."""
    out: dict[str, tuple[str, list[int]]] = {}
    for n in notes:
        text = n.get("note") if isinstance(n, dict) else None
        if not isinstance(text, str) or not text.startswith(CLOBBERED) or text.count("`") < 2:
            continue
        sentence = text[len(CLOBBERED):]
        name = sentence.split("`", 2)[1]
        said, ranks = out.get(name, (sentence, []))
        rank = n.get("rank")
        out[name] = (said, sorted({*ranks, int(rank)}) if isinstance(rank, (int, float)) and rank == rank else ranks)
    return out
