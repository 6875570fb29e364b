"""The diagnosis figure: one cell per step and rank, coloured by what went wrong there.

Reads ``Diagnosis.grid`` (built in ``workbench.analysis.diagnosis``), so a live session
and a loaded bundle draw the same picture. The step the story starts in is outlined; the
sentence is the title, wrapped, so the figure stands alone in a report.
"""

from __future__ import annotations

import textwrap
from typing import Any

import plotly.graph_objects as go

from workbench.analysis.diagnosis import GRID_STATUSES

GRID_COLORS = {"ok": "#2ca02c", "fault": "#ff7f0e", "failed": "#d62728", "hung": "#8c0000", "not run": "#d9d9d9"}


def figure(diagnosis: Any, width: int = 100, title: str | None = None) -> go.Figure:
    """Steps across, ranks down; each cell says how many tensors were wrong, or how the rank failed.

    ``title``: the diagnosis sentence unless given (a report that prints the sentence above passes a short one).
    """
    g = diagnosis.grid
    steps = list(dict.fromkeys(g["step"])) if len(g) else []
    ranks = sorted({int(r) for r in g["rank"]}) if len(g) else []
    fig = go.Figure()
    # one trace per status: a categorical legend, one swatch each, and no colour bar
    for status in GRID_STATUSES:
        part = g[g["status"] == status]
        if part.empty:
            continue
        fig.add_trace(go.Scatter(
            x=list(part["step"]), y=[f"rank {r}" for r in part["rank"]], mode="markers+text", name=status,
            marker={"symbol": "square", "size": 30, "color": GRID_COLORS[status]},
            text=[_cell(v) for v in part["label"]], textfont={"size": 10}, textposition="bottom center",
            hovertext=[f"rank {r} · {s}<br>{lab}" for r, s, lab in zip(part["rank"], part["step"], part["label"])],
            hoverinfo="text"))
    if diagnosis.step in steps:
        i = steps.index(diagnosis.step)
        fig.add_shape(type="rect", x0=i - 0.45, x1=i + 0.45, y0=-0.6, y1=len(ranks) - 0.4,
                      line={"color": "black", "width": 2, "dash": "dot"})
    title = "<br>".join(textwrap.wrap(diagnosis.sentence if title is None else title, width)[:4])
    fig.update_layout(
        title={"text": title, "font": {"size": 12}}, height=200 + 80 * max(len(ranks), 1) + 14 * title.count("<br>"),
        xaxis={"categoryorder": "array", "categoryarray": steps, "title": "step"},
        yaxis={"categoryorder": "array", "categoryarray": [f"rank {r}" for r in reversed(ranks)]},
        legend={"title": "status", "orientation": "h", "y": -0.3}, margin={"t": 110})
    return fig


def _cell(label: str) -> str:
    return label if len(label) <= 26 else label[:25] + "…"
