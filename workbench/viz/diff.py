"""Two runs side by side: points x tensors, each cell coloured by the first kind of difference.

A pure function of the cells table ``workbench.postmortem.diff`` builds (one row per point and tensor:
``point``, ``point_index``, ``name``, ``table``, ``kind``, ``ranks``, ``detail``); the first cell that
parts the runs is outlined.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from workbench.analysis.frames import shorten
from workbench.viz.tensors import discrete_scale

# kind -> colour: what parts the runs in warm colours, what does not in greys and greens
COLORS = {
    "only in one run": "#6a3d9a", "dtype": "#e31a1c", "shape": "#fb9a99", "placement": "#ff7f00",
    "meta": "#cab2d6", "written": "#b15928", "NaN/Inf/poison": "#000000", "values": "#fdbf6f",
    "within rounding": "#b2df8a", "dtype as given": "#a6cee3", "same": "#33a02c", "not on both": "#dddddd",
}


def diff_figure(cells: pd.DataFrame, first: dict[str, Any] | None = None, labels: tuple[str, str] = ("A", "B"),
                title: str = "", kinds: list[str] | None = None) -> go.Figure:
    """Points (rows) x tensors (columns); hover says the ranks and the words; ``first`` outlined."""
    order = list(kinds or COLORS)
    fig = go.Figure()
    if cells is None or not len(cells):
        fig.update_layout(title=title or f"{labels[0]} vs {labels[1]}: nothing to compare")
        return fig
    points = list(dict.fromkeys(cells.sort_values("point_index", kind="stable")["point"]))
    names = list(dict.fromkeys(cells["name"]))
    label = shorten(names)
    cols = [label[n] + (" (output)" if t == "output" else "") for n, t in
            dict.fromkeys(zip(cells["name"], cells["table"]))]
    col_of = {(n, t): i for i, (n, t) in enumerate(dict.fromkeys(zip(cells["name"], cells["table"])))}
    z = [[None] * len(cols) for _ in points]
    text = [[""] * len(cols) for _ in points]
    row_of = {p: i for i, p in enumerate(points)}
    for c in cells.to_dict(orient="records"):
        i, j = row_of[c["point"]], col_of[(c["name"], c["table"])]
        k = c["kind"] if c["kind"] in order else order[-1]
        z[i][j] = order.index(k)
        ranks = ",".join(map(str, c["ranks"])) if isinstance(c["ranks"], list) else str(c["ranks"])
        text[i][j] = f"{c['name']}<br>{c['point']}: <b>{k}</b> (ranks {ranks})<br>{c['detail'] or ''}"
    n = len(order)
    fig.add_trace(go.Heatmap(z=z, x=cols, y=points, text=text, hoverinfo="text", zmin=-0.5, zmax=n - 0.5,
                             colorscale=discrete_scale(order, {k: COLORS.get(k, "#999999") for k in order}),
                             showscale=False, xgap=1, ygap=1))
    present = [k for k in order if k in set(cells["kind"])]
    for k in present:  # a categorical legend: one swatch per kind present
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=k, hoverinfo="skip",
                                 marker={"symbol": "square", "size": 12, "color": COLORS.get(k, "#999999")}))
    if first is not None and (first["name"], first["table"]) in col_of and first["point"] in row_of:
        i, j = row_of[first["point"]], col_of[(first["name"], first["table"])]
        fig.add_shape(type="rect", x0=j - 0.5, x1=j + 0.5, y0=i - 0.5, y1=i + 0.5, xref="x", yref="y",
                      line={"color": "#1f78b4", "width": 4})
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", tickangle=-60)
    fig.update_layout(title={"text": _wrap(title or f"{labels[0]} vs {labels[1]}"), "font": {"size": 12}},
                      height=160 + 28 * len(points) + 6 * max(len(c) for c in cols),
                      width=max(600, 120 + 22 * len(cols)), plot_bgcolor="white", legend={"title": "first kind"})
    return fig


def _wrap(text: str, width: int = 110) -> str:
    """A long sentence over several title lines (Plotly does not wrap)."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + len(word) + 1 > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "<br>".join([*lines, line])
