"""Plotly figures as pure functions of frame tables (live session or loaded bundle alike)."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.analysis import rankgroups
from workbench.analysis.findings import STATUSES
from workbench.analysis.frames import fmt, last_step, short, shorten

COLORS = {
    "ok": "#2ca02c", "sharded": "#98df8a", "apart": "#aec7e8", "meta": "#c7c7c7", "differs": "#ff7f0e",
    "dtype": "#9467bd",
    "reference": "#bcbd22", "inf": "#e377c2", "nan": "#d62728", "poison": "#8c0000", "missing": "#7f7f7f",
}


def legend_entries(statuses: list[str], show: bool = True) -> list[go.Scatter]:
    """One legend swatch per status present: a categorical legend instead of a colour bar."""
    return [go.Scatter(x=[None], y=[None], mode="markers", name=st, showlegend=show, legendgroup=st,
                       marker={"symbol": "square", "size": 12, "color": COLORS[st]}, hoverinfo="skip")
            for st in STATUSES if st in statuses]


ROW_PX_MIN, ROW_PX_MAX = 26, 56


def status_height(rows: int, names: list[str]) -> tuple[int, int]:
    """(figure height, bottom margin): rows stay readable at any rank count, tick labels fit below."""
    labels = shorten(names).values() if names else [""]
    bottom = int(40 + 5.2 * max(len(x) for x in labels) * 0.87)  # labels at -60 degrees, ~5.2 px a character
    row_px = max(ROW_PX_MIN, min(ROW_PX_MAX, 240 // max(rows, 1)))
    return 90 + bottom + row_px * rows, bottom


def discrete_scale(order: list[str], colors: dict[str, str]) -> list[list]:
    """A step colour scale: one flat band per category, so heatmap codes 0..n-1 read as swatches."""
    n = len(order)
    scale = []
    for i, s in enumerate(order):
        scale += [[i / n, colors[s]], [(i + 1) / n, colors[s]]]
    return scale


def _discrete_scale() -> list[list]:
    return discrete_scale(STATUSES, COLORS)


GROUP_ABOVE = 4  # more ranks than this: identical ranks share one row (``group=None``)
MAX_ROWS = 16  # rank rows at most in one heatmap; past it ranks are summarised
MAX_LINES = 8  # distinct lines per panel in buffer_values; past it the rest share one grey trace


def _grouping(n_ranks: int, group: bool | None) -> bool:
    return n_ranks > GROUP_ABOVE if group is None else bool(group)


def _rank_rows(tensors: pd.DataFrame, group: bool | None, max_rows: int | None,
               merged: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(groups, cells): one group per rank, or ranks folded by :mod:`workbench.analysis.rankgroups`.

    On a run with a device mesh of two or more dimensions the rows follow the mesh: ordered by coordinate (the
    replicas of a shard side by side) and a rank's row labelled with it (``replicate 0 · shard 1 (rank 1)``);
    its ranks are folded only past ``max_rows`` (``group=None``), or when asked (``group=True``)."""
    merged = rankgroups.with_status(tensors) if merged is None else merged
    ranks = sorted({int(r) for r in merged["rank"]})
    coords = rankgroups.mesh_coords(merged)
    fold = _grouping(len(ranks), group) if not coords or group is not None else \
        max_rows is not None and len(ranks) > max_rows
    if fold:
        groups = rankgroups.group_identical_ranks(tensors, max_rows=max_rows, merged=merged)
    else:
        groups = pd.DataFrame([{"group": i, "label": f"rank {r}", "ranks": [r], "first": r, "size": 1,
                                "how": "identical"} for i, r in enumerate(ranks)], columns=rankgroups.GROUP_COLUMNS)
    if coords:
        groups = groups.assign(label=[f"{rankgroups.coord_label(coords[int(f)])} (rank {int(f)})" if n == 1 else lab
                                      for f, n, lab in zip(groups["first"], groups["size"], groups["label"])])
        groups = groups.iloc[sorted(range(len(groups)), key=lambda i: tuple(
            c for _, c in coords[int(groups["first"].iloc[i])]))].reset_index(drop=True)
    return groups, rankgroups.group_cells(merged, groups)


