"""Plotly figures as pure functions of frame tables (live session or loaded bundle alike)."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.findings import STATUSES, status

COLORS = {
    "ok": "#2ca02c", "sharded": "#98df8a", "meta": "#c7c7c7", "differs": "#ff7f0e", "dtype": "#9467bd",
    "reference": "#bcbd22", "inf": "#e377c2", "nan": "#d62728", "poison": "#8c0000", "missing": "#7f7f7f",
}


def short(name: str) -> str:
    """Tensor names without the wrapper prefixes every row shares."""
    for prefix in ("model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _discrete_scale() -> list[list]:
    n = len(STATUSES)
    scale = []
    for i, s in enumerate(STATUSES):
        scale += [[i / n, COLORS[s]], [(i + 1) / n, COLORS[s]]]
    return scale


def _status_heatmap(tensors: pd.DataFrame, showscale: bool = True) -> go.Heatmap:
    st = status(tensors)
    names = list(dict.fromkeys(st["name"]))
    ranks = sorted({int(r) for r in st["rank"]})
    code = {s: i for i, s in enumerate(STATUSES)}
    z, text = [], []
    info = tensors.set_index(["rank", "name"])
    for r in ranks:
        sub = st[st["rank"] == r].set_index("name")
        z.append([code[sub.loc[n, "status"]] + 0.5 if n in sub.index else code["missing"] + 0.5 for n in names])
        row_text = []
        for n in names:
            if n not in sub.index:
                row_text.append(f"rank {r}<br>{n}<br>missing")
                continue
            t = info.loc[(r, n)]
            head = ", ".join(_fmt(v) for v in list(t["head"])[:4])
            row_text.append(f"rank {r}<br>{n}<br>{sub.loc[n, 'status']}: {sub.loc[n, 'detail']}<br>"
                            f"{t['dtype']} {t['shape']} {t['kind']}<br>head [{head}]")
        text.append(row_text)
    n = len(STATUSES)
    return go.Heatmap(
        z=z, x=[short(x) for x in names], y=[f"rank {r}" for r in ranks], text=text, hoverinfo="text",
        colorscale=_discrete_scale(), zmin=0, zmax=n, showscale=showscale, xgap=1, ygap=2,
        colorbar={"tickvals": [i + 0.5 for i in range(n)], "ticktext": STATUSES, "title": "status"},
    )


def status_matrix(tensors: pd.DataFrame, title: str = "What every rank holds") -> go.Figure:
    """Rank x tensor: ok / meta / dtype / differs from rank 0 / NaN / never written."""
    fig = go.Figure(_status_heatmap(tensors))
    fig.update_layout(title=title, height=200 + 40 * tensors["rank"].nunique(), margin={"b": 160},
                      xaxis={"tickangle": -60, "tickfont": {"size": 9}})
    return fig


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    return f"{v:.4g}"


def _signed_log(v: float) -> float:
    """sign(v) * log10(1 + |v|): garbage like -5.9e24 and 0.42 on one readable axis."""
    if v is None or math.isnan(v):
        return float("nan")
    if math.isinf(v):
        return math.copysign(40.0, v)
    return math.copysign(math.log10(1 + abs(v)), v)


def buffer_values(history: pd.DataFrame, name: str) -> go.Figure:
    """The first values of one tensor on every rank, one panel per step."""
    rows = history[history["name"] == name]
    if rows.empty:
        raise KeyError(f"no tensor {name!r} in this history")
    steps = list(dict.fromkeys(rows["step"]))
    fig = make_subplots(rows=1, cols=len(steps), subplot_titles=steps, shared_yaxes=True)
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    for j, step in enumerate(steps, start=1):
        for r in rows[rows["step"] == step].itertuples(index=False):
            head = list(r.head) if r.head is not None else []
            fig.add_trace(go.Scatter(
                x=list(range(len(head))), y=[_signed_log(v) for v in head], mode="lines+markers",
                name=f"rank {r.rank}", legendgroup=f"rank {r.rank}", showlegend=(j == 1),
                line={"color": palette[int(r.rank) % len(palette)]},
                customdata=[[_fmt(v), r.dtype] for v in head],
                hovertemplate="rank " + str(r.rank) + " [%{x}] = %{customdata[0]} (%{customdata[1]})<extra></extra>",
            ), row=1, col=j)
    fig.update_yaxes(title_text="sign·log10(1+|v|)", col=1)
    fig.update_layout(title=f"{short(name)}: first values per rank", height=360)
    return fig


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


def comparison(bug_tensors: pd.DataFrame, fix_tensors: pd.DataFrame, fix: str) -> go.Figure:
    """Last-step status of the bug path above the fix, on the same ranks and tensors."""
    fig = make_subplots(rows=2, cols=1, subplot_titles=["bug path", f"fix: {fix}"], vertical_spacing=0.25)
    fig.add_trace(_status_heatmap(_last_step(bug_tensors)), row=1, col=1)
    fig.add_trace(_status_heatmap(_last_step(fix_tensors), showscale=False), row=2, col=1)
    ranks = bug_tensors["rank"].nunique() if len(bug_tensors) else 1
    fig.update_xaxes(tickangle=-60, tickfont={"size": 9})
    fig.update_layout(title=f"Bug vs fix '{fix}' after the last step", height=360 + 80 * ranks)
    return fig


def _last_step(history: pd.DataFrame) -> pd.DataFrame:
    if "step_index" not in history or history.empty:
        return history
    return history[history["step_index"] == history["step_index"].max()]
