"""Views of a colocated weight sync: whose tensor each worker name holds, routing, output gap.

Pure functions of records (live session or loaded bundle) through ``analysis.weightsync``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.analysis import weightsync as ws
from workbench.viz.tensors import discrete_scale

STATUS_ORDER = ["match", "cast", "mislabel", "stale"]
STATUS_COLORS = {"match": "#2ca02c", "cast": "#bcbd22", "mislabel": "#d62728", "stale": "#7f7f7f"}


def _scale() -> list[list]:
    return discrete_scale(STATUS_ORDER, STATUS_COLORS)


def _short(name: str) -> str:
    return name.replace("model.layers.", "L").replace(".mlp.", ".").replace("model.", "")


def match_matrix_view(source: Any, title: str | None = None, step: str | None = None) -> go.Figure:
    """Workers x names, coloured by whose tensor the name holds; hover says it in words."""
    m = source if isinstance(source, pd.DataFrame) else ws.match_matrix(source, step)
    names = list(dict.fromkeys(m["name"]))
    wk = sorted(m["worker"].unique())
    z, text = [], []
    for w in wk:
        g = m[m["worker"] == w].set_index("name")
        z.append([STATUS_ORDER.index(g.loc[n, "status"]) if n in g.index else None for n in names])
        text.append([g.loc[n, "finding"] if n in g.index else "not held by this worker" for n in names])
    fig = go.Figure(go.Heatmap(
        z=z, x=[_short(n) for n in names], y=[f"worker {w}" for w in wk], text=text,
        hovertemplate="%{text}<extra></extra>", colorscale=_scale(), zmin=-0.5, zmax=len(STATUS_ORDER) - 0.5,
        xgap=1, ygap=2, colorbar={"tickvals": list(range(len(STATUS_ORDER))), "ticktext": STATUS_ORDER}))
    bad = m[m["status"] != "match"]
    sub = f"{len(bad)} of {len(m)} names do not hold the trainer's tensor of that name" if len(bad) else \
        f"all {len(m)} names hold the trainer's tensor of that name"
    fig.update_layout(title=title or f"Sender -> receiver match matrix: {sub}", height=220 + 40 * len(wk),
                      xaxis={"tickangle": -60, "tickfont": {"size": 9}}, margin={"b": 160})
    return fig


def routing_view(source: Any, worker: int | None = None, router: str | None = None,
                 title: str | None = None) -> go.Figure:
    """Per token, the experts chosen with the trainer's fp32 bias and after the sync; the bias per expert.

    One worker (default: the lowest) and one router (default: the first MoE layer's).
    """
    r = ws.routing(source)
    b = ws.router_biases(source)
    if worker is None and len(r):
        worker = int(r["worker"].min())
    r = r[r["worker"] == worker]
    b = b[b["worker"] == worker]
    router = router or (r["router"].iloc[0] if len(r) else "")
    r, b = r[r["router"] == router], b[b["router"] == router]
    n_exp = int(b["expert"].max()) + 1 if len(b) else 0
    code = {(True, True): 3, (True, False): 1, (False, True): 2, (False, False): 0}
    z = [[code[(e in a, e in s)] for e in range(n_exp)] for a, s in zip(r["trainer"], r["synced"])]
    labels = ["not chosen", "trainer's bias only", "synced bias only", "both"]
    colors = ["#f7f7f7", "#1f77b4", "#d62728", "#555555"]
    scale = [x for i, c in enumerate(colors) for x in ([i / 4, c], [(i + 1) / 4, c])]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], horizontal_spacing=0.12,
                        subplot_titles=("expert set per token", "router bias per expert"))
    fig.add_trace(go.Heatmap(z=z, x=[f"e{e}" for e in range(n_exp)], y=[f"t{t}" for t in r["token"]],
                             colorscale=scale, zmin=-0.5, zmax=3.5, xgap=1, ygap=1,
                             text=[[labels[v] for v in row] for row in z],
                             hovertemplate="%{y} %{x}: %{text}<extra></extra>",
                             colorbar={"tickvals": [0, 1, 2, 3], "ticktext": labels, "x": 0.55}), 1, 1)
    if len(b):
        fig.add_trace(go.Scatter(x=b["expert"], y=b["trainer"], mode="markers+lines", name="trainer (fp32)"), 1, 2)
        fig.add_trace(go.Scatter(x=b["expert"], y=b["synced"], mode="markers+lines", name="after the sync"), 1, 2)
    changed = float(r["changed"].mean()) if len(r) else 0.0
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_yaxes(tickformat=".4f", row=1, col=2)
    fig.update_layout(title=title or f"Routing on worker {worker} ({_short(router)}): {changed:.0%} of tokens change "
                      "expert set",
                      height=max(360, 14 * len(r) + 160), legend={"x": 0.75, "y": -0.15, "orientation": "h"})
    return fig


def output_gap_view(*sources: Any, title: str = "Log-prob gap to the trainer, per worker: before and after the sync"
                    ) -> go.Figure:
    """Grouped bars: per run and worker, mean |log-prob - trainer's| before and after the sync.

    Runs through vLLM add a third bar, the round trip before any sync (vLLM serving the trainer's
    own weights): the level a right sync returns to. A NaN gap (NaN log-probs) shows as a missing
    bar, named in the hover of the others and in ``ws.output_gap``."""
    g = ws.output_gap(*sources)
    fig = go.Figure()
    label = [f"{r} ({v})" if v == "vllm" else str(r) for r, v in zip(g["run"], g["receiver"])]
    x = [label, [f"worker {w}" for w in g["worker"]]]  # two-level axis: run, then worker
    bars = [("before", "#aec7e8", "before the sync"), ("after", "#d62728", "after the sync")]
    if g["presync"].notna().any():
        bars.insert(0, ("presync", "#2ca02c", "pre-sync round trip (same weights)"))
    for col, color, name in bars:
        fig.add_trace(go.Bar(x=x, y=g[col], name=name, marker_color=color,
                             customdata=g["after_max"], hovertemplate="%{y:.3g} (max after %{customdata:.3g})"))
    fig.update_layout(title=title, barmode="group", yaxis_title="mean |Δ log-prob|", height=380)
    return fig


def _colour(name: str | None) -> str:
    """One colour per routed expert (the tensors that move between ranks), grey for dense tensors."""
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    if name is None:
        return "#ffffff"
    parts = name.split(".experts.")
    if len(parts) == 2 and parts[1].split(".")[0].isdigit():
        return palette[int(parts[1].split(".")[0]) % len(palette)]
    return "#c7c7c7"


def buffer_layout_view(source: Any, dtype: str = "bfloat16", title: str | None = None) -> go.Figure:
    """Each rank's packed buffer as segments (what the bytes are), and the names a worker loaded them under."""
    lay = ws.buffer_layout(source)
    lay = lay[lay["dtype"] == dtype]
    fig = go.Figure()
    for rank, g in lay.groupby("rank"):
        for label, col in ((f"rank {rank}'s buffer: bytes of", "name"), (f"worker {rank} loaded them as", "loaded_as")):
            names = list(g[col])
            fig.add_trace(go.Bar(
                y=[label] * len(g), x=g["size"], base=g["offset"], orientation="h", showlegend=False,
                marker={"color": [_colour(n) for n in names], "line": {"color": "#333", "width": 0.5}},
                text=[_short(n).replace("L0.experts.", "e") if n else "" for n in names], textposition="inside",
                insidetextanchor="middle", hovertext=[n or "held under no name" for n in names],
                hovertemplate="%{hovertext}<br>elements %{base} .. +%{x}<extra></extra>"))
    fig.update_layout(title=title or f"Packed {dtype} buffers: what the bytes are vs the names they were loaded under",
                      barmode="overlay", height=140 + 60 * lay["rank"].nunique() * 2, xaxis_title="element offset",
                      yaxis={"autorange": "reversed"}, uniformtext={"minsize": 7, "mode": "hide"})
    return fig
