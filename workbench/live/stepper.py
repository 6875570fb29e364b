"""An ipywidgets stepper: next step / run / reset and a fix selector over a live FigureWidget.

Client only. The figure is the same ``viz.status_matrix`` a report shows; the stepper
only swaps its data in place after each step.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import plotly.graph_objects as go

from workbench import viz
from workbench.errors import WorkbenchError
from workbench.live.session import Session

NO_FIX = "(bug path)"


class Stepper:
    """Drive a session from buttons; ``stepper.session`` is the live one."""

    def __init__(self, session: Session):
        self.session = session
        self.figure = go.FigureWidget(self._figure())
        fixes = [NO_FIX, *session.scenario.fixes]
        self.fix = widgets.Dropdown(options=fixes, value=session.fix or NO_FIX, description="fix")
        self.next = widgets.Button(description="Next step", button_style="primary", icon="step-forward")
        self.run_all = widgets.Button(description="Run all", icon="fast-forward")
        self.reset = widgets.Button(description="Reset", icon="undo")
        self.status = widgets.HTML()
        self.diagnosis = widgets.HTML()  # the current diagnosis, under the buttons
        self.progress = widgets.HTML()  # while a long step runs: who is done, who waits in which collective
        if session.progress is None:  # a button's step has no cell to print into: the line lives here
            session.progress = self._show_progress
        self.next.on_click(lambda _: self.step())
        self.run_all.on_click(lambda _: self.run())
        self.reset.on_click(lambda _: self.restart())
        self.fix.observe(self._on_fix, names="value")
        self.widget = widgets.VBox([widgets.HBox([self.next, self.run_all, self.reset, self.fix]),
                                    self.diagnosis, self.status, self.progress, self.figure])
        self._update()

    def _figure(self) -> go.Figure:
        frame = self.session.last
        if frame is None or frame.tensors.empty:
            fig = go.Figure(go.Heatmap(z=[[0]], x=["(no step yet)"], y=["rank 0"], showscale=False))
            fig.update_layout(title=f"{self.session.scenario.name}: press 'Next step'", height=300)
            return fig
        return viz.status_matrix(frame.tensors, title=f"after '{frame.step}' (fix: {self.session.fix})")

    def _update(self) -> None:
        fresh = self._figure()
        with self.figure.batch_update():
            # the whole figure: the status view has one trace per status (a categorical legend)
            self.figure.data = ()
            self.figure.add_traces(list(fresh.data))
            self.figure.layout = fresh.layout
        s = self.session
        self.diagnosis.value = self._diagnosis()
        lines = [f"<b>{html.escape(s.scenario.name)}</b> · step {len(s.frames)}/{len(s.steps)}"
                 f" · next: {html.escape(str(s.next_step))}"]
        if s.last is not None:
            for rank, msg in s.last.rank_errors.items():
                lines.append(f"<span style='color:#b00'>rank {rank}: {html.escape(msg[:200])}</span>")
        self.status.value = "<br>".join(lines)

    def _diagnosis(self) -> str:
        if not self.session.frames:
            return ""
        d = self.session.diagnose()
        color = "#2ca02c" if d.clean else "#b00"
        return (f"<div style='border-left:4px solid {color};padding:2px 8px;margin:4px 0'>"
                f"<b>diagnosis ({html.escape(d.mechanism)})</b>: {html.escape(d.sentence)}</div>")

    def _guarded(self, action) -> None:
        """Run a button's action; a workbench error shows in the status line, not in a lost log."""
        try:
            action()
        except WorkbenchError as exc:
            self._update()
            self.status.value += f"<br><span style='color:#b00'>{html.escape(str(exc))}</span>"
            return
        self._update()

    def step(self) -> None:
        self._guarded(lambda: None if self.session.done else self.session.step())

    def run(self) -> None:
        self._guarded(self.session.run)

    def restart(self) -> None:
        self._guarded(self.session.reset)

    def _on_fix(self, change: dict) -> None:
        fix = None if change["new"] == NO_FIX else change["new"]
        old = self.session

        def switch() -> None:
            old.close()  # free the ranks; the old session's frames stay with whoever holds it
            self.session = Session(old.cluster, old.scenario, fix=fix, poison=old.poison, params=old.params,
                                   progress=old.progress)

        self._guarded(switch)

    def _show_progress(self, line: str) -> None:
        self.progress.value = f"<code>{html.escape(line)}</code>" if line else ""

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def stepper(session: Session) -> Stepper:
    return Stepper(session)
