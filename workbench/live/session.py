"""A scenario stepped on live ranks: frames in, history out, bug against fix.

Nothing a step does on a rank can lose the history: exceptions, missed deadlines and
dead engines all land in the frame of the step they happened in.
"""

from __future__ import annotations

import glob
import logging
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
from workbench.analysis import collectives, diagnosis
from workbench.analysis.collectives import describe
from workbench.analysis.frames import Frame, last_step
from workbench.analysis.frames import stack as _stack
from workbench.errors import LOST, RankFailure, UnknownName, WorkbenchError
from workbench.live import progress as live_progress
from workbench.live.release import Release
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
        self.cursor = 0  # the step the next step() runs (see "stepping" below)
        self.log: list[Frame] = []  # every frame ever taken, in order: runs, reruns, replays
        self.departures: list[dict[str, Any]] = []  # replayed steps whose fingerprints differ from the run's
        self._skipped: set[int] = set()  # steps skip() moved past: a replay leaves them out too
        self.stepping = False  # a step is running on the ranks: ledger reads now are partial by nature
        self.steps_begun = 0
        self._held: int | None = None  # how many steps the ranks hold for this session; None: a half-run step
        self._begun_with: tuple | None = None  # (fix, params, poison) the ranks' context was started with
        # A step running past a second shows where the ranks are (live/progress.py): True draws it in the
        # notebook or on stderr, False not at all, a callable gets each line ("" when the step ended);
        # None: the cluster's setting (``cluster.progress``).
        self.progress = progress

    # -- stepping ---------------------------------------------------------------------
    # A debugger's cursor: ``cursor`` is the index of the step the next ``step()`` runs. A step that
    # fails stops the cursor *at* it (``step()`` runs it again, ``skip()`` moves past it); one whose only
    # failure is the incident's collective (a deadlock released, a collective timed out: every rank
    # returned) lets it go on, as the job's ranks would. ``frames`` is the timeline the ranks hold
    # (frames[i] is step i's latest frame, the failed one at the cursor included); ``log`` keeps every
    # frame ever taken (runs, reruns, replays), for a history view that runs nothing.
    @property
    def steps(self) -> list[str]:
        return self.scenario.step_names

    @property
    def next_step(self) -> str | None:
        return self.steps[self.cursor] if self.cursor < len(self.steps) else None

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
        self.started_at = self.started_at or time.time()
        self.updated_at = time.time()
        self._begun = True
        self._generation = cluster.generation
        self._begun_with = self._config()
        self._held = 0

    def _config(self) -> tuple:
        return (self.fix, repr(sorted(self.params.items())), self.poison)

    def _in_sync(self) -> bool:
        """Whether the ranks hold exactly what the steps before the cursor built, under today's settings."""
        # A rank that died since is not a reason to replay: the step's frame names it (recover() brings it back).
        return (self._begun and self._held == self.cursor and self._generation == self.cluster.generation
                and self._begun_with == self._config())

    def step(self) -> Frame:
        """Run the step at the cursor on every rank and probe what each rank then holds.

        The ranks are first brought to the cursor if they are not there (after a failed step, a
        recovery, a changed fix or parameter): replayed from the start on the same engines.
        """
        if self.done:
            raise WorkbenchError(f"all {len(self.steps)} steps ran; call reset() to start again, "
                                 "s.goto(step) or s.rewind() to go back")
        self.scenario.check_fix(self.fix)
        self.params = self.scenario.resolve_params(self.params)
        if not self._in_sync():
            self._replay(self.cursor)
        frame = self._run_one(self.cursor)
        if self._recovery is not None:
            frame.notes = {r: [*frame.notes.get(r, []), _recovery_note(self._recovery)]
                           for r in range(self.cluster.world_size)}
            self._recovery = None
        self._place(frame)
        if _goes_on(frame):
            if not frame.ok:
                _note_all(frame, self.cluster.world_size, _WENT_ON)
            self.cursor += 1
            self._held = self.cursor
        else:
            self._held = None  # the ranks hold a half-run step: the next step() replays up to it first
            _note_all(frame, self.cluster.world_size,
                      f"the cursor stays at {frame.step!r}: s.step() runs it again (after replaying the steps "
                      "before it), s.skip() moves past it")
        self.updated_at = time.time()
        return frame

    def _place(self, frame: Frame) -> None:
        self.frames = [*self.frames[:frame.index], frame]
        self.log.append(frame)

    def _run_one(self, index: int, replay: bool = False) -> Frame:
        """Run step ``index`` on every rank (the ranks hold the steps before it) into a frame."""
        name, fn = self.scenario.steps[index]
        deadline = self.deadline or self.cluster.step_deadline or self.cluster.deadline
        dead = self.cluster.dead_ranks()  # died between steps: the frame names them, nothing runs without them
        watch = None
        if dead:
            values, failures = {}, {r: RankFailure(r, "died", "EngineDied", f"engine process {self.cluster.pids[r]} "
                                                   "exited before this step; call cluster.restart()") for r in dead}
        else:
            ranks = list(range(self.cluster.world_size))
            if self.cluster.detect_deadlocks is not False:
                watch = Release(self.cluster, lambda: self._ledger(step=name), ranks,
                                any_open=lambda: bool(self._open_calls(name)))
            sink = live_progress.sink_for(self.progress if self.progress is not None
                                          else getattr(self.cluster, "progress", True))
            line = live_progress.StepLine(sink, ranks, lambda: self._open_calls(name)) if sink is not None else None
            self.stepping, self.steps_begun = True, self.steps_begun + 1
            try:
                outcome = self.cluster.call(RUN_STEP, self.id, fn, self.scenario.probe, timeout=deadline,
                                            watch=live_progress.poll_with(line, watch),
                                            busy=lambda open_: self._outside_collectives(name, open_), step=name)
            finally:
                self.stepping = False
                if line is not None:
                    line.close()
            values, failures = outcome.values, outcome.failures
            if watch is not None and watch.released:
                values = _released_failed(values, watch)
        frame = Frame.build(name, index, self.scenario.name, self.fix, values, failures)
        frame.replayed = replay
        frame.halted = {r for r, v in values.items() if v.get("halted")}  # raised where later steps cannot go on
        frame.released = dict(watch.released) if watch is not None else {}
        rows = [dict(r) for r in self._ledger_rows(step=name)]  # as of now: later reads update rows in place
        frame.ledger = lambda: collectives.ledger_table(rows)  # a table only when asked (~10 ms a step)
        errored = frame.ranks_with("error")  # raw events: a clean step builds no table it was not asked for
        declared = watch is not None and watch.found is not None
        if declared or ((failures or errored or collectives.any_timed_out(rows))
                        and collectives.is_hang(failures, frame.ledger, errored)):
            frame.hang = collectives.diagnose(name, frame.ledger, failures,
                                              list(range(self.cluster.world_size)), deadline)
            if declared:
                self._note_release(frame, watch)
            else:
                stuck = sorted(frame.hang.stuck)
                frame.hang.stacks = self.cluster.stacks(stuck) if stuck else {}
        if not frame.ok or declared:
            self.cluster.dirty = True  # a failed collective (or an aborted communicator) leaves the group unusable
        return frame

    def _note_release(self, frame: Frame, watch: Release) -> None:
        """A deadlock the ledgers proved: the hang says who waited where, the notes what was released."""
        hang = frame.hang
        hang.caught_by = "ledger deadlock"
        hang.proof = watch.found.reason
        hang.blocked_at, hang.declared_at = watch.blocked_at, watch.declared_at
        hang.stuck = {r: describe(c) for r, c in sorted(watch.found.waiting.items())}  # where they were stuck
        hang.finished = [r for r in hang.finished if r not in hang.stuck]  # a released call returned, it did not finish
        if len(hang.ranks):
            waits = hang.ranks["rank"].map(hang.stuck)
            held = waits.notna()
            hang.ranks.loc[held, "status"] = "inside " + waits[held] + " (released: it could never pair)"
        hang.stacks = watch.stacks
        for r, lines in watch.notes().items():
            frame.notes[r] = [*frame.notes.get(r, []), *lines]

    def run(self, until: str | None = None) -> list[Frame]:
        """Step through ``until`` (inclusive) or to the end; stops at a step that failed (the cursor stays
        there) and goes on past one whose only failure is the incident's collective."""
        if until is not None and until not in self.steps:
            raise UnknownName(f"step of {self.scenario.name}", until, self.steps)
        out = []
        while not self.done:
            frame = self.step()
            out.append(frame)
            if self.cursor == frame.index or frame.step == until:
                break
        return out

    def skip(self) -> Frame:
        """Move the cursor past the step it stands at, without running it again; the frame says so.

        The ranks keep what they hold (a failed step's leftovers included); a later replay skips it too.
        """
        if self.done:
            raise WorkbenchError(f"all {len(self.steps)} steps ran; nothing to skip")
        index = self.cursor
        if index >= len(self.frames):
            raise WorkbenchError(f"step {self.steps[index]!r} has not run: s.skip() moves past a failed step; "
                                 "s.step() runs this one")
        frame = self.frames[index]
        _note_all(frame, self.cluster.world_size,
                  "skipped by s.skip() after it failed: the ranks keep what it left, the next step runs on that")
        self._skipped.add(index)
        self.cursor += 1
        if self._held is None or self._held == index:
            self._held = self.cursor  # the ranks' state is what the user chose to go on with
        logging.getLogger("workbench").warning("workbench: skipped the failed step %r; next: %s",
                                               self.steps[index], self.next_step)
        return frame

    def goto(self, step: str | int) -> Frame | None:
        """Bring the ranks to the state right after ``step``: replayed from the start (same seed, fix and
        parameters) on the same engines when it lies behind the cursor, run forward when ahead.

        Each replayed frame says whether it departs from the frame it replaces (tensor fingerprints,
        per rank); ``s.departures`` lists every departure. Returns ``step``'s frame.
        """
        index = self._index(step)
        if index >= self.cursor and self._in_sync():
            self.run(until=self.steps[index])
        else:
            self._replay(index + 1)
        return self.frames[index] if index < len(self.frames) else None

    def rewind(self, k: int = 1) -> Frame | None:
        """Go back ``k`` steps (``goto`` the step ``k`` before the cursor's last): the ranks hold the state
        after that step, replayed from the start. ``rewind(cursor)`` leaves the ranks at the beginning."""
        if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= self.cursor:
            raise WorkbenchError(f"rewind(k) takes 1..{self.cursor} (steps before the cursor), got {k!r}")
        target = self.cursor - k
        if target == 0:
            self._replay(0)
            return None
        return self.goto(target - 1)

    def _index(self, step: str | int) -> int:
        if isinstance(step, int) and not isinstance(step, bool):
            if not 0 <= step < len(self.steps):
                raise WorkbenchError(f"step index {step} out of range 0..{len(self.steps) - 1}")
            return step
        if step not in self.steps:
            raise UnknownName(f"step of {self.scenario.name}", str(step), self.steps)
        return self.steps.index(step)

    def _replay(self, upto: int) -> list[Frame]:
        """Fresh rank state (a new ledger attempt), then steps ``0..upto-1`` again, skipped ones left out,
        each probed and compared with the frame it replaces. The cursor ends at ``upto``."""
        if self._begun:
            self.attempt += 1  # a fresh ledger sequence on the ranks
        self._begun = False
        self._begin()
        before = list(self.frames)
        tail = [before[upto]] if upto < len(before) and not before[upto].ok else []  # the failed step stays in view
        self.frames = before[:upto]
        self.cursor = 0
        out = []
        for i in range(upto):
            self.cursor = i
            if i in self._skipped:
                continue
            frame = self._run_one(i, replay=True)
            _note_departure(frame, before[i] if i < len(before) else None, self.departures)
            self.frames = [*self.frames[:i], frame, *self.frames[i + 1:]]
            self.log.append(frame)
            out.append(frame)
            if not _goes_on(frame):
                self.frames, self._held = self.frames[:i + 1], None
                raise WorkbenchError(f"replaying step {frame.step!r} failed: " + "; ".join(
                    f"rank {r}: {m[:300]}" for r, m in frame.rank_errors.items())
                    + f"; the cursor stands at {frame.step!r}")
        self.frames = self.frames[:upto] + tail
        self._held = self.cursor = upto
        self.updated_at = time.time()
        return out

    def reset(self) -> Session:
        """Drop the frames and the ranks' objects; the next step starts from the first (``log`` stays)."""
        self.close()
        self.frames = []
        self.cursor = 0
        self._skipped = set()
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

    def _outside_collectives(self, step: str, ranks: list[int]) -> bool:
        """Whether none of ``ranks`` is inside a collective of the step (they compute: slow, not hung). Only
        where the ledger records every call: with it off, nothing says where a rank waits."""
        if self.cluster.detect_deadlocks is False or not ranks:
            return False
        inside = {int(c["rank"]) for c in self._open_calls(step) if c.get("rank") is not None}
        return not inside.intersection(ranks)

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

    def recover(self, wait: float | None = None) -> dict[str, Any]:
        """After a hang or a failed step: bring the ranks back (``cluster.recover()``), replay the steps
        before the first failed one and stand the cursor *at* it: ``s.step()`` runs it again (with a
        changed fix or parameter if you changed one), ``s.skip()`` moves past it.

        The failed frame stays in the timeline until it is rerun; every frame stays in ``s.log``.
        The returned info (``replayed``, ``cursor``, ``departed``) and the next frame's notes say
        what the ranks hold. The ledger starts a new attempt. ``wait``: see ``Engines.recover``
        (how long ranks still blocked after the abort get before a restart).
        """
        info = self.cluster.recover(wait=wait)
        failed = next((i for i, f in enumerate(self.frames) if not f.ok or f.hang is not None), None)
        if failed is not None:
            self.cursor = failed
            self.frames = self.frames[:failed + 1]
            self._skipped = {i for i in self._skipped if i < failed}
        n = len(self.departures)
        self._replay(self.cursor)
        info["replayed"] = [self.steps[i] for i in range(self.cursor) if i not in self._skipped]
        info["cursor"] = self.next_step
        info["departed"] = self.departures[n:]
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
            "versions": versions(getattr(c, "kernels", {}).get(0)),
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
                f"{self.cursor}/{len(self.steps)} steps, next={self.next_step}>")


