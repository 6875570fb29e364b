"""Two runs of the same job side by side: where they first part, in one sentence.

``diff(a, b)`` takes two captures of a job (directories of shards), bundles, or one of each, and
compares them point by point:

- points are aligned by name and order (the longest common run of names), tensors by name, ranks
  by rank (the coordinate on a one-dimensional mesh);
- a tensor's rows compare with the rerun's closeness rules (``closeness``: dtype, shape, meta-ness,
  written-ness and NaN/Inf/poison counts exactly, values within rounding); a difference within
  rounding is said as such, never as a cause;
- runs of different world sizes read every rank of the larger run, by what the runs recorded a tensor
  must be across ranks (the ``agree`` columns): a sharded tensor (a ``Shard`` placement) through
  summaries that add up across shards: element, NaN, Inf and poison counts, min, max, the sum of the
  finite values (mean x finite count) and their sum of squares (``sumsq``), so a tensor of 2 shards
  compares with the same tensor of 4, its placements and whole shape compared where recorded; a
  replicated one rank by rank, a rank only the larger run has against the smaller run's value; each
  rank's own (a per-rank batch's output) for what every rank's row must be, its values said as
  summaries, never a cause. The ranks only one run has are said, never skipped;
- a dtype the runs were given (most float tensors fp32 in one and bf16 in the other) is said first,
  as a setting, and a tensor that does not follow it is the story;
- the collective sequences compare rank by rank (op, dtypes, tensors, bytes; across world sizes op
  and dtypes only, the sizes follow the shards);
- versions and machines that differ (torch, transformers, CPU, kernel knobs) are said first.

Tables in, facts out: ``RunDiff.cells`` (one row per point and tensor: the first kind of difference,
the ranks, the words) feeds ``workbench.viz.diff.diff_figure`` and the HTML page (``to_html``).
"""

from __future__ import annotations

import difflib
import html
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.analysis.diagnosis_words import dt
from workbench.errors import BundleError
from workbench.postmortem import closeness
from workbench.postmortem.record import RunRecord

# The kinds of difference, in the order a cell is classified (the first that applies names the cell).
KINDS = ["only in one run", "dtype", "shape", "placement", "meta", "written", "NaN/Inf/poison", "values",
         "within rounding", "dtype as given", "each rank's own", "same", "not on both"]
CAUSES = KINDS[:8]  # kinds that part the runs; "within rounding", "dtype as given", "each rank's own" never do
CELL_COLUMNS = ["point", "point_index", "name", "table", "kind", "ranks", "detail", "expect"]
_SIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _load(x: Any) -> tuple[RunRecord, str]:
    """A record and a label for it: a path (capture or bundle; ``BUNDLE@FIX`` picks a fix's run), a ``Bundle``
    (its bug path) or a record."""
    if isinstance(x, RunRecord):
        return x, ""
    if isinstance(x, (str, os.PathLike)):
        from workbench.postmortem import bundle

        path, _, fix = str(x).rpartition("@")
        if path and not Path(x).exists() and Path(path).exists():  # BUNDLE@FIX: one fix's run of a bundle
            return bundle.load(path).run(fix), fix
        b = bundle.load(x)
        label = Path(x).name.removesuffix(".wbundle") or str(x)
    else:
        b, label = x, ""
    rec = getattr(b, "bug", None) or (b.records[0] if getattr(b, "records", None) else None)
    if rec is None:
        raise BundleError(f"{x}: no run to compare")
    return rec, label


