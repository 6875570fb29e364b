"""A scenario stepped on live ranks: frames in, history out, bug against fix.

Nothing a step does on a rank can lose the history: exceptions, missed deadlines and
dead engines all land in the frame of the step they happened in.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from workbench import scenarios
from workbench.analysis import collectives, deadlock, diagnosis
from workbench.analysis.frames import Frame, last_step
from workbench.errors import RankFailure, UnknownName, WorkbenchError
from workbench.live import progress as live_progress
from workbench.postmortem import bundle
from workbench.postmortem.record import SCHEMA_VERSION, RunRecord, versions
from workbench.rank.byname import RankFn
from workbench.scenario import Scenario

if TYPE_CHECKING:
    from workbench.live.engines import Engines

# The rank-side entry points (workbench.rank.remote), by name: the client never imports torch to call them.
START_SESSION, RUN_STEP, END_SESSION = (RankFn("workbench.rank.remote", n) for n in
                                        ("start_session", "run_step", "end_session"))


class Session:
    """One run of a scenario (one fix, one poison setting) on a cluster's ranks."""

    def __init__(self, cluster: Engines, scenario: str | Scenario, fix: str | None = None,
                 poison: bool = True, params: dict[str, Any] | None = None,
                 progress: bool | Callable[[str], Any] | None = None):
        self.cluster = cluster
        self.scenario = scenarios.resolve(scenario)
        self.scenario.check_fix(fix)
        self.fix = fix
        self.poison = poison
        self.params = self.scenario.resolve_params(params)
        self.id = f"{self.scenario.name}-{uuid.uuid4().hex[:8]}"
        self.frames: list[Frame] = []
        self.started_at: float | None = None
        self.updated_at: float | None = None  # when the last step ended: what "recorded" means
        self._begun = False
        self._generation = -1  # the cluster generation this session's rank state lives in
        self.ledger_dir = tempfile.mkdtemp(prefix=f"wb-ledger-{self.id}-")  # ranks append, the client reads
        self._ledger_reader = collectives.LedgerReader(self.ledger_dir)
        self.deadline: float | None = None  # per-step deadline; None: cluster.step_deadline or cluster.deadline
        self.attempt = 0  # bumped by recover(): ledger sequence numbers restart per attempt
        self._recovery: dict[str, Any] | None = None  # the last recover()'s info, until the next frame notes it
        # A step running past a second shows where the ranks are (live/progress.py): True draws it in the
        # notebook or on stderr, False not at all, a callable gets each line ("" when the step ended);
        # None: the cluster's setting (``cluster.progress``).
        self.progress = progress

    # -- stepping ---------------------------------------------------------------------
    @property
    def steps(self) -> list[str]:
        return self.scenario.step_names

    @property
    def next_step(self) -> str | None:
        return self.steps[len(self.frames)] if len(self.frames) < len(self.steps) else None

    @property
    def done(self) -> bool:
        return self.next_step is None

    def _begin(self) -> None:
        cluster = self.cluster
        if cluster.needs_recovery:
            cluster.recover()  # a rank stuck or dead after an earlier hang: bring the ranks back first
        if cluster.dirty:
            cluster.form_group()  # a failed collective leaves the group unusable: form a fresh one
        if not os.path.isdir(self.ledger_dir):  # closed (or reset) earlier: a fresh dir, the rows read stay
            self.ledger_dir = self._ledger_reader.source = tempfile.mkdtemp(prefix=f"wb-ledger-{self.id}-")
        cluster.run(START_SESSION, self.id, self.fix, self.params, self.poison,
                    ledger_dir=self.ledger_dir, attempt=self.attempt)
        self.started_at = self.updated_at = time.time()
        self._begun = True
        self._generation = cluster.generation

    def step(self) -> Frame:
        """Run the next step on every rank and probe what each rank then holds."""
        if self.done:
            raise WorkbenchError(f"all {len(self.steps)} steps ran; call reset() to start again")
        if not self._begun:
            self._begin()
        elif self._generation != self.cluster.generation:
            raise WorkbenchError(
                f"the ranks were re-formed (recover or restart) after {len(self.frames)} step(s) of this session, "
                "so they no longer hold its objects: s.recover() replays the steps so far, s.reset() starts over")
        index = len(self.frames)
        name, fn = self.scenario.steps[index]
        deadline = self.deadline or self.cluster.step_deadline or self.cluster.deadline
        dead = self.cluster.dead_ranks()  # died between steps: the frame names them, nothing runs without them
        watch = None
        if dead:
            values, failures = {}, {r: RankFailure(r, "died", "EngineDied", f"engine process {self.cluster.pids[r]} "
                                                   "exited before this step; call cluster.restart()") for r in dead}
        else:
            ranks = list(range(self.cluster.world_size))
            detect = self.cluster.detect_deadlocks
            if detect if detect is not None else self.cluster.backend == "nccl":
                watch = deadlock.Watch(lambda: self._ledger(step=name), ranks)
            sink = live_progress.sink_for(self.progress if self.progress is not None
                                          else getattr(self.cluster, "progress", True))
            line = live_progress.StepLine(sink, ranks, lambda: self._open_calls(name)) if sink is not None else None
            try:
                outcome = self.cluster.call(RUN_STEP, self.id, fn, self.scenario.probe, timeout=deadline,
                                            watch=live_progress.poll_with(line, watch), step=name)
            finally:
                if line is not None:
                    line.close()
            values, failures = outcome.values, outcome.failures
        frame = Frame.build(name, index, self.scenario.name, self.fix, values, failures)
        rows = [dict(r) for r in self._ledger_rows(step=name)]  # as of now: later reads update rows in place
        frame.ledger = lambda: collectives.ledger_table(rows)  # a table only when asked (~10 ms a step)
        errored = frame.ranks_with("error")  # raw events: a clean step builds no table it was not asked for
        if (failures or errored or collectives.any_timed_out(rows)) \
                and collectives.is_hang(failures, frame.ledger, errored):
            frame.hang = collectives.diagnose(name, frame.ledger, failures,
                                              list(range(self.cluster.world_size)), deadline)
            stuck = sorted(frame.hang.stuck)
            frame.hang.stacks = self.cluster.stacks(stuck) if stuck else {}
            if watch is not None and watch.found is not None:
                frame.hang.proof = watch.found.reason
                frame.hang.blocked_at = watch.blocked_at
                frame.hang.declared_at = time.time()
        if not frame.ok:
            self.cluster.dirty = True
        if self._recovery is not None:
            frame.notes = {r: [*frame.notes.get(r, []), _recovery_note(self._recovery)]
                           for r in range(self.cluster.world_size)}
            self._recovery = None
        self.frames.append(frame)
        self.updated_at = time.time()
        return frame

    def run(self, until: str | None = None) -> list[Frame]:
        """Step through ``until`` (inclusive) or to the end; stops early if a rank died or hung."""
        if until is not None and until not in self.steps:
            raise UnknownName(f"step of {self.scenario.name}", until, self.steps)
        out = []
        while not self.done:
            frame = self.step()
            out.append(frame)
            if {"died", "timeout"} & frame.kinds or frame.step == until:
                break
        return out

    def reset(self) -> Session:
        """Drop the frames and the ranks' objects; the next step starts from the first."""
        self.close()
        self.frames = []
        self._begun = False
        self.attempt += 1  # a fresh ledger sequence on the ranks
        return self

    def close(self) -> None:
        """Free what the ranks hold for this session (models, ledger file, work dirs) and the
        session's temp dirs; the frames and the ledger rows read so far stay here."""
        if self._begun and self.cluster.alive and not self.cluster.needs_recovery \
                and self._generation == self.cluster.generation:
            self.cluster.call(END_SESSION, self.id)
        self._begun = False
        self._ledger_reader.poll()  # the rows first: a bundle saved later still holds them
        shutil.rmtree(self.ledger_dir, ignore_errors=True)
        # Ranks on this host that could not clean up themselves (dead, stuck, re-formed): their work dirs.
        for d in glob.glob(os.path.join(tempfile.gettempdir(), f"wb-{self.id}-r*")):
            shutil.rmtree(d, ignore_errors=True)

    # -- reading ----------------------------------------------------------------------
    @property
    def history(self) -> pd.DataFrame:
        """Every frame's tensor rows, with ``step`` and ``step_index`` columns in front."""
        return _stack(self.frames, "tensors")

    @property
    def outputs(self) -> pd.DataFrame:
        return _stack(self.frames, "outputs")

    @property
    def events(self) -> pd.DataFrame:
        return _stack(self.frames, "events")

    def _ledger_rows(self, step: str | None = None, attempt: int | None = None) -> list[dict[str, Any]]:
        self._ledger_reader.poll()
        where: dict[str, Any] = {"attempt": self.attempt if attempt is None else attempt}
        if step is not None:
            where["step"] = step
        return self._ledger_reader.calls(**where)

    def _ledger(self, step: str | None = None, attempt: int | None = None) -> pd.DataFrame:
        return collectives.ledger_table(self._ledger_rows(step, attempt))

    def _open_calls(self, step: str) -> list[dict[str, Any]]:
        """The step's calls some rank is still inside, as raw rows (cheap: no table of every call)."""
        self._ledger_reader.poll()
        return self._ledger_reader.calls(attempt=self.attempt, step=step, state=collectives.OPEN)

    @property
    def ledger(self) -> pd.DataFrame:
        """Every collective the ranks issued in this session's steps (all attempts), read live from disk."""
        self._ledger_reader.poll()
        return collectives.ledger_table(self._ledger_reader.calls())

    @property
    def hangs(self) -> list[Frame]:
        return [f for f in self.frames if f.hang is not None]

    def recover(self, replay_failed: bool = False, wait: float | None = None) -> dict[str, Any]:
        """After a hang or a failed step: bring the ranks back (``cluster.recover()``) and re-run the
        steps before the first failed one, and that one too with ``replay_failed=True``.

        The failed frame stays in the history. Without ``replay_failed`` the next step runs on
        ranks that never ran the failed one (what a hung step needs: replaying it would hang
        again); the returned info (``replayed``, ``not_replayed``) and the next frame's notes
        say which steps the ranks hold. The ledger starts a new attempt. ``wait``: see
        ``Engines.recover`` (how long ranks still blocked after the abort get before a restart).
        """
        info = self.cluster.recover(wait=wait)
        failed = next((i for i, f in enumerate(self.frames) if not f.ok), len(self.frames))
        upto = failed + 1 if replay_failed and failed < len(self.frames) else failed
        self.attempt += 1
        self._begun = False
        self._begin()
        for name, fn in self.scenario.steps[:upto]:
            out = self.cluster.call(RUN_STEP, self.id, fn, [], step=name, timeout=self.cluster.deadline)
            errors = [f.line() for f in out.failures.values()]
            errors += [f"rank {r} error: {v['error']['error']}: {v['error']['message'][:300]}"
                       for r, v in sorted(out.values.items()) if v["error"]]
            if errors:
                raise WorkbenchError(f"replaying step {name!r} after recovery failed: " + "; ".join(errors))
        info["replayed"] = self.steps[:upto]
        info["not_replayed"] = self.steps[upto:len(self.frames)]
        self._recovery = info  # the next frame says what the ranks were given back
        return info

    @property
    def trace(self) -> pd.DataFrame:
        """Forward-trace rows (one per module call) of every step that traced a forward."""
        return _stack(self.frames, "trace")

    def findings(self) -> pd.DataFrame:
        """What the detectors say about every step so far (same code as a loaded bundle)."""
        return self.record().findings()

    def diagnose(self) -> diagnosis.Diagnosis:
        """The first cause of what went wrong so far, in one sentence, with its evidence (``clean`` if none)."""
        return diagnosis.diagnose(self.record())

    def record(self) -> RunRecord:
        """This run as plain tables plus a manifest: what bundles, reports and views take."""
        c = self.cluster
        notes = [{"step": f.step, "rank": r, "note": n} for f in self.frames for r, ns in f.notes.items() for n in ns]
        manifest = {
            "schema": SCHEMA_VERSION,
            "scenario": self.scenario.name,
            "title": self.scenario.title,
            "incident": self.scenario.incident,
            "fix": self.fix,
            "fixes": dict(self.scenario.fixes),
            "poison": self.poison,
            "params": dict(self.params),
            "steps": self.steps,
            "steps_run": [f.step for f in self.frames],
            "hangs": [f.hang.to_dict() for f in self.frames if getattr(f, "hang", None) is not None],
            "elapsed": [{str(r): t for r, t in f.elapsed.items()} for f in self.frames],
            "ranks": c.world_size,
            "backend": c.backend,
            "devices": {str(r): d for r, d in c.devices.items()},
            "timeout_s": c.timeout,
            "seed": self.params.get("seed"),
            "started_at": self.started_at,
            "saved_at": self.updated_at,  # the state recorded, not the call: two records of it are equal
            "versions": versions(),
        }
        return RunRecord(manifest, self.history, self.outputs, self.events, notes, trace=self.trace,
                         ledger=self.ledger)

    def records(self) -> list[RunRecord]:
        """What the postmortem layer saves: one record (a Comparison gives two)."""
        return [self.record()]

    def to_flight_recorder(self, out_dir: str | os.PathLike) -> list[Path]:
        """This session's ledger as Flight Recorder dumps for PyTorch's analyser (see ``RunRecord``)."""
        return self.record().to_flight_recorder(out_dir)

    def save(self, path: str | os.PathLike) -> Path:
        """Save this run as a postmortem bundle (see ``workbench.bundle``); returns the file."""
        return bundle.save(self, path)

    @property
    def last(self) -> Frame | None:
        return self.frames[-1] if self.frames else None

    def compare(self, fix: str, poison: bool | None = None) -> Comparison:
        """Run ``fix`` to the end on the same ranks, next to this session run to the end."""
        self.scenario.check_fix(fix)
        if not self.done:
            self.run()
        other = Session(self.cluster, self.scenario, fix=fix,
                        poison=self.poison if poison is None else poison, params=self.params)
        other.run()
        return Comparison(bug=self, fixed=other)

    def __repr__(self) -> str:
        return (f"<Session {self.scenario.name} fix={self.fix} poison={self.poison} "
                f"{len(self.frames)}/{len(self.steps)} steps, next={self.next_step}>")


