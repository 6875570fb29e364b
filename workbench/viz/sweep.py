"""The sweep's grid as one picture: where the bug path shows, where it is silent, how far it departs."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

COLORS = {"shows": "#d62728", "clean": "#2ca02c", "unsupported": "#d9d9d9"}


def _combo(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "defaults"


def sweep_view(table: pd.DataFrame, title: str = "") -> go.Figure:
    """World size across, parameter combination down; a cell is red where the bug path's diagnosis names
    a mechanism, green where it reads clean, grey where the mesh cannot lay the scenario out. Each cell
    is labelled with the mechanism and the largest output gap; hovering shows the sentence."""
    ranks = sorted(set(table["ranks"]))
    combos = list(dict.fromkeys(_combo(p) for p in table["params"]))
    z, text, hover = [], [], []
    for c in combos:
        zr, tr, hr = [], [], []
        for n in ranks:
            hit = table[(table["ranks"] == n) & (table["params"].map(_combo) == c)]
            if hit.empty:
                zr.append(None), tr.append(""), hr.append("not run")
                continue
            r = hit.iloc[0]
            state = "unsupported" if r["mechanism"] == "unsupported" else ("shows" if r["shows"] else "clean")
            zr.append({"clean": 0, "shows": 1, "unsupported": 0.5}[state])
            gap = r["gap"]
            tr.append(r["mechanism"] + ("" if gap is None or math.isnan(gap) else f"<br>gap {gap:.3g}"))
            hr.append(str(r["sentence"])[:300])
        z.append(zr), text.append(tr), hover.append(hr)
    scale = [[0, COLORS["clean"]], [0.5, COLORS["unsupported"]], [1, COLORS["shows"]]]
    fig = go.Figure(go.Heatmap(z=z, x=[f"N={n}" for n in ranks], y=combos, text=text, texttemplate="%{text}",
                               customdata=hover, hovertemplate="%{y} at %{x}<br>%{customdata}<extra></extra>",
                               colorscale=scale, zmin=0, zmax=1, showscale=False, xgap=2, ygap=2))
    fig.update_layout(title=title or "where the bug shows (red) and where it is silent (green)",
                      xaxis_title="ranks", yaxis_title="parameters", height=160 + 60 * len(combos))
    return fig
