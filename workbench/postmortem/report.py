"""One self-contained HTML report (plotly.js inline, opens offline) from run records.

A pure function of ``RunRecord`` objects: a live session and a loaded bundle give the
same page byte for byte (figure ids are numbered, not random). Sections: environment,
findings, per-step rank x tensor views, buffer values per rank, collective ledger
swimlanes where a run has a ledger, notes and timings, and bug vs each fix.
"""

from __future__ import annotations

import html
import json
import math
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from workbench import viz
from workbench.analysis import diagnosis, findings, stacks
from workbench.analysis.frames import fmt, last_step, plain_backend, worded_failure
from workbench.errors import WorkbenchError
from workbench.postmortem.record import RunRecord
from workbench.viz.diagnosis import figure as diagnosis_figure

CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:12px;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f4f4f4}.error{color:#b00}.warning{color:#a60}pre{background:#f7f7f7;padding:.5em;overflow:auto}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em}nav a{margin-right:1em}
.env th{text-align:left}details{margin:.3em 0}summary{cursor:pointer}
.proof{border-left:4px solid #b00;padding:2px 8px}
.muted{color:#777;font-size:12px}pre{white-space:pre-wrap;overflow-wrap:anywhere}th,td{text-align:left}
.wide{overflow-x:auto;max-width:100%}p,summary{overflow-wrap:anywhere}
"""


def interesting_buffers(record: RunRecord) -> list[str]:
    """Non-persistent buffers first (the usual suspects), else the first tensor."""
    t = record.tensors
    if t.empty or "name" not in t:
        return []
    names = list(dict.fromkeys(t[t["kind"] == "non-persistent buffer"]["name"]))
    return names[:2] or list(dict.fromkeys(t["name"]))[:1]


class _Page:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self._js_done = False
        self.n_figs = 0

    def h(self, level: int, text: str, anchor: str | None = None) -> None:
        a = f" id='{html.escape(anchor)}'" if anchor else ""
        self.parts.append(f"<h{level}{a}>{html.escape(text)}</h{level}>")

    def p(self, text: str, cls: str = "") -> None:
        c = f" class='{cls}'" if cls else ""
        self.parts.append(f"<p{c}>{html.escape(text)}</p>")

    def fig(self, fig: go.Figure) -> None:
        self.n_figs += 1
        # a wide table or figure scrolls in its own box, never the page
        self.parts.append("<div class='wide'>" + pio.to_html(fig, full_html=False, include_plotlyjs=not self._js_done,
                                                             config={"displaylogo": False},
                                                             div_id=f"wb-fig-{self.n_figs}") + "</div>")
        self._js_done = True

    def table(self, df: pd.DataFrame, max_rows: int = 60, cls: str = "") -> None:
        self.parts.append("<div class='wide'>" + df.head(max_rows).to_html(index=False, escape=True, na_rep="",
                                                                          classes=cls or None) + "</div>")
        if len(df) > max_rows:
            self.p(f"... {len(df) - max_rows} more rows", "muted")

    def render(self, title: str) -> str:
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<style>{CSS}</style></head><body>" + "\n".join(self.parts) + "</body></html>")


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        return str(ts)


def environment(records: list[RunRecord]) -> pd.DataFrame:
    """One row per setting, one column per run: where and with what each run was recorded."""
    rows: dict[str, dict[str, str]] = {}
    for rec in records:
        m = rec.manifest
        vals = {
            "scenario": m.get("scenario"), "incident": m.get("incident"),
            "fix": m.get("fix") or (None if m.get("job") else "(bug path)"),
            "ranks": m.get("ranks"), "backend": m.get("backend"),
            "devices": ", ".join(f"rank {r}: {d}" for r, d in (m.get("devices") or {}).items()),
            "poison": m.get("poison"), "seed": m.get("seed"), "collective timeout (s)": m.get("timeout_s"),
            "steps run": " → ".join(m.get("steps_run") or []),
            "started": _when(m.get("started_at")), "recorded": _when(m.get("saved_at")),
            **{f"{k} version": v for k, v in (m.get("versions") or {}).items()},
        }
        for k, v in vals.items():
            rows.setdefault(k, {})[rec.label] = "" if v is None else str(v)
    return pd.DataFrame([{"setting": k, **v} for k, v in rows.items()])


def timings(rec: RunRecord) -> pd.DataFrame:
    """Seconds each step took on each rank (from the manifest)."""
    steps, elapsed = rec.steps, rec.manifest.get("elapsed") or []
    rows = []
    for step, per in zip(steps, elapsed):
        if isinstance(per, dict):
            rows.append({"step": step, **{f"rank {r}": f"{t:.3f}" for r, t in per.items()
                                          if isinstance(t, (int, float))}})
    return pd.DataFrame(rows)


def _ledger_section(page: _Page, rec: RunRecord) -> None:
    """Collective swimlanes per step, when the run has a ledger (skipped when absent)."""
    ledger = getattr(rec, "ledger", None)
    if not isinstance(ledger, pd.DataFrame) or ledger.empty:
        return
    page.h(3, "Collective ledger")
    try:
        from workbench.viz.collectives import swimlane
    except ImportError:
        swimlane = None
    steps = list(dict.fromkeys(ledger["step"])) if "step" in ledger else [None]
    if swimlane is not None:
        for step in steps:
            page.fig(swimlane(ledger, step=step))
    cols = [c for c in ledger.columns if c not in ("traceback", "stack")]
    shown = ledger[cols].copy()
    if "error" in shown:
        shown["error"] = shown["error"].map(plain_backend)
    page.table(shown, max_rows=40)


def _hang_section(page: _Page, rec: RunRecord) -> None:
    """Each hang of the run: what caught it, the proof that its open calls cannot pair, and each stuck
    rank's innermost frames (the whole main thread one click further), from the manifest's hang records."""
    for h in rec.manifest.get("hangs") or []:
        page.h(3, f"Hang in step '{h.get('step')}'")
        page.p(stacks.headline(h))
        proof = stacks.proof(h)
        if proof:
            page.parts.append(f"<p class='proof'><b>proof</b>: {html.escape(proof)}</p>")
        div = (h.get("divergence") or {}).get("message")
        if div:
            page.p(f"first divergence: {div}")
        for row in stacks.stuck_ranks(h):
            where = row["where"]
            summary = f"rank {row['rank']}: " + (f"waits in {where}" if where and where != "no collective"
                                                 else where or "stack")
            if not row["innermost"]:
                body = "<p class='muted'>no stack was taken (an engine on another host, or it did not answer)</p>"
            else:
                body = f"<pre class='stack'>{html.escape(row['innermost'])}</pre>"
                if row["main_thread"] != row["innermost"]:
                    body += (f"<details><summary>whole main thread</summary>"
                             f"<pre class='stack'>{html.escape(row['main_thread'])}</pre></details>")
            page.parts.append(f"<details open><summary>{html.escape(summary)}</summary>{body}</details>")


def _worded_events(rec: RunRecord) -> pd.DataFrame:
    """The run's failures as a reader wants them: the workbench's words where the message is a backend's echo or
    an engine's task id (``frames.worded_failure``), from the hangs the record kept; the raw text stays in events."""
    hangs = rec.manifest.get("hangs") or []
    released = {(h.get("step"), int(r)): call for h in hangs if h.get("caught_by") == "ledger deadlock"
                for r, call in (h.get("stuck") or {}).items()}
    order = {step: i for i, step in enumerate(rec.steps)}
    first_release = min((order.get(step, len(order)) for step, _ in released), default=None)
    ev = rec.events[[c for c in ("step", "rank", "kind", "error", "message") if c in rec.events]].copy()
    if "message" in ev and "rank" in ev:
        ev["message"] = [worded_failure(row.kind, row.message, released.get((row.step, int(row.rank))),
                                        first_release is not None and order.get(row.step, -1) > first_release)
                         for row in ev.itertuples()]
    return ev


def _run_section(page: _Page, rec: RunRecord, i: int, found: pd.DataFrame) -> None:
    page.h(2, rec.label, anchor=f"run-{i}")
    _hang_section(page, rec)
    events = rec.events
    if len(events):
        page.h(3, "Per-rank failures")
        page.table(_worded_events(rec))
    if len(found):
        page.h(3, "Findings")
        shown = findings.deduplicated(found, rec.steps)
        if "finding" in shown:
            shown["finding"] = shown["finding"].map(plain_backend)
        page.table(shown)
    else:
        page.p("No findings: every rank holds the same tensors and outputs are clean.")
    page.h(3, "What every rank holds, step by step")
    for step in rec.steps:
        t = rec.tensors[rec.tensors["step"] == step] if len(rec.tensors) else rec.tensors
        if len(t):
            page.fig(viz.status_matrix(t, title=f"{rec.label} · after '{step}'"))
    buffers = interesting_buffers(rec)
    if buffers:
        page.h(3, "Buffer values per rank")
        last = last_step(rec.tensors)
        for name in buffers:
            page.fig(viz.buffer_values(rec.tensors, name))
            rows = last[last["name"] == name].copy()
            rows["head"] = rows["head"].map(lambda h: "[" + ", ".join(fmt(v) for v in list(h or [])[:8]) + "]")
            page.table(rows[[c for c in ("step", "rank", "dtype", "nan", "poisoned", "head", "fingerprint")
                             if c in rows]])
    _ledger_section(page, rec)
    if len(rec.outputs):
        out = last_step(rec.outputs)
        page.h(3, "Outputs")
        page.fig(viz.outputs_view(out, title=f"{rec.label} · outputs"))
        cols = [c for c in ("rank", "name", "dtype", "shape", "nan", "inf", "ref_max_abs_diff", "fingerprint")
                if c in out]
        page.table(out[cols])
    if rec.notes:
        page.h(3, "Notes from the ranks")
        page.table(pd.DataFrame(rec.notes))
    t = timings(rec)
    if len(t):
        page.h(3, "Step timings (s)")
        page.table(t)





def _what_happened(page: _Page, records: list[RunRecord]) -> None:
    """The diagnosis of the bug run first (sentence, then figure), then one line per other run."""
    page.h(2, "What happened", anchor="what-happened")
    bug = next((r for r in records if not r.manifest.get("fix")), records[0])
    d = diagnosis.diagnose(bug)
    page.parts.append(f"<p class='diagnosis'><b>{html.escape(bug.label)}</b>: {html.escape(d.sentence)}</p>")
    if not d.clean:
        page.fig(diagnosis_figure(d, title="Where it started (outlined): what each rank held after each step"))
    for rec in records:
        if rec is bug:
            continue
        # The fix run's own diagnosis and where it parts from the bug path: what ``diagnose_comparison`` adds to
        # the bug run's, which is said above (it diagnosed the bug run again for every fix run: ~0.15 s each).
        part = diagnosis.parted(bug, rec) if not d.clean else None
        own = diagnosis.diagnose(rec)
        where = (f" It parts from the bug path at step `{part['step']}` (rank {part['rank']} "
                 f"`{diagnosis.short(part['name'], list(dict.fromkeys(rec.tensors['name'])))}`: {part['what']})."
                 if part else "")
        page.parts.append(f"<p class='diagnosis'><b>{html.escape(rec.label)}</b>: {html.escape(own.sentence)}."
                          f"{html.escape(where)}</p>")


def _finding_counts(records: list[RunRecord], found: list[pd.DataFrame]) -> pd.DataFrame:
    rows = []
    for rec, f in zip(records, found):
        last = rec.steps[-1] if rec.steps else None
        at_end = f[f["step"] == last] if last is not None and len(f) else f
        rows.append({"run": rec.label, "findings (all steps)": len(f),
                     "errors at the last step": int((at_end["severity"] == "error").sum()) if len(at_end) else 0,
                     "warnings at the last step": int((at_end["severity"] == "warning").sum()) if len(at_end) else 0,
                     "failed ranks": len(rec.events)})
    return pd.DataFrame(rows)


def render(records: Iterable[RunRecord]) -> str:
    """HTML for a bug run and any fix runs of one scenario (a list of records, or a Bundle)."""
    records = list(records)
    if not records:
        raise ValueError("nothing to report: no runs")
    first = records[0].manifest
    page = _Page()
    scenario, title = str(first.get("scenario", "?")), str(first.get("title", ""))
    page.h(1, title if title.startswith(f"{scenario}:") else f"{scenario}: {title}")  # a job's title names it
    nav = " ".join(f"<a href='#run-{i}'>{html.escape(r.label)}</a>" for i, r in enumerate(records))
    page.parts.append(f"<nav><a href='#what-happened'>what happened</a> <a href='#environment'>environment</a> {nav}"
                      + (" <a href='#compare'>bug vs fix</a>" if len(records) > 1 else "") + "</nav>")
    _what_happened(page, records)
    page.h(2, "Environment", anchor="environment")
    page.table(environment(records), max_rows=100, cls="env")
    page.h(3, "Parameters")
    page.parts.append(f"<pre>{html.escape(json.dumps(first.get('params', {}), default=str))}</pre>")
    if first.get("fixes"):
        page.h(3, "Fixes")
        page.table(pd.DataFrame([{"fix": k, "what it does": v} for k, v in first["fixes"].items()]))
    found = [rec.findings() for rec in records]
    page.h(3, "Summary")
    page.table(_finding_counts(records, found))
    for i, rec in enumerate(records):
        _run_section(page, rec, i, found[i])
    bug = next((r for r in records if not r.manifest.get("fix")), None)
    first_cmp = True
    for rec in records:
        if bug is not None and rec is not bug:
            page.h(2, f"Bug vs {rec.label}", anchor="compare" if first_cmp else None)
            first_cmp = False
            page.fig(viz.comparison(bug.tensors, rec.tensors, rec.manifest["fix"]))
            both = pd.concat([_last_outputs(bug, "bug"), _last_outputs(rec, rec.label)], ignore_index=True)
            if len(both):
                page.fig(viz.outputs_view(both, title="Outputs: bug vs fix"))
    return page.render(str(first.get("scenario", "workbench report")))


def _last_outputs(rec: RunRecord, label: str) -> pd.DataFrame:
    out = last_step(rec.outputs).copy()
    if out.empty:
        return out
    out.insert(0, "run", label)
    return out


def write(records: Iterable[RunRecord], path: str | Path) -> Path:
    """Render and write atomically (temporary sibling, then rename)."""
    path = Path(path)
    if path.is_dir():
        raise WorkbenchError(f"{path} is a directory; give a file name such as {path / 'report.html'}")
    return write_atomic(path, render(records))


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to a temporary sibling, then rename it into place: a full disk or a crash mid-write
    leaves the old file (or none), never a truncated one under the chosen name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique temporary name: two writers of one file never share (or clobber) a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    written = False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        written = True
    finally:
        if not written:  # whatever stopped the write (a full disk, Ctrl-C): no temporary left behind
            Path(tmp).unlink(missing_ok=True)
    return path
