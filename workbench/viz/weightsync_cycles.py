"""Weight-sync views: the sender's stream order against the receiver's plan, and sync cycles bug vs fix.

Pure functions of tables (``workbench.analysis.weightsync_order``): they draw a live
session and a saved record alike.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.analysis.weightsync_order import first_mismatch, match_table, provenance, sync_cycles

DTYPE_COLORS = {"bfloat16": "#1f77b4", "float32": "#ff7f0e", "float16": "#2ca02c"}


def order_view(plan: pd.DataFrame, stream: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Two lanes over the packed byte stream: what the sender streamed, what the receiver's plan slices.

    One box per tensor (x: byte offset, width: its bytes, colour: dtype); a plan box whose
    bytes are not its own tensor's is outlined red, and the first index where the names
    part is marked. Hover: the names and, for the plan, whose bytes it got.
    """
    pv = provenance(plan, stream)
    fig = go.Figure()
    lanes = [("sender stream", stream, None), ("receiver plan", plan, pv)]
    for lane, df, prov in lanes:
        for dtype, part in df.groupby("dtype", sort=False):
            own = prov.set_index("index")["own"].reindex(part["index"]).tolist() if prov is not None else \
                [True] * len(part)
            hover = [f"#{r.index} {r.name}<br>{r.dtype} {list(r.shape)}, {r.nbytes} B at {r.offset}"
                     + (f"<br>chunk {r.chunk}" if r.chunk is not None and r.chunk == r.chunk else "")
                     for r in part.itertuples()]
            if prov is not None:
                holds = prov.set_index("index")["holds"].reindex(part["index"]).tolist()
                hover = [h + f"<br>gets: {g}" for h, g in zip(hover, holds)]
            fig.add_trace(go.Bar(
                y=[lane] * len(part), x=part["nbytes"], base=part["offset"], orientation="h",
                name=f"{lane}: {dtype}", legendgroup=dtype, showlegend=lane == "sender stream",
                marker={"color": DTYPE_COLORS.get(dtype, "#7f7f7f"),
                        "line": {"color": ["#2b2b2b" if o else "#d62728" for o in own],
                                 "width": [0.5 if o else 2.5 for o in own]}},
                hovertext=hover, hoverinfo="text"))
    miss = first_mismatch(plan, stream)
    if miss is not None and miss["index"] < len(plan):
        at = int(plan["offset"].iloc[miss["index"]])
        fig.add_vline(x=at, line={"color": "#d62728", "dash": "dash"})
        fig.add_annotation(x=at, y=1.0, yref="paper", yanchor="bottom", showarrow=False, font={"color": "#d62728"},
                           text=f"first mismatch at index {miss['index']}: plan {miss['planned']!r}, "
                                f"stream {miss['streamed']!r}")
    wrong = int((~pv["own"]).sum()) if len(pv) else 0
    fig.update_layout(
        title=title or f"stream vs plan: {wrong} of {len(plan)} names get bytes that are not theirs",
        barmode="overlay", xaxis={"title": "byte offset in the packed stream"}, height=300,
        legend={"orientation": "h", "y": -0.35}, margin={"t": 80})
    return fig


def cycles_view(runs: dict[str, pd.DataFrame], title: str | None = None) -> go.Figure:
    """Per sync: the worker's log-prob gap to the trainer and the count of names holding wrong bytes,
    one line per run (``{label: outputs table}``). A sync that never scored (rank died, hang) is
    absent from its line."""
    cyc = sync_cycles(runs)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("log-prob gap worker vs trainer", "names with wrong bytes"))
    for i, (label, part) in enumerate(cyc.groupby("run", sort=False)):
        color = ["#d62728", "#2ca02c", "#1f77b4", "#9467bd"][i % 4]
        fig.add_trace(go.Scatter(x=part["sync"], y=part["logprob_gap"], mode="lines+markers", name=label,
                                 legendgroup=label, line={"color": color}), row=1, col=1)
        fig.add_trace(go.Bar(x=part["sync"], y=part["names_wrong"], name=label, legendgroup=label, showlegend=False,
                             marker={"color": color}), row=1, col=2)
    missing = [lab for lab in runs if lab not in set(cyc["run"])]
    fig.update_xaxes(title_text="sync", dtick=1)
    fig.update_layout(title=title or "sync cycles" + (f" (no score: {', '.join(missing)})" if missing else ""),
                      barmode="group", height=340, legend={"orientation": "h", "y": -0.3})
    return fig


def match_view(runs: dict[str, pd.DataFrame], title: str | None = None) -> go.Figure:
    """The match matrix: one row per worker tensor, one column per (run, sync); green when the worker
    holds the trainer's value after that sync, red when not (hover: max |difference|).
    ``runs``: ``{label: tensors history}``."""
    tab = match_table(runs)
    fig = go.Figure()
    if not len(tab):
        fig.update_layout(title=title or "no scored syncs", height=200)
        return fig
    tab = tab.assign(column=[f"{r} · sync {k}" for r, k in zip(tab["run"], tab["sync"])])
    cols = list(dict.fromkeys(tab["column"]))
    names = list(dict.fromkeys(tab["name"]))
    grid = tab.pivot_table(index="name", columns="column", values="match", aggfunc="min").reindex(
        index=names, columns=cols)
    diff = tab.pivot_table(index="name", columns="column", values="ref_diff", aggfunc="max").reindex(
        index=names, columns=cols)
    fig.add_trace(go.Heatmap(
        z=grid.astype(float).values, x=cols, y=names, zmin=0, zmax=1, showscale=False,
        colorscale=[[0, "#d62728"], [1, "#2ca02c"]], xgap=2, ygap=1,
        customdata=diff.values,
        hovertemplate="%{y}<br>%{x}<br>max |worker - trainer| = %{customdata:.3g}<extra></extra>"))
    wrong = (~tab["match"]).groupby(tab["column"]).sum().reindex(cols)
    fig.update_layout(title=title or "worker tensors holding the trainer's values, per sync: "
                      + ", ".join(f"{c}: {int(w)} wrong" for c, w in wrong.items()),
                      height=max(300, 18 * len(names) + 140), yaxis={"autorange": "reversed"},
                      margin={"l": 320, "t": 70})
    return fig
