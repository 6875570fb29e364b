"""An ipywidgets stepper: next step / run / skip / reset, a fix selector, and a history slider over a
live FigureWidget.

Client only. The figure is the same ``viz.status_matrix`` a report shows; the stepper
only swaps its data in place after each step. The slider walks ``session.log`` (every frame
taken, replays included) without running anything; "Rerun to here" replays the session up
to the frame's step on the same engines (``session.goto``).
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
        self.skip = widgets.Button(description="Skip", icon="forward", tooltip="move past the failed step")
        self.history = widgets.IntSlider(value=0, min=0, max=0, description="history", continuous_update=False)
        self.rerun = widgets.Button(description="Rerun to here", icon="history",
                                    tooltip="replay from the start up to the step shown (session.goto)")
        self.shown = widgets.HTML()  # which frame the figure shows
        self.status = widgets.HTML()
        self.diagnosis = widgets.HTML()  # the current diagnosis, under the buttons
        self.progress = widgets.HTML()  # while a long step runs: who is done, who waits in which collective
        if session.progress is None:  # a button's step has no cell to print into: the line lives here
            session.progress = self._show_progress
        self.next.on_click(lambda _: self.step())
        self.run_all.on_click(lambda _: self.run())
        self.reset.on_click(lambda _: self.restart())
        self.skip.on_click(lambda _: self.skip_step())
        self.rerun.on_click(lambda _: self.rerun_to_here())
        self.history.observe(self._on_history, names="value")
        self.fix.observe(self._on_fix, names="value")
        self.widget = widgets.VBox([widgets.HBox([self.next, self.run_all, self.skip, self.reset, self.fix]),
                                    widgets.HBox([self.history, self.rerun, self.shown]),
                                    self.diagnosis, self.status, self.progress, self.figure])
        self._update()

    def _figure(self, frame=None) -> go.Figure:
        frame = self.session.last if frame is None else frame
        if frame is None or frame.tensors.empty:
            fig = go.Figure(go.Heatmap(z=[[0]], x=["(no step yet)"], y=["rank 0"], showscale=False))
            fig.update_layout(title=f"{self.session.scenario.name}: press 'Next step'", height=300)
            return fig
        return viz.status_matrix(frame.tensors, title=f"after '{frame.step}' (fix: {frame.fix})")

    def _draw(self, frame=None) -> None:
        fresh = self._figure(frame)
        with self.figure.batch_update():
            # the whole figure: the status view has one trace per status (a categorical legend)
            self.figure.data = ()
            self.figure.add_traces(list(fresh.data))
            self.figure.layout = fresh.layout

    def _update(self) -> None:
        s = self.session
        log = s.log
        self.history.max = max(0, len(log) - 1)
        self.history.value = max(0, len(log) - 1)  # may call _on_history: it draws the same frame
        self._draw()
        self.shown.value = self._label(log[-1]) if log else ""
        self.rerun.disabled = not log
        self.skip.disabled = s.done or s.cursor >= len(s.frames)  # only a failed step at the cursor
        self.diagnosis.value = self._diagnosis()
        lines = [f"<b>{html.escape(s.scenario.name)}</b> · step {s.cursor}/{len(s.steps)}"
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

    def skip_step(self) -> None:
        self._guarded(self.session.skip)

    def rerun_to_here(self) -> None:
        """Replay the session up to the step of the frame the slider shows (runs on the ranks)."""
        log = self.session.log
        if log:
            step = log[min(self.history.value, len(log) - 1)].step
            self._guarded(lambda: self.session.goto(step))

    def _on_history(self, change: dict) -> None:
        """Show an earlier frame from the log: nothing runs."""
        log = self.session.log
        if not log:
            return
        frame = log[min(change["new"], len(log) - 1)]
        self._draw(frame)
        self.shown.value = self._label(frame)

    @staticmethod
    def _label(frame) -> str:
        how = "replay" if getattr(frame, "replayed", False) else "run"
        state = "ok" if frame.ok else "failed"
        return f"<code>{html.escape(frame.step)}</code> ({how}, {state}, fix: {html.escape(str(frame.fix))})"

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