def _status_heatmap(tensors: pd.DataFrame, showscale: bool = True, group: bool | None = None,
                    max_rows: int | None = MAX_ROWS) -> go.Heatmap:
    merged = rankgroups.with_status(tensors)
    groups, cells = _rank_rows(tensors, group, max_rows, merged)
    parted = rankgroups.replica_parting(merged)  # a tensor whose replicas hold different bytes: which one parted
    names = list(dict.fromkeys(tensors["name"]))
    code = {s: i for i, s in enumerate(STATUSES)}
    at = {(int(c.group), c.name): c for c in cells.itertuples(index=False)}
    z, text, seen = [], [], set()
    for gid, label, how in zip(groups["group"], groups["label"], groups["how"]):
        zrow, trow = [], []
        for n in names:
            c = at.get((int(gid), n))
            if c is None:
                zrow.append(code["missing"] + 0.5)
                seen.add("missing")
                trow.append(f"{label}<br>{n}<br>missing")
                continue
            zrow.append(code[c.status] + 0.5)
            seen.add(c.status)
            head = ", ".join(fmt(v) for v in list(c.head if c.head is not None else [])[:4])
            extra = "" if how == "identical" else f"<br>{c.contents} distinct content(s)"
            extra += f"<br>{parted[n]}" if n in parted else ""
            trow.append(f"{label}<br>{n}<br>{c.status}: {c.detail}<br>{c.dtype} {c.shape} {c.kind}<br>"
                        f"head [{head}]{extra}")
        z.append(zrow)
        text.append(trow)
    n = len(STATUSES)
    labels = shorten(names)
    return go.Heatmap(
        z=z, x=[labels[x] for x in names], y=list(groups["label"]), text=text, hoverinfo="text",
        colorscale=_discrete_scale(), zmin=0, zmax=n, showscale=False, xgap=1, ygap=2,
        meta={"statuses": sorted(seen)},  # for the legend: one swatch per status drawn
    )


def status_matrix(tensors: pd.DataFrame, title: str = "What every rank holds", *, group: bool | None = None,
                  max_rows: int | None = MAX_ROWS) -> go.Figure:
    """Rank x tensor: ok / meta / dtype / differs from rank 0 / NaN / never written.

    Past ``GROUP_ABOVE`` ranks (or with ``group=True``) ranks holding identical tensors
    share one row ("ranks 1-7 (7 identical)"); past ``max_rows`` rows the rest is
    summarised (see :func:`workbench.analysis.rankgroups.group_identical_ranks`).
    """
    trace = _status_heatmap(tensors, group=group, max_rows=max_rows)
    fig = go.Figure([trace, *legend_entries(trace.meta["statuses"])])
    rows = len(trace.y)
    ranks = tensors["rank"].nunique()
    if rows < ranks:
        title = f"{title} · {ranks} ranks in {rows} row{'s' if rows > 1 else ''}"
    left = max(80, 6 * max(len(str(y)) for y in trace.y))
    height, bottom = status_height(rows, list(dict.fromkeys(tensors["name"])))
    fig.update_layout(title=title, height=height, margin={"b": bottom, "l": left, "t": 60},
                      xaxis={"tickangle": -60, "tickfont": {"size": 9}, "showgrid": False},
                      yaxis={"showgrid": False}, legend={"title": "status"}, plot_bgcolor="white")
    return fig


def _signed_log(v: float) -> float:
    """sign(v) * log10(1 + |v|): garbage like -5.9e24 and 0.42 on one readable axis."""
    if v is None or math.isnan(v):
        return float("nan")
    if math.isinf(v):
        return math.copysign(40.0, v)
    return math.copysign(math.log10(1 + abs(v)), v)