def _recovery_note(info: dict[str, Any]) -> str:
    note = f"after recovery ({info['action']}): replayed {', '.join(info['replayed']) or 'no steps'}"
    for name in info["not_replayed"]:
        note += (f"; step {name!r} was not replayed, so the ranks never ran it "
                 "(s.recover(replay_failed=True) replays it)")
    return note


def _stack(frames: list[Frame], attr: str) -> pd.DataFrame:
    parts = []
    for f in frames:
        df = getattr(f, attr).copy()
        df.insert(0, "step_index", f.index)
        df.insert(0, "step", f.step)
        parts.append(df)
    if not parts:
        return pd.DataFrame()
    return pd.concat(parts, ignore_index=True)


@dataclass
class Comparison:
    """The bug path and one fix, run on the same ranks, ready to put side by side."""

    bug: Session
    fixed: Session

    @property
    def fix(self) -> str | None:
        return self.fixed.fix

    def outputs(self) -> pd.DataFrame:
        """Last outputs per rank of both runs, a ``run`` column telling them apart."""
        parts = []
        for label, s in (("bug", self.bug), ("fix: " + str(self.fix), self.fixed)):
            df = last_step(s.outputs).copy()
            if len(df):
                df.insert(0, "run", label)
                parts.append(df)
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def records(self) -> list[RunRecord]:
        """The bug path's record, then the fix's: what a bundle of the comparison holds."""
        return [self.bug.record(), self.fixed.record()]

    def diagnose(self) -> diagnosis.Diagnosis:
        """The bug run's diagnosis, the fix's own, and the first step where the two runs part."""
        return diagnosis.diagnose_comparison(self.bug.record(), self.fixed.record())

    def __repr__(self) -> str:
        return f"<Comparison bug vs fix={self.fix}>"
