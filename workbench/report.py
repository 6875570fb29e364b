"""One self-contained HTML report (plotly.js inline, opens offline) from run records."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from workbench import viz
from workbench.record import RunRecord

CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:12px;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f4f4f4}.error{color:#b00}.warning{color:#a60}pre{background:#f7f7f7;padding:.5em;overflow:auto}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em}
"""


def interesting_buffers(record: RunRecord) -> list[str]:
    """Non-persistent buffers first (the usual suspects), else the first tensor."""
    t = record.tensors
    names = list(dict.fromkeys(t[t["kind"] == "non-persistent buffer"]["name"]))
    return names[:2] or list(dict.fromkeys(t["name"]))[:1]


class _Page:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self._js_done = False

    def h(self, level: int, text: str) -> None:
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def p(self, text: str) -> None:
        self.parts.append(f"<p>{html.escape(text)}</p>")

    def fig(self, fig: go.Figure) -> None:
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=not self._js_done,
                                      config={"displaylogo": False}))
        self._js_done = True

    def table(self, df: pd.DataFrame, max_rows: int = 60) -> None:
        self.parts.append(df.head(max_rows).to_html(index=False, escape=True, na_rep=""))

    def render(self, title: str) -> str:
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<style>{CSS}</style></head><body>" + "\n".join(self.parts) + "</body></html>")


def _run_section(page: _Page, rec: RunRecord) -> None:
    page.h(2, f"{rec.label}")
    events = rec.events
    if len(events):
        page.h(3, "Per-rank failures")
        page.table(events[["step", "rank", "kind", "error", "message"]])
    found = rec.findings()
    if len(found):
        page.h(3, "Findings")
        page.table(found)
    for step in rec.steps:
        t = rec.tensors[rec.tensors["step"] == step]
        if len(t):
            page.fig(viz.status_matrix(t, title=f"{rec.label} · after '{step}'"))
    for name in interesting_buffers(rec):
        page.fig(viz.buffer_values(rec.tensors, name))
    if len(rec.outputs):
        out = rec.outputs[rec.outputs["step_index"] == rec.outputs["step_index"].max()]
        page.fig(viz.outputs_view(out, title=f"{rec.label} · outputs"))
        cols = [c for c in ("rank", "name", "dtype", "shape", "nan", "inf", "ref_max_abs_diff", "fingerprint")
                if c in out]
        page.table(out[cols])


def render(records: list[RunRecord]) -> str:
    """HTML for a bug run and any fix runs of one scenario."""
    if not records:
        raise ValueError("nothing to report: no runs")
    first = records[0].manifest
    page = _Page()
    page.h(1, f"{first['scenario']}: {first.get('title', '')}")
    env = {k: first.get(k) for k in ("ranks", "backend", "devices", "poison", "seed", "timeout_s", "versions")}
    page.parts.append(f"<pre>{html.escape(json.dumps(env, indent=1, default=str))}</pre>")
    page.h(3, "Parameters")
    page.parts.append(f"<pre>{html.escape(json.dumps(first.get('params', {}), default=str))}</pre>")
    for rec in records:
        _run_section(page, rec)
    bug = next((r for r in records if not r.manifest.get("fix")), None)
    for rec in records:
        if bug is not None and rec is not bug:
            page.h(2, f"Bug vs {rec.label}")
            page.fig(viz.comparison(bug.tensors, rec.tensors, rec.manifest["fix"]))
            both = pd.concat([_last_outputs(bug, "bug"), _last_outputs(rec, rec.label)], ignore_index=True)
            if len(both):
                page.fig(viz.outputs_view(both, title="Outputs: bug vs fix"))
    return page.render(first["scenario"])


def _last_outputs(rec: RunRecord, label: str) -> pd.DataFrame:
    out = rec.outputs
    if out.empty:
        return out
    out = out[out["step_index"] == out["step_index"].max()].copy()
    out.insert(0, "run", label)
    return out


def write(records: list[RunRecord], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(render(records), encoding="utf-8")
    tmp.replace(path)
    return path