def _finite(v: object) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def buffer_values(history: pd.DataFrame, name: str, *, group: bool | None = None,
                  max_lines: int | None = MAX_LINES) -> go.Figure:
    """The first values of one tensor on every rank, one panel per step.

    Past ``GROUP_ABOVE`` ranks (or with ``group=True``) ranks whose values are identical
    are drawn once, labelled "ranks 1-7 (7 identical)"; past ``max_lines`` distinct lines
    in a panel the rest share one grey trace whose hover names each rank group.
    """
    rows = history[history["name"] == name]
    if rows.empty:
        raise KeyError(f"no tensor {name!r} in this history")
    steps = list(dict.fromkeys(rows["step"])) if "step" in rows else [""]
    grouped = _grouping(rows["rank"].nunique(), group)
    fig = make_subplots(rows=1, cols=len(steps), subplot_titles=steps, shared_yaxes=True)
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    shown: set[str] = set()
    for j, step in enumerate(steps, start=1):
        at = rows[rows["step"] == step] if "step" in rows else rows
        if grouped:
            entries = rankgroups.group_values(at, max_lines=max_lines)
        else:
            entries = [{"label": f"rank {r.rank}", "ranks": [int(r.rank)], "row": r, "how": "identical"}
                       for r in at.itertuples(index=False)]
        for e in entries:
            if e["how"] == "mixed":
                fig.add_trace(_folded_trace(e, shown), row=1, col=j)
                continue
            r = e["row"]
            label = e["label"]
            head = list(r.head) if r.head is not None else []
            fig.add_trace(go.Scatter(
                x=list(range(len(head))), y=[_signed_log(v) for v in head], mode="lines+markers",
                name=label, legendgroup=label, showlegend=label not in shown,
                line={"color": palette[e["ranks"][0] % len(palette)]},
                customdata=[[fmt(v), r.dtype] for v in head],
                hovertemplate=label + " [%{x}] = %{customdata[0]} (%{customdata[1]})<extra></extra>",
            ), row=1, col=j)
            bad = [(i, fmt(v)) for i, v in enumerate(head) if not _finite(v)]
            if bad:  # NaN/Inf have no height: marked on the zero line, or an all-NaN rank would draw nothing
                fig.add_trace(go.Scatter(
                    x=[i for i, _ in bad], y=[0.0] * len(bad), mode="markers", name=f"{label}: non-finite",
                    legendgroup=label, showlegend=False,
                    marker={"symbol": "x", "size": 9, "color": palette[e["ranks"][0] % len(palette)]},
                    customdata=[[w, r.dtype] for _, w in bad],
                    hovertemplate=label + " [%{x}] = %{customdata[0]} (%{customdata[1]})<extra></extra>",
                ), row=1, col=j)
            shown.add(label)
    fig.update_yaxes(title_text="sign·log10(1+|v|)", col=1)
    fig.update_layout(title=f"{short(name)}: first values per rank", height=360)
    return fig


def _folded_trace(e: dict, shown: set[str]) -> go.Scatter:
    """The rank groups past ``max_lines``: one grey trace, lines split by gaps, hover per group."""
    xs, ys, cd = [], [], []
    for label, r in zip(e["labels"], e["rows"]):
        head = list(r.head) if r.head is not None else []
        xs += [*range(len(head)), None]
        ys += [*(_signed_log(v) for v in head), None]
        cd += [*([label, fmt(v), r.dtype] for v in head), [label, "", ""]]
    label = e["label"]
    showlegend = label not in shown
    shown.add(label)
    return go.Scatter(x=xs, y=ys, mode="lines", name=label, legendgroup=label, showlegend=showlegend,
                      line={"color": "#aaaaaa", "width": 1}, customdata=cd, connectgaps=False,
                      hovertemplate="%{customdata[0]} [%{x}] = %{customdata[1]} (%{customdata[2]})<extra></extra>")