@dataclass
class RunDiff:
    """Where two runs part: ``str()`` is the sentence, ``view()`` the points x tensors figure."""

    a: RunRecord
    b: RunRecord
    labels: tuple[str, str]
    sentence: str
    cells: pd.DataFrame
    first: dict[str, Any] | None = None  # point, name, ranks, kind, detail of the first cell that parts the runs
    collective: dict[str, Any] | None = None  # the first collective that differs
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # versions, machine, world size
    given_dtype: tuple[str, str] | None = None  # the dtype the runs were given, where most tensors changed alike
    related: bool = True

    def __str__(self) -> str:
        return self.sentence

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.sentence)

    @property
    def same(self) -> bool:
        """Nothing parts the runs (bytes equal, or within rounding)."""
        return self.related and self.first is None and self.collective is None

    def view(self) -> Any:
        """Points x tensors, coloured by the first kind of difference, the first parting cell outlined."""
        from workbench.viz.diff import diff_figure

        return diff_figure(self.cells, first=self.first, labels=self.labels, title=self.sentence, kinds=KINDS)

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained page: the sentence, the figure, the cells that part the runs, what changed."""
        from workbench.postmortem.report import _Page

        page = _Page()
        page.h(1, f"{self.labels[0]} vs {self.labels[1]}")
        page.parts.append(f"<p class='diagnosis'>{html.escape(self.sentence)}</p>")
        if self.changed:
            page.h(2, "What differs between the runs' settings")
            page.table(pd.DataFrame([{"setting": k, self.labels[0]: _word(x), self.labels[1]: _word(y)}
                                     for k, (x, y) in self.changed.items()]))
        if self.related and len(self.cells):
            page.fig(self.view())
            parting = self.cells[self.cells["kind"].isin(CAUSES)]
            if len(parting):
                page.h(2, "Where they part")
                page.table(parting.drop(columns=["point_index"]), max_rows=80)
        text = page.render(f"workbench diff: {self.labels[0]} vs {self.labels[1]}")
        if path is not None:
            Path(path).write_text(text)
        return text


def diff(a: Any, b: Any, labels: tuple[str, str] | None = None) -> RunDiff:
    """Compare two runs (captures, bundles, records); ``labels``: what the sentence calls them."""
    ra, la = _load(a)
    rb, lb = _load(b)
    if labels is None:
        labels = (la, lb) if la and lb and la != lb else ("A", "B")
    return _Diff(ra, rb, labels).run()


# -- the walk ----------------------------------------------------------------------------------
class _Diff:
    def __init__(self, a: RunRecord, b: RunRecord, labels: tuple[str, str]):
        self.a, self.b, self.labels = a, b, labels
        self.wa, self.wb = int(a.manifest.get("ranks") or 0), int(b.manifest.get("ranks") or 0)
        self.same_world = self.wa == self.wb
        self.floor = closeness.floor_dtype(a.tensors, b.tensors, a.outputs, b.outputs)
        self.poison = bool(a.manifest.get("poison", True)) and bool(b.manifest.get("poison", True))
        self.worst: dict[str, Any] | None = None
        self.rows = self.bytes_differ = 0
        self.refs: set[int] = set()  # the smaller run's ranks that a rank only the larger run has was read against

    def run(self) -> RunDiff:
        A, B = self.labels
        pairs = self._points()
        changed = self._changed()
        if not pairs or not self._shared_tensors(pairs):
            sa, sb = ", ".join(self.a.steps) or "(none)", ", ".join(self.b.steps) or "(none)"
            what = "" if not pairs else " (no tensor of the same name at a point of the same name)"
            sentence = f"{A} and {B} share no points{what}: nothing to compare ({A}: {sa}; {B}: {sb})"
            return RunDiff(self.a, self.b, self.labels, sentence, pd.DataFrame(columns=CELL_COLUMNS),
                           changed=changed, related=False)
        self.given = self._given_dtype(pairs)
        self._split = _split_names(self.a) | _split_names(self.b)
        cells = []
        for i, (pa, pb) in enumerate(pairs):
            cells += self._point(i, pa, pb)
        cells_df = pd.DataFrame(cells, columns=CELL_COLUMNS)
        first = next((c for c in cells if c["kind"] in CAUSES), None)
        collective = self._collectives()
        failures = self._failures()
        sentence = self._sentence(pairs, cells, first, collective, failures, changed)
        return RunDiff(self.a, self.b, self.labels, sentence, cells_df, first=first, collective=collective,
                       changed=changed, given_dtype=self.given)

    # points ------------------------------------------------------------------------------
    def _points(self) -> list[tuple[str, str]]:
        sa, sb = self.a.steps, self.b.steps
        m = difflib.SequenceMatcher(a=sa, b=sb, autojunk=False)
        return [(sa[blk.a + k], sb[blk.b + k]) for blk in m.get_matching_blocks() for k in range(blk.size)]

    def _shared_tensors(self, pairs: list[tuple[str, str]]) -> bool:
        for pa, pb in pairs:
            na, nb = _names(self.a.tensors, pa), _names(self.b.tensors, pb)
            oa, ob = _names(self.a.outputs, pa), _names(self.b.outputs, pb)
            if (na & nb) or (oa & ob):
                return True
        return False

    # settings ----------------------------------------------------------------------------
    def _changed(self) -> dict[str, tuple[Any, Any]]:
        va, vb = self.a.manifest.get("versions") or {}, self.b.manifest.get("versions") or {}
        out: dict[str, tuple[Any, Any]] = {}
        for k in dict.fromkeys([*va, *vb]):
            recorded_by_both = (k in va and k in vb) or k in closeness_knobs()  # an unset knob is recorded as absent
            if va.get(k) != vb.get(k) and recorded_by_both:  # a key an older capture lacks (cpu) says nothing
                out[k] = (va.get(k), vb.get(k))
        for k in ("backend", "ranks"):
            if self.a.manifest.get(k) != self.b.manifest.get(k):
                out[k] = (self.a.manifest.get(k), self.b.manifest.get(k))
        return out

    def _given_dtype(self, pairs: list[tuple[str, str]]) -> tuple[str, str] | None:
        """The (A dtype, B dtype) most float rows went through, where it is most of them."""
        moved: Counter = Counter()
        floats = 0
        for pa, pb in pairs:
            for ta, tb in ((self.a.tensors, self.b.tensors), (self.a.outputs, self.b.outputs)):
                m = _merge(_at(ta, pa), _at(tb, pb), ["rank", "name"])
                if not len(m) or "dtype_a" not in m:
                    continue
                for x, y in zip(m["dtype_a"], m["dtype_b"]):
                    if str(x) in _SIZE and str(y) in _SIZE:
                        floats += 1
                        if x != y:
                            moved[(str(x), str(y))] += 1
        if not moved:
            return None
        (pair, n), = moved.most_common(1)
        return pair if n * 2 >= floats else None

    # one point ---------------------------------------------------------------------------
    def _point(self, i: int, pa: str, pb: str) -> list[dict[str, Any]]:
        out = []
        for table in ("tensors", "outputs"):
            self._table = table
            ta, tb = _at(getattr(self.a, table), pa), _at(getattr(self.b, table), pb)
            by_a = dict(tuple(ta.groupby("name", sort=False))) if len(ta) else {}
            by_b = dict(tuple(tb.groupby("name", sort=False))) if len(tb) else {}
            for name in dict.fromkeys([*by_a, *by_b]):
                self._expect = ""
                kind, ranks, detail = self._tensor(by_a.get(name, pd.DataFrame()), by_b.get(name, pd.DataFrame()))
                out.append({"point": pa if pa == pb else f"{pa} / {pb}", "point_index": i, "name": name,
                            "table": "output" if table == "outputs" else "tensor", "kind": kind,
                            "ranks": ranks, "detail": detail, "expect": self._expect})
        return out

    def _tensor(self, ga: pd.DataFrame, gb: pd.DataFrame) -> tuple[str, list[int], str]:
        A, B = self.labels
        if not len(ga) or not len(gb):
            side = A if len(ga) else B
            ranks = sorted(int(r) for r in (ga if len(ga) else gb)["rank"])
            return "only in one run", ranks, f"only {side} has it"
        if not self.same_world:
            return self._across_worlds(ga, gb)
        ra = {int(r["rank"]): r for r in ga.to_dict(orient="records")}
        rb = {int(r["rank"]): r for r in gb.to_dict(orient="records")}
        common = sorted(set(ra) & set(rb))
        if not common:
            return "not on both", sorted(set(ra) | set(rb)), "no rank holds it in both runs"
        found: dict[str, list[tuple[int, str]]] = {}
        for r in common:
            self._where = {"point": ra[r].get("step"), "rank": r, "name": ra[r].get("name")}
            kind, words = self._row(ra[r], rb[r])
            found.setdefault(kind, []).append((r, words))
        kind = min(found, key=KINDS.index)
        hits = found[kind]
        ranks = [r for r, _ in hits]
        words = Counter(w for _, w in hits).most_common(1)[0][0]
        return kind, ranks, words

    def _row(self, a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str]:
        """One rank's row of one tensor in both runs: (kind, words)."""
        A, B = self.labels
        da, db = str(a.get("dtype")), str(b.get("dtype"))
        given = False
        if da != db:
            if self.given is not None and (da, db) == self.given:
                given = True
            else:
                return "dtype", self._dtype_words(da, db)
        elif self.given is not None and da == self.given[0] and not _flag(a.get("is_meta")) and \
                not _flag(b.get("is_meta")) and self._table == "tensors":  # an output is often cast on purpose
            words = f"stays {dt(db)} in {B} where the run went {dt(self.given[0])} -> {dt(self.given[1])}"
            if str(a.get("name")) in self._split:  # and its ranks disagree on its dtype: the incident's shape
                return "dtype", words
            given = True  # kept in the wider dtype on every rank (from_pretrained keeps inv_freq fp32): said only
        if str(a.get("shape")) != str(b.get("shape")):
            return "shape", f"shape {a.get('shape')} in {A}, {b.get('shape')} in {B}"
        pa, pb = _placement(a), _placement(b)
        if pa and pb and pa != pb:
            return "placement", f"placed {pa} in {A}, {pb} in {B}"
        if _flag(a.get("is_meta")) != _flag(b.get("is_meta")):
            return "meta", (f"{'on meta' if _flag(a.get('is_meta')) else 'real'} in {A}, "
                            f"{'on meta' if _flag(b.get('is_meta')) else 'real'} in {B}")
        if _flag(a.get("is_meta")):
            return ("dtype as given" if given else "same"), ""
        wa, wb = closeness._written(a), closeness._written(b)
        if wa != wb:
            return "written", f"{wa or 'written'} in {A}, {wb or 'written'} in {B}"
        for key, say in (("nan", "NaN"), ("inf", "Inf"), ("poisoned", "poisoned")):
            x, y = closeness._num(a.get(key)) or 0, closeness._num(b.get(key)) or 0
            if x != y:
                return "NaN/Inf/poison", f"{int(x)} {say} in {A}, {int(y)} in {B}"
        self.rows += 1
        if given:
            return self._given_values(a, b)
        gap = closeness.compare(a, b, self.floor, self.poison)
        if gap.same_bytes:
            return "same", ""
        self.bytes_differ += 1
        if gap.garbage:
            return "same", "never written without poison: values not compared"
        if gap.story is not None:
            return "values", _values_words(a, b, gap, self.labels)
        self._worst(gap)
        return "within rounding", f"within rounding (|Δ| {gap.delta:.3g}, tolerance {gap.tol:.3g})"

    def _dtype_words(self, da: str, db: str) -> str:
        A, B = self.labels
        return f"{dt(da)} in {A}, {dt(db)} in {B}"

    def _given_values(self, a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str]:
        """Values of a tensor the given dtype changed: the kept summaries within the coarser dtype's rounding."""
        coarse = max((str(a.get("dtype")), str(b.get("dtype"))), key=lambda d: closeness.RTOL.get(d, 0.0))
        tol = (closeness.rtol(coarse, self.floor) or 0.0) * closeness._scale(a, b)
        delta = 0.0
        for key in ("min", "max", "mean"):
            x, y = closeness._num(a.get(key)), closeness._num(b.get(key))
            if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
                if (x is None) != (y is None) or (x is not None and y is not None and
                                                  math.isfinite(x) != math.isfinite(y)):
                    return "values", f"{key} {x} in {self.labels[0]}, {y} in {self.labels[1]}"
                continue
            delta = max(delta, abs(x - y))
        ha, hb = list(a.get("head") or []), list(b.get("head") or [])
        for x, y in zip(ha, hb):
            x, y = closeness._num(x), closeness._num(y)
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
                delta = max(delta, abs(x - y))
        if delta > tol:
            return "values", (f"values off by up to {delta:.3g} beyond the {dt(coarse)} rounding of the given "
                              f"dtype (tolerance {tol:.3g})")
        return "dtype as given", f"{dt(a.get('dtype'))} in {self.labels[0]}, {dt(b.get('dtype'))} in " \
                                 f"{self.labels[1]}, values within {dt(coarse)} rounding"

    # across world sizes ------------------------------------------------------------------------
    def _across_worlds(self, ga: pd.DataFrame, gb: pd.DataFrame) -> tuple[str, list[int], str]:
        """One tensor at two world sizes, every rank of both read: what the runs say it must be decides how."""
        how = self._expect = _expectation(ga, gb)
        if how == "sharded":
            return self._sharded_replicas(ga, gb)
        pairs, extra = self._pairs(ga, gb, replicated=how == "replicated")
        if how == "replicated":
            return self._verdict([(r, *self._row(a, b)) for r, a, b in pairs], extra)
        return self._own(ga, gb, pairs, extra)

    def _pairs(self, ga: pd.DataFrame, gb: pd.DataFrame, replicated: bool) \
            -> tuple[list[tuple[int, dict[str, Any], dict[str, Any]]], list[int]]:
        """(rank, A's row, B's row) for every rank either run holds the tensor on: a rank both hold pairs with
        itself, a rank only one run has with the other run's row of the lowest rank it must agree with (else
        that run's lowest rank). Returns the pairs and the ranks only one run has."""
        ra = {int(r["rank"]): r for r in ga.to_dict(orient="records")}
        rb = {int(r["rank"]): r for r in gb.to_dict(orient="records")}
        pairs, extra = [], []
        for r in sorted(set(ra) | set(rb)):
            if r in ra and r in rb:
                pairs.append((r, ra[r], rb[r]))
                continue
            extra.append(r)
            mine, other = (ra, rb) if r in ra else (rb, ra)
            at = _reference(mine[r], other, replicated)
            self.refs.add(at)
            ref = other[at]
            self._where = {"point": mine[r].get("step"), "rank": r, "name": mine[r].get("name")}
            pairs.append((r, mine[r], ref) if r in ra else (r, ref, mine[r]))
        return pairs, extra

    def _verdict(self, found: list[tuple[int, str, str]], extra: list[int]) -> tuple[str, list[int], str]:
        """The first kind among the ranks' verdicts, its ranks and its most common words; ranks only one run has
        said as read against the other's value."""
        kind = min((k for _, k, _ in found), key=KINDS.index)
        ranks = [r for r, k, _ in found if k == kind]
        words = Counter(w for _, k, w in found if k == kind).most_common(1)[0][0]
        return kind, ranks, words

    def _own(self, ga: pd.DataFrame, gb: pd.DataFrame, pairs: list[tuple[int, dict[str, Any], dict[str, Any]]],
             extra: list[int]) -> tuple[str, list[int], str]:
        """Each rank's own (a per-rank batch's output, an expert): what any rank's row must be (dtype, real,
        written, free of NaN/Inf/poison) is checked on every rank; the values are said as summaries, not compared."""
        found = [(r, *self._own_row(a, b)) for r, a, b in pairs]
        kind, ranks, words = self._verdict(found, extra)
        if kind == "each rank's own":
            words = "each rank's own, not expected to agree: " + _own_summary(ga, gb, self.labels)
        return kind, ranks, words

    def _own_row(self, a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str]:
        A, B = self.labels
        da, db = str(a.get("dtype")), str(b.get("dtype"))
        if da != db and not (self.given is not None and (da, db) == self.given):
            return "dtype", self._dtype_words(da, db)
        if _flag(a.get("is_meta")) != _flag(b.get("is_meta")):
            return "meta", (f"{'on meta' if _flag(a.get('is_meta')) else 'real'} in {A}, "
                            f"{'on meta' if _flag(b.get('is_meta')) else 'real'} in {B}")
        if _flag(a.get("is_meta")):
            return "same", ""
        wa, wb = closeness._written(a), closeness._written(b)
        if wa != wb:
            return "written", f"{wa or 'written'} in {A}, {wb or 'written'} in {B}"
        for key, say in (("nan", "NaN"), ("inf", "Inf"), ("poisoned", "poisoned")):
            x, y = closeness._num(a.get(key)) or 0, closeness._num(b.get(key)) or 0
            if bool(x) != bool(y):  # counts follow each rank's data; having any does not
                return "NaN/Inf/poison", f"{int(x)} {say} in {A}, {int(y)} in {B}"
        if str(a.get("fingerprint")) == str(b.get("fingerprint")) and str(a.get("shape")) == str(b.get("shape")):
            return "same", ""
        return "each rank's own", ""

    def _sharded_replicas(self, ga: pd.DataFrame, gb: pd.DataFrame) -> tuple[str, list[int], str]:
        """A sharded tensor: each replica's shards added up (HSDP holds several), each of one run's replicas
        against the other run's first."""
        reps_a, reps_b = _replicas(ga), _replicas(gb)
        pad = max(self.wa, self.wb) if _flat(ga) or _flat(gb) else 0
        verdicts = [self._combined(reps_a[0], g, pad) for g in reps_b] + \
            [self._combined(g, reps_b[0], pad) for g in reps_a[1:]]
        kind = min((v[0] for v in verdicts), key=KINDS.index)
        hits = [v for v in verdicts if v[0] == kind]
        ranks = sorted({r for v in hits for r in v[1]})
        return kind, ranks, hits[0][2]

    def _combined(self, ga: pd.DataFrame, gb: pd.DataFrame, pad: int = 0) -> tuple[str, list[int], str]:
        """A sharded tensor at two world sizes: its summaries added up across shards. ``pad``: FSDP1's flat
        parameter, padded (with zeros) to a multiple of the world size: element counts that differ by less are
        the padding, and the zeros add nothing to the sums."""
        A, B = self.labels
        ca, cb = _combine(ga), _combine(gb)
        ranks = sorted(set(int(r) for r in ga["rank"]) | set(int(r) for r in gb["rank"]))
        if ca["dtype"] != cb["dtype"]:
            if self.given is not None and (ca["dtype"], cb["dtype"]) == self.given:
                return "dtype as given", ranks, self._dtype_words(ca["dtype"], cb["dtype"])
            return "dtype", ranks, self._dtype_words(ca["dtype"], cb["dtype"])
        shape_a, shape_b = ca["global_shape"] or f"{ca['numel']} elements", cb["global_shape"] or \
            f"{cb['numel']} elements"
        slack = max(pad - 1, 0)  # a flat parameter's padding: fewer elements than the world size
        if (ca["global_shape"] and cb["global_shape"] and ca["global_shape"] != cb["global_shape"]) or \
                abs(ca["numel"] - cb["numel"]) > slack:
            return "shape", ranks, f"whole shape {shape_a} in {A}, {shape_b} in {B}"
        if ca["placement"] and cb["placement"] and ca["placement"] != cb["placement"]:
            return "placement", ranks, f"placed {ca['placement']} in {A}, {cb['placement']} in {B}"
        if ca["meta"] != cb["meta"]:
            return "meta", ranks, f"{'on meta' if ca['meta'] else 'real'} in {A}, " \
                                  f"{'on meta' if cb['meta'] else 'real'} in {B}"
        if ca["meta"]:
            return "same", ranks, ""
        if ca["written"] != cb["written"]:
            return "written", ranks, f"{ca['written'] or 'written'} in {A}, {cb['written'] or 'written'} in {B}"
        for key, say in (("nan", "NaN"), ("inf", "Inf"), ("poisoned", "poisoned")):
            if ca[key] != cb[key]:
                return "NaN/Inf/poison", ranks, f"{ca[key]} {say} in {A}, {cb[key]} in {B}"
        if ca["written"] in closeness.GARBAGE and not self.poison:
            return "same", ranks, "never written without poison: values not compared"
        self.rows += 1
        tol_r = closeness.rtol(ca["dtype"], self.floor)
        if tol_r is None:
            tol_r = 0.0
        scale = max(abs(v) for v in (ca["min"], ca["max"], cb["min"], cb["max"], 0.0) if math.isfinite(v))
        checks = [("min", ca["min"], cb["min"], tol_r * scale), ("max", ca["max"], cb["max"], tol_r * scale)]
        if ca["sumsq"] is not None and cb["sumsq"] is not None:
            q = max(ca["sumsq"], cb["sumsq"])
            checks.append(("sum of squares", ca["sumsq"], cb["sumsq"], 2 * tol_r * q))
            checks.append(("sum", ca["sum"], cb["sum"], tol_r * math.sqrt(ca["numel"] * q)))
        else:
            checks.append(("sum", ca["sum"], cb["sum"], tol_r * ca["numel"] * scale))
        exact = all(x == y for _, x, y, _ in checks)
        for what, x, y, tol in checks:
            if not (math.isfinite(x) and math.isfinite(y)):
                if (x == x) != (y == y):
                    return "values", ranks, f"{what} {x:.6g} in {A}, {y:.6g} in {B}"
                continue
            if abs(x - y) > tol:
                return "values", ranks, f"{what} {x:.6g} in {A}, {y:.6g} in {B} " \
                                        f"(|Δ| {abs(x - y):.3g}, tolerance {tol:.3g})"
        if exact:
            return "same", ranks, "the same summaries across shards"
        self.bytes_differ += 1
        return "within rounding", ranks, "within rounding across shards"

    def _worst(self, gap: closeness.Gap) -> None:
        ratio = gap.delta / gap.tol if gap.tol else 0.0
        if self.worst is None or ratio > self.worst["ratio"]:
            self.worst = {"delta": gap.delta, "tol": gap.tol, "ratio": ratio, **getattr(self, "_where", {})}

    # collectives -------------------------------------------------------------------------
    def _collectives(self) -> dict[str, Any] | None:
        la, lb = self.a.ledger, self.b.ledger
        if la is None or lb is None or not len(la) or not len(lb):
            return None
        order = {s: i for i, s in enumerate(self.a.steps)}
        order_b = {s: i for i, s in enumerate(self.b.steps)}
        found: list[dict[str, Any]] = []
        ranks_a, ranks_b = set(la["rank"].dropna().astype(int)), set(lb["rank"].dropna().astype(int))
        for r in sorted(ranks_a & ranks_b):
            ca, cb = _calls(la, r, order), _calls(lb, r, order_b)
            k = self._parting(ca, cb)
            if k is not None:
                found.append({"rank": r, "index": k, "a": _nth(ca, k), "b": _nth(cb, k)})
        found += self._lone_calls(la, lb, ranks_a, ranks_b, order, order_b)
        if not found:
            return None
        k = min(f["index"] for f in found)
        first = [f for f in found if f["index"] == k]
        return {"index": k, "ranks": [f["rank"] for f in first], "calls": first}

    def _parting(self, ca: list[dict[str, Any]], cb: list[dict[str, Any]]) -> int | None:
        """The index of the first call that differs between two ranks' sequences, None where none does."""
        for k in range(max(len(ca), len(cb))):
            x, y = _nth(ca, k), _nth(cb, k)
            if x is None or y is None or not self._same_call(x, y):
                return k
        return None

    def _lone_calls(self, la: pd.DataFrame, lb: pd.DataFrame, ranks_a: set[int], ranks_b: set[int],
                    order: dict[str, int], order_b: dict[str, int]) -> list[dict[str, Any]]:
        """A rank only one run has: its calls against the other run's ranks. It matches where any of them issued
        the same sequence (the roles the smaller run has); else it parts where it parts from the closest one."""
        out = []
        for r in sorted(ranks_a ^ ranks_b):
            mine_a = r in ranks_a
            mine = _calls(la if mine_a else lb, r, order if mine_a else order_b)
            best: tuple[int, int] | None = None  # (index where it parts, the other run's rank)
            for o in sorted(ranks_b if mine_a else ranks_a):
                other = _calls(lb if mine_a else la, o, order_b if mine_a else order)
                k = self._parting(mine, other) if mine_a else self._parting(other, mine)
                if k is None:
                    best = None
                    break
                if best is None or k > best[0]:
                    best = (k, o)
            if best is None:
                continue
            k, o = best
            other = _calls(lb if mine_a else la, o, order_b if mine_a else order)
            x, y = (_nth(mine, k), _nth(other, k)) if mine_a else (_nth(other, k), _nth(mine, k))
            out.append({"rank": r, "index": k, "a": x, "b": y, "against": o})
        return out

    def _same_call(self, x: dict[str, Any], y: dict[str, Any]) -> bool:
        if x["op"] != y["op"]:
            return False
        dx, dy = x["dtypes"], y["dtypes"]
        ratio = 1.0
        if dx != dy:
            if self.given is None or dx != self.given[0] or dy != self.given[1]:
                return False
            ratio = _SIZE[self.given[1]] / _SIZE[self.given[0]]
        if not self.same_world:
            return True  # the sizes follow the shards
        if x["tensors"] != y["tensors"]:
            return False
        return x["bytes"] is None or y["bytes"] is None or abs(x["bytes"] * ratio - y["bytes"]) < 0.5

    def _failures(self) -> list[str]:
        A, B = self.labels
        fa, fb = _failed(self.a), _failed(self.b)
        out = []
        for (step, rank), err in sorted({**fa, **fb}.items(), key=lambda kv: (kv[0][1], str(kv[0][0]))):
            if (step, rank) in fa and (step, rank) in fb:
                continue
            side = A if (step, rank) in fa else B
            out.append(f"rank {rank} raised {err} at `{step}` in {side} only")
        return out

    # the sentence ------------------------------------------------------------------------
    def _sentence(self, pairs, cells, first, collective, failures, changed) -> str:
        A, B = self.labels
        parts: list[str] = []
        setting = []
        for k, (x, y) in changed.items():
            if k == "ranks":
                setting.append(f"{A} ran on {x} ranks, {B} on {y} ({self._world_words()})")
            else:
                setting.append(f"{k} {_word(x)} in {A}, {_word(y)} in {B}")
        if setting:
            knobs = [k for k in changed if k in closeness_knobs() or k == "cpu"]
            lead = "the runs' settings differ: " if not knobs else "another machine or kernels: "
            parts.append(lead + "; ".join(setting))
        if self.given is not None:
            parts.append(f"{A} computes in {dt(self.given[0])}, {B} in {dt(self.given[1])} (the dtype the runs "
                         "were given: said, not a cause)")
        if first is None and collective is None and not failures:
            if self.bytes_differ:
                w = self.worst
                worst = ""
                if w:
                    at = f" at `{w['point']}`, rank {w['rank']}, `{_short(str(w['name']), self._every())}`" \
                        if w.get("name") else ""
                    worst = f"; max |Δ| {w['delta']:.3g} ({100 * w['ratio']:.2g}% of its tolerance){at}"
                parts.append(f"the same within rounding at every point ({self.bytes_differ} of {self.rows} rows "
                             f"differ in their bytes, none beyond rounding{worst})")
            else:
                parts.append("the same bytes at every point")
            own = [c for c in cells if c["kind"] == "each rank's own"]
            if own:
                what = "output" if all(c["table"] == "output" for c in own) else "tensor"
                n = len({(c["name"], c["table"]) for c in own})
                parts[-1] += (f" ({n} {what}{'s' if n > 1 else ''} {'are' if n > 1 else 'is'} each rank's own and "
                              f"differ{'' if n > 1 else 's'} (summaries said, not compared))")
            if any(k in closeness_knobs() or k == "cpu" for k in changed):
                kernels = ", ".join(f"{k}={_word(changed[k][1])}" for k in changed if k in closeness_knobs())
                if kernels:
                    parts.append(f"the kernels changed ({kernels} in {B}) and moved only the last bits")
            return "; ".join(parts)
        if first is not None:
            idx = first["point_index"]
            if idx == 0:
                parts.append(f"the runs part at the first point, `{first['point']}`")
            else:
                parts.append(f"the runs agree through `{pairs[idx - 1][0]}`")
            parts.append(self._first_words(first, cells))
        else:
            parts.append("every tensor agrees at every shared point" +
                         (" within rounding" if self.bytes_differ else ""))
        if collective is not None:
            parts.append(self._collective_words(collective))
        elif self.a.ledger is not None and len(self.a.ledger) and len(self.b.ledger):
            parts.append("every collective matches" + ("" if self.same_world else " in op and dtype (sizes "
                                                                                  "follow the shards)"))
        parts += failures[:2]
        return "; ".join(parts)

    def _world_words(self) -> str:
        """How runs of two world sizes were read: every rank of the larger one, none skipped."""
        small, large = self._small_large()
        lo, hi = sorted((self.wa, self.wb))
        extra = _ranks_list(list(range(lo, hi))) if hi > lo else ""
        lead = f"{extra} {'are' if hi - lo > 1 else 'is'} only in {large}: " if extra and lo else ""
        return (f"{lead}replicated tensors read on every rank against {small}'s value, sharded ones through their "
                "summaries across shards, each rank's own through summaries")

    def _first_words(self, first: dict[str, Any], cells: list[dict[str, Any]]) -> str:
        same = [c for c in cells if c["point_index"] == first["point_index"] and c["kind"] == first["kind"]
                and c["ranks"] == first["ranks"] and c["table"] == first["table"]]
        names = [c["name"] for c in same]
        every = self._every()
        shown = ", ".join(f"`{_short(n, every)}`" for n in names[:3]) + (f" and {len(names) - 3} more"
                                                                         if len(names) > 3 else "")
        what = "output " if first["table"] == "output" else ""
        out = f"at `{first['point']}` {what}{shown}: {first['detail']} {_ranks_words(first, self)}"
        lone = [r for r in first["ranks"] if r >= min(self.wa, self.wb)]
        if not self.same_world and lone and first.get("expect") != "sharded":
            small, large = self._small_large()
            refs = ",".join(str(r) for r in sorted(self.refs)) or "0"
            out += (f" ({_ranks_list(lone)} {'are' if len(lone) > 1 else 'is'} only in {large}: read against "
                    f"{small}'s rank{'s' if len(self.refs) > 1 else ''} {refs})")
        later = self._rank_split(first)
        return out + (f" ({later})" if later else "")

    def _small_large(self) -> tuple[str, str]:
        A, B = self.labels
        return (A, B) if self.wa < self.wb else (B, A)

    def _every(self) -> list[str]:
        return list(dict.fromkeys([*self.a.tensors.get("name", []), *self.b.tensors.get("name", [])]))

    def _rank_split(self, first: dict[str, Any]) -> str:
        """Where the first tensor's dtype splits across the ranks of one run (the incident's shape)."""
        name = first["name"]
        for rec, label in ((self.b, self.labels[1]), (self.a, self.labels[0])):
            t = rec.tensors
            if t is None or not len(t):
                continue
            g = t[t["name"] == name]
            for step in rec.steps:
                s = g[g["step"] == step]
                if s["dtype"].nunique() > 1:
                    per = "; ".join(f"{dt(d)} on {_ranks_list(sorted(int(r) for r in ss['rank']))}"
                                    for d, ss in s.groupby("dtype", sort=False))
                    return f"in {label} from `{step}` the ranks disagree on its dtype: {per}"
        return ""

    def _collective_words(self, c: dict[str, Any]) -> str:
        A, B = self.labels
        call = next((x for f in c["calls"] for x in (f["a"], f["b"]) if x is not None), None)
        head = f"the first collective that differs is {call['op']} #{c['index'] + 1}" if call else \
            "the collective sequences differ"
        if call is not None and call.get("step"):
            head += f" at `{call['step']}`"
        groups: dict[tuple[str, str], list[int]] = {}
        for f in c["calls"]:
            groups.setdefault((_call_words(f["a"], self.same_world), _call_words(f["b"], self.same_world)),
                              []).append(f["rank"])
        said = "; ".join(f"{_ranks_list(rs)}: {x} in {A} vs {y} in {B}" for (x, y), rs in groups.items())
        lone = sorted({(f["rank"], f["against"]) for f in c["calls"] if "against" in f})
        alike = len(groups) == 1 and len(c["calls"]) > 1 and len(c["calls"]) == min(self.wa, self.wb) and not lone
        if lone:
            small, large = self._small_large()
            against = sorted({o for _, o in lone})
            said += (f"; {_ranks_list([r for r, _ in lone])} only in {large}: no rank of {small} issued their calls, "
                     f"read against the closest, {small}'s {_ranks_list(against)}")
        return f"{head} ({said}" + ("; every rank alike within each run, so the calls still pair)" if alike else ")")


