"""The collectives swimlane: one lane per rank, one box per call, aligned by sequence number.

A pure function of the ledger table (``session.ledger``, ``frame.ledger`` or a loaded
bundle's ``record.ledger``): colour = op, hover = dtype/shape/bytes/state/where, hung
calls (still ``started``) ringed red, failed or timed-out calls crossed, and the first
divergence shaded with its one-line cause.
"""

from __future__ import annotations

import html
import textwrap
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from workbench.analysis import stacks
from workbench.analysis.collectives import OPEN, Divergence, describe, first_divergence
from workbench.analysis.frames import plain_backend

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
STATE_MARKS = {OPEN: ("circle-open", "#d62728", "hung (still inside)"),
               "timed out": ("x-thin-open", "#d62728", "timed out"),
               "failed": ("x-thin-open", "#8c0000", "failed")}


def swimlane(ledger: pd.DataFrame, step: str | None = None, divergence: Divergence | bool | None = True,
             title: str | None = None) -> go.Figure:
    """Per-rank lanes of collective calls (x: sequence number on its group).

    ``step`` keeps one step's calls; several attempts (after a recovery) keep the latest.
    ``divergence``: True computes the first divergence and highlights it, a Divergence
    highlights that one, False draws none.
    """
    df = ledger if ledger is not None else pd.DataFrame()
    if len(df) and step is not None:
        df = df[df["step"] == step]
    if len(df) and df["attempt"].nunique() > 1:
        df = df[df["attempt"] == df["attempt"].max()]
    fig = go.Figure()
    if not len(df):
        fig.update_layout(title=title or "no collectives recorded", height=200)
        return fig
    df = df.copy()
    multi = df["group"].nunique() > 1
    df["lane"] = [f"rank {r} · group {g}" if multi else f"rank {r}" for r, g in zip(df["rank"], df["group"])]
    lanes = sorted(df["lane"].unique(), key=lambda s: (int(s.split()[1]), s))
    df["hover"] = [describe(row) + f"<br>state: {row['state']}<br>step: {row['step']}"
                   + (f"<br>{plain_backend(row['error'])}" if isinstance(row["error"], str) else "")
                   for _, row in df.iterrows()]
    ops = list(dict.fromkeys(df.sort_values("seq")["op"]))
    few = len(df) <= 60
    for i, op in enumerate(ops):
        part = df[df["op"] == op]
        fig.add_trace(go.Scatter(
            x=part["seq"].astype(int), y=part["lane"], mode="markers+text" if few else "markers", name=op,
            marker={"symbol": "square", "size": 22, "color": PALETTE[i % len(PALETTE)], "line": {"width": 0}},
            text=[_label(r) for _, r in part.iterrows()] if few else None, textposition="top center",
            textfont={"size": 9}, hovertext=part["hover"], hoverinfo="text"))
    for state, (symbol, color, label) in STATE_MARKS.items():
        part = df[df["state"] == state]
        if len(part):
            fig.add_trace(go.Scatter(
                x=part["seq"].astype(int), y=part["lane"], mode="markers", name=label,
                marker={"symbol": symbol, "size": 34, "color": color, "line": {"width": 3, "color": color}},
                hovertext=part["hover"], hoverinfo="text"))
    div = first_divergence(df) if divergence is True else (divergence or None)
    if isinstance(div, Divergence):
        fig.add_vrect(x0=div.seq - 0.5, x1=div.seq + 0.5, fillcolor="#d62728", opacity=0.15, line_width=0)
        fig.add_annotation(x=div.seq, y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           text=f"first divergence: {div.kind} (group {div.group} #{div.seq})",
                           font={"color": "#d62728"})
    fig.update_layout(
        title=title or ("collectives" + (f" in step {step!r}" if step else "")),
        xaxis={"title": "sequence number on the group", "dtick": 1 if df["seq"].max() <= 40 else None},
        yaxis={"categoryorder": "array", "categoryarray": lanes[::-1], "title": ""},
        height=160 + 60 * len(lanes), legend={"orientation": "h", "y": -0.3}, margin={"t": 70})
    return fig


def _label(row: pd.Series) -> str:
    short = {"all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS", "all_reduce": "AR",
             "broadcast": "BC", "barrier": "BAR", "send": "S", "recv": "R"}.get(row["op"], row["op"][:6])
    return f"{short} {row['dtypes']}"


def hang_view(hang: Any, width: int = 110) -> go.Figure:
    """The companion of a hung step's swimlane: the proof in the title, then per stuck rank where it
    waits and its innermost Python frames (most recent first).

    ``hang``: ``frame.hang`` of a live session, or a loaded bundle's ``record.manifest["hangs"][i]``.
    """
    rows = stacks.stuck_ranks(hang)
    proof = stacks.proof(hang)
    title = [_esc(stacks.headline(hang))]
    if proof:
        title += textwrap.wrap(_esc(f"proof: {proof}"), width)
    frames = ["\n".join(x for x in r["innermost"].splitlines() if not x.startswith(("Current thread", "Thread ")))
              for r in rows]  # the thread header: the column says it
    cells = [[f"rank {r['rank']}" for r in rows], [_where(r["where"]) for r in rows],
             [_esc(f or "(no stack taken)").replace("\n", "<br>") for f in frames]]
    fig = go.Figure(go.Table(
        columnwidth=[1, 6, 9],
        header={"values": ["rank", "waits in", "innermost frames, most recent call first"], "align": "left",
                "fill_color": "#f4f4f4"},
        cells={"values": cells, "align": "left", "font": {"family": "monospace", "size": 11}}))
    lines = sum(max(f.count("\n") + 1, 2) for f in frames)
    fig.update_layout(title={"text": "<br>".join(title), "font": {"size": 12}}, margin={"t": 40 + 16 * len(title)},
                      height=120 + 16 * len(title) + 17 * lines)
    return fig


def _esc(text: str) -> str:
    return html.escape(text, quote=False)  # plotly's text knows <, > and & entities; quotes stay as they are


def _where(text: str) -> str:
    """``op #9 ... at a/b/file.py:95 fn`` -> the call, then ``at file.py:95 fn`` on its own line (a table
    cell does not wrap a path; the frames beside it have the full one)."""
    call, sep, loc = text.partition(" at ")
    return _esc(call) + (f"<br>at {_esc(loc.rsplit('/', 1)[-1])}" if sep else "")