def outputs_view(outputs: pd.DataFrame, title: str = "Outputs per rank") -> go.Figure:
    """NaN fraction and distance to the reference, per rank and output."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["NaN fraction", "max |output - reference|"])
    run_col = "run" if "run" in outputs else None
    groups = outputs.groupby(run_col, sort=False) if run_col else [("", outputs)]
    for label, g in groups:
        x = [f"rank {r}" for r in g["rank"]]
        frac = [(_int(n) / max(_int(t), 1)) for n, t in zip(g["nan"], g["numel"])]
        diff = [None if d is None or d != d else (1e6 if math.isinf(d) else d) for d in g.get("ref_max_abs_diff", [])]
        fig.add_trace(go.Bar(x=x, y=frac, name=f"{label} NaN" if label else "NaN"), row=1, col=1)
        fig.add_trace(go.Bar(x=x, y=diff, name=f"{label} ref diff" if label else "ref diff"), row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(title=title, barmode="group", height=340)
    return fig


def _int(v: object) -> int:
    return 0 if v is None or v is pd.NA or v != v else int(v)


def comparison(bug_tensors: pd.DataFrame, fix_tensors: pd.DataFrame, fix: str, *, group: bool | None = None,
               max_rows: int | None = MAX_ROWS) -> go.Figure:
    """Last-step status of the bug path above the fix, on the same ranks and tensors."""
    fig = make_subplots(rows=2, cols=1, subplot_titles=["bug path", f"fix: {fix}"], vertical_spacing=0.25)
    top = _status_heatmap(last_step(bug_tensors), group=group, max_rows=max_rows)
    bottom = _status_heatmap(last_step(fix_tensors), showscale=False, group=group, max_rows=max_rows)
    fig.add_trace(top, row=1, col=1)
    fig.add_trace(bottom, row=2, col=1)
    for entry in legend_entries(sorted(set(top.meta["statuses"]) | set(bottom.meta["statuses"]))):
        fig.add_trace(entry, row=1, col=1)
    rows = max(len(top.y), len(bottom.y), 1)
    left = max(80, 6 * max(len(str(y)) for y in [*top.y, *bottom.y]))
    names = list(dict.fromkeys([*bug_tensors["name"], *fix_tensors["name"]]))
    height, bottom_px = status_height(rows, names)
    fig.update_layout(margin={"b": bottom_px})
    fig.update_xaxes(tickangle=-60, tickfont={"size": 9}, showgrid=False)
    fig.update_yaxes(showgrid=False)
    fig.update_layout(title=f"Bug vs fix '{fix}' after the last step", height=2 * height, margin={"l": left},
                      legend={"title": "status"}, plot_bgcolor="white")
    return fig



def ties_view(history: pd.DataFrame, rank: int | None = None, title: str = "Which names share one tensor") -> go.Figure:
    """Per step, each pair of names the probe saw holding one tensor (``shares``: a tie, two names for one
    memory): "one tensor" while the tie holds, "two tensors" once it broke (``to_empty`` re-creates each
    module's parameter: a head tied to the embedding comes out as a tensor of its own). ``history``: the
    session's tensor rows over steps (``s.history``, a bundle's ``rec.tensors``); ``rank``: whose rows (the
    lowest by default). Empty (with a title saying so) when no step held a tie."""
    from workbench.analysis.findings import ties

    fig = go.Figure()
    if history is None or history.empty or "shares" not in history:
        return fig.update_layout(title=f"{title}: no tensor is held under two names in any step")
    rows = history if rank is None else history[history["rank"] == rank]
    rows = rows[rows["rank"] == rows["rank"].min()] if len(rows) else rows
    steps = list(dict.fromkeys(rows["step"]))
    per = {s: ties(rows[rows["step"] == s]) for s in steps}
    pairs = sorted({p for v in per.values() for p in v}, key=sorted)
    if not pairs:
        return fig.update_layout(title=f"{title}: no tensor is held under two names in any step")
    held = {s: set(rows[rows["step"] == s]["name"]) for s in steps}
    labels = [" = ".join(f"`{short(n)}`" for n in sorted(p)) for p in pairs]
    z = [[1 if p in per[s] else (0 if p <= held[s] else None) for s in steps] for p in pairs]
    text = [["one tensor" if v == 1 else "two tensors" if v == 0 else "not probed" for v in line] for line in z]
    fig.add_trace(go.Heatmap(z=z, x=steps, y=labels, text=text, texttemplate="%{text}", showscale=False,
                             colorscale=[[0, COLORS["poison"]], [1, COLORS["ok"]]], zmin=0, zmax=1, xgap=2, ygap=2,
                             hovertemplate="%{y}<br>step %{x}: %{text}<extra></extra>"))
    return fig.update_layout(title=title, height=140 + 40 * len(pairs), margin={"l": 40, "r": 20, "t": 60, "b": 40})