# -- helpers ----------------------------------------------------------------------------------
def closeness_knobs() -> tuple[str, ...]:
    from workbench.rank.columns import KERNEL_KNOBS

    return KERNEL_KNOBS


def _word(v: Any) -> str:
    return "unset" if v is None else str(v)


def _flag(v: Any) -> bool:
    return closeness._flag(v) and v is not pd.NA


def _at(df: pd.DataFrame | None, step: str) -> pd.DataFrame:
    if df is None or not len(df) or "step" not in df:
        return pd.DataFrame()
    return df[df["step"] == step]


def _names(df: pd.DataFrame | None, step: str) -> set[str]:
    t = _at(df, step)
    return set(t["name"]) if len(t) and "name" in t else set()


def _merge(ta: pd.DataFrame, tb: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    if not len(ta) or not len(tb) or any(k not in ta or k not in tb for k in key):
        return pd.DataFrame()
    m = ta.merge(tb, on=key, how="inner", suffixes=("_a", "_b"))
    if "is_meta_a" in m:
        m = m[~(m["is_meta_a"].map(_flag) & m["is_meta_b"].map(_flag))]  # meta on both: nothing computed yet
    return m


def _sharded(g: pd.DataFrame) -> bool:
    if "placement" in g and g["placement"].notna().any():
        return True
    return "sharded" in g and bool(g["sharded"].map(lambda v: v is True or v == 1.0).any())


def _placement(row: dict[str, Any]) -> str:
    p = row.get("placement")
    if not isinstance(p, str) or not p:
        return ""
    return p.split(" on mesh ")[0]  # the mesh's size follows the world size; the placements are the layout


def _agree_known(g: pd.DataFrame) -> bool:
    return "agree" in g and bool(g["agree"].map(lambda v: isinstance(v, str)).any())


def _expectation(ga: pd.DataFrame, gb: pd.DataFrame) -> str:
    """What the runs say one tensor must be across ranks: ``sharded`` (a DTensor with a ``Shard`` placement, an
    FSDP1 flat parameter's shard), ``replicated`` (ranks it must agree across: a wrapper, a collective, a
    declaration, a ``Replicate`` placement), or ``own`` (each rank's). Rows recorded before the ``agree`` columns
    keep the old reading: ``sharded`` rows (DTensors, ``ctx.local``) add up, the rest are replicas."""
    both = pd.concat([ga, gb], ignore_index=True)
    places = [p for p in both.get("placement", pd.Series(dtype=object)) if isinstance(p, str) and p]
    if not _agree_known(both):
        return "sharded" if _sharded(ga) or _sharded(gb) else "replicated"
    if any("S(" in p.split(" on mesh ")[0] for p in places) or \
            both["agree_by"].map(lambda v: isinstance(v, str) and "flat parameter's shard" in v).any():
        return "sharded"
    if both["agree"].map(lambda v: isinstance(v, str) and "," in v).any():
        return "replicated"
    return "own"


def _reference(row: dict[str, Any], other: dict[int, dict[str, Any]], replicated: bool) -> int:
    """The rank of the other run a rank it lacks is read against: for a replica, the lowest rank of the other run
    among those it must agree with; else (or where none is there) the other run's lowest rank."""
    if replicated and isinstance(row.get("agree"), str) and row["agree"]:
        mates = sorted(int(r) for r in row["agree"].split(",") if r.strip().isdigit() and int(r) in other)
        if mates:
            return mates[0]
    return min(other)


def _flat(g: pd.DataFrame) -> bool:
    return "agree_by" in g and bool(g["agree_by"].map(lambda v: isinstance(v, str) and "flat parameter" in v).any())


def _replicas(g: pd.DataFrame) -> list[pd.DataFrame]:
    """A sharded tensor's rows by replica (HSDP's ``replica`` coordinate), each a whole tensor's shards."""
    if "replica" not in g or not g["replica"].map(lambda v: isinstance(v, str) and v != "").any():
        return [g]
    return [x for _, x in g.groupby(g["replica"].map(lambda v: v if isinstance(v, str) else ""), sort=True)]


def _own_summary(ga: pd.DataFrame, gb: pd.DataFrame, labels: tuple[str, str]) -> str:
    """Each rank's own tensor's summaries in both runs: the mean over the ranks' finite values, min and max."""
    said = []
    for g, label in ((ga, labels[0]), (gb, labels[1])):
        c = _combine(g)
        n = g["rank"].nunique()
        fin = c["numel"] - c["nan"] - c["inf"]
        mean = c["sum"] / fin if fin and math.isfinite(c["sum"]) else math.nan
        said.append(f"mean {mean:.4g}, min {c['min']:.4g}, max {c['max']:.4g} over {n} rank{'s' if n != 1 else ''} "
                    f"in {label}")
    return "; ".join(said)


def _combine(g: pd.DataFrame) -> dict[str, Any]:
    """One tensor's shards (rows of every rank) as one summary: counts and sums add, min/max fold."""
    rows = g.to_dict(orient="records")
    real = [r for r in rows if not _flag(r.get("is_meta")) and r.get("fingerprint") not in ("meta", "empty")]
    num = closeness._num

    def total(key: str) -> int:
        return int(sum(num(r.get(key)) or 0 for r in real if num(r.get(key)) == num(r.get(key))))

    sums, sumsq = 0.0, 0.0
    have_sq = True
    for r in real:
        n = (num(r.get("numel")) or 0) - (num(r.get("nan")) or 0) - (num(r.get("inf")) or 0)
        m = num(r.get("mean"))
        if m is not None and m == m and n > 0:
            sums += m * n
        q = num(r.get("sumsq"))
        if q is None or q != q:
            have_sq = False
        else:
            sumsq += q
    fin = [v for r in real for v in (num(r.get("min")), num(r.get("max"))) if v is not None and math.isfinite(v)]
    mins = [num(r.get("min")) for r in real if num(r.get("min")) is not None and math.isfinite(num(r.get("min")))]
    maxs = [num(r.get("max")) for r in real if num(r.get("max")) is not None and math.isfinite(num(r.get("max")))]
    written = sorted({w for r in rows if (w := closeness._written(r))})
    shapes = [r.get("global_shape") for r in rows if isinstance(r.get("global_shape"), str)]
    dtypes = sorted({str(r.get("dtype")) for r in rows})
    return {"dtype": dtypes[0] if len(dtypes) == 1 else ",".join(dtypes),
            "meta": all(_flag(r.get("is_meta")) for r in rows), "numel": int(sum(num(r.get("numel")) or 0
                                                                                for r in rows)),
            "nan": total("nan"), "inf": total("inf"), "poisoned": total("poisoned"),
            "min": min(mins) if mins else math.nan, "max": max(maxs) if maxs else math.nan,
            "sum": sums if fin or real else math.nan, "sumsq": sumsq if have_sq and real else None,
            "written": written[0] if written else None, "global_shape": shapes[0] if shapes else None,
            "placement": _placement({"placement": next((r.get("placement") for r in rows
                                                        if isinstance(r.get("placement"), str)), None)})}


def _calls(ledger: pd.DataFrame, rank: int, order: dict[str, int]) -> list[dict[str, Any]]:
    g = ledger[ledger["rank"] == rank]
    g = g.assign(_o=[order.get(str(s), len(order)) for s in g["step"]]).sort_values(["_o", "group", "seq"],
                                                                                   kind="stable")
    out = []
    for r in g.to_dict(orient="records"):
        b = closeness._num(r.get("bytes"))
        n = closeness._num(r.get("bucket_tensors"))
        out.append({"op": str(r.get("op")), "dtypes": str(r.get("dtypes")), "bytes": None if b is None or b != b
                    else int(b), "tensors": None if n is None or n != n else int(n), "step": str(r.get("step")),
                    "state": str(r.get("state"))})
    return out


def _nth(calls: list[dict[str, Any]], k: int) -> dict[str, Any] | None:
    return calls[k] if k < len(calls) else None


def _call_words(c: dict[str, Any] | None, sizes: bool) -> str:
    if c is None:
        return "no call"
    out = dt(c["dtypes"]) if "," not in c["dtypes"] else c["dtypes"]
    if sizes:
        if c["tensors"] is not None:
            out += f" bucket of {c['tensors']} tensor{'s' if c['tensors'] != 1 else ''}"
        if c["bytes"] is not None:
            out += f", {c['bytes']} B"
    return out


def _failed(rec: RunRecord) -> dict[tuple[str, int], str]:
    e = rec.events
    if e is None or not len(e):
        return {}
    return {(str(r["step"]), int(r["rank"])): str(r.get("error") or r.get("kind"))
            for r in e.to_dict(orient="records")}


def _short(name: str, among: list[str]) -> str:
    from workbench.analysis.diagnosis_words import short

    return short(name, among)


def _ranks_list(ranks: list[int]) -> str:
    from workbench.analysis.rankgroups import ranks_words

    return ranks_words(ranks)


def _ranks_words(cell: dict[str, Any], d: _Diff) -> str:
    ranks = cell["ranks"]
    world = max(d.wa, d.wb)
    if not d.same_world and len(ranks) == world:
        return "across the shards of every rank" if cell.get("expect") == "sharded" else "on every rank"
    if len(ranks) == min(d.wa, d.wb) and d.same_world and len(ranks) > 1:
        return "on every rank"
    return "on " + _ranks_list(ranks)


def _split_names(rec: RunRecord) -> set[str]:
    """Tensors whose dtype differs across the ranks of ``rec`` at some point."""
    t = rec.tensors
    if t is None or not len(t) or "dtype" not in t:
        return set()
    n = t.groupby(["step", "name"], sort=False)["dtype"].nunique()
    return {name for (_, name), k in n.items() if k > 1}


def _values_words(a: dict[str, Any], b: dict[str, Any], gap: closeness.Gap, labels: tuple[str, str]) -> str:
    """The rerun's words for a gap beyond rounding, said of two runs, with the first values of each."""
    A, B = labels
    story = str(gap.story).replace(" then, ", f" in {A}, ").replace(" then", f" in {A}")
    story = story[: -len(" now")] + f" in {B}" if story.endswith(" now") else story
    ha, hb = list(a.get("head") or [])[:3], list(b.get("head") or [])[:3]
    if ha and hb:
        story += f" (first values {_fmt(ha)} in {A}, {_fmt(hb)} in {B})"
    return story


def _fmt(values: list[Any]) -> str:
    return "[" + ", ".join("nan" if v is None else f"{float(v):.4g}" for v in values) + ", ...]"