_WENT_ON = ("the step failed the way the incident does (inside torch.distributed, or a check refused before any "
            "damage) and every rank returned; the session goes on as the job's ranks would, the later steps show "
            "what it left. s.goto(step) reruns it")


def _goes_on(frame: Frame) -> bool:
    """Whether the cursor moves past this frame: every rank returned (none died or is stuck) and no rank raised
    an error the rank layer stops its later steps for (``halted``: anything but an error inside torch.distributed,
    such as a released deadlock or a collective timeout, or a check's ``WorkbenchError``)."""
    return not frame.kinds & {"timeout", *LOST} and not getattr(frame, "halted", set())


def _released_failed(values: dict[int, dict[str, Any]], watch: Release) -> dict[int, dict[str, Any]]:
    """Every rank the deadlock watch released failed this step, also when its step's code never saw it.

    On NCCL a collective is queued on the GPU and the call returns at once: a rank whose peer never posts
    waits afterwards, on the GPU (a stream sync, the probe reading a tensor), outside any torch.distributed
    call. The abort ends that wait without an exception, and the rank returns a clean value. Which way it
    goes depends on where the rank sat (NCCL's first use of a connection blocks inside the call, a warm one
    does not): without this the same hang gave a failed frame or an ``ok`` one with ``hang`` set. Decided
    here, from what the client already knows when the frame is built: nothing arrives for it later.
    """
    out = dict(values)
    for r, call in watch.released.items():
        v = out.get(r)
        if v is None or v.get("error"):  # a failure of its own (deadline, death), or the call raised
            continue
        reason = watch.found.reason if watch.found is not None else "a deadlock declared from the ledgers"
        out[r] = {**v, "error": {
            "error": "DeadlockReleased",
            "message": (f"{call} was aborted by the workbench: it could never complete ({reason}). The step's code "
                        "had moved past the call (the backend queued it and returned), so no exception reached "
                        "it; the communicator is aborted and what the call was to write cannot be trusted"),
            "traceback": ""}}
    return out


def _note_all(frame: Frame, world_size: int, note: str) -> None:
    frame.notes = {r: [*frame.notes.get(r, []), note] for r in range(world_size)}


def fingerprints(frame: Frame) -> dict[tuple[int, str], Any]:
    """(rank, name) -> fingerprint of every tensor and output the frame probed: a step's identity."""
    out: dict[tuple[int, str], Any] = {}
    for table in (frame.tensors, frame.outputs):
        if len(table) and "fingerprint" in table:
            for r, n, fp in zip(table["rank"], table["name"], table["fingerprint"]):
                out[(int(r), str(n))] = fp
    return out


def _note_departure(frame: Frame, old: Frame | None, departures: list[dict[str, Any]]) -> None:
    """Say on each rank whether the replayed frame matches the one it replaces, tensor by tensor."""
    if old is None:
        return
    new_fp, old_fp = fingerprints(frame), fingerprints(old)
    differ = sorted(k for k in set(new_fp) | set(old_fp) if new_fp.get(k) != old_fp.get(k))
    frame.departs = differ
    ranks = sorted({r for r, _ in new_fp} | {r for r, _ in old_fp} | set(frame.notes))
    for r in ranks:
        mine = [n for q, n in differ if q == r]
        if mine:
            note = (f"replay departs from the earlier run at {frame.step!r}: {len(mine)} tensor(s) differ "
                    f"({', '.join(mine[:5])}{', ...' if len(mine) > 5 else ''})")
        else:
            note = f"replay of {frame.step!r}: same fingerprints as the earlier run"
        frame.notes[r] = [*frame.notes.get(r, []), note]
    if differ:
        departures.append({"step": frame.step, "index": frame.index,
                           "differ": [{"rank": r, "name": n} for r, n in differ]})


def _recovery_note(info: dict[str, Any]) -> str:
    return (f"after recovery ({info['action']}): replayed {', '.join(info['replayed']) or 'no steps'}; "
            f"the cursor stood at {info['cursor']!r}")


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
