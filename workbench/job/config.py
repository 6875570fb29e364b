"""The capture's configuration from the environment: the one place that reads the ``WORKBENCH_CAPTURE*`` variables.

``workbench job`` writes them (``CaptureConfig.to_env``) into the job's environment; each rank reads them back
(``CaptureConfig.from_env``): the site hook's ``hooks.py`` for the automatic points, ``capture()`` for its directory
and ledger. The site hook's own bootstrap (``job/site/sitecustomize.py``) may import nothing but ``os`` and ``sys``,
so it reads ``WORKBENCH_CAPTURE`` itself, with the same words (``WORDS``).

A value a variable cannot take is treated alike for every variable: ignored (the default is used, or the script's
own choice where the variable overrides one), its line kept in ``problems``, which the capture says once on stderr
(``shard.say_problems``, through its say-once helper), and the job goes on. ``capture(..., strict=True)`` raises it
instead, as strict mode raises the capture's other faults. Reading says nothing itself: processes that only ask
whether they capture (the launcher's, a rank's workers) stay quiet.

This module imports nothing of torch nor of the rest of the workbench at import: the site hook imports it in every
process of a job, the launcher's included.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

ENV = "WORKBENCH_CAPTURE"  # a directory: capture every rank into it; an OFF word: capture() is a no-op
ENV_JOB = "WORKBENCH_JOB_ID"  # the job id every shard carries
ENV_LEDGER = "WORKBENCH_CAPTURE_LEDGER"  # Ledger's words: over the script's own ledger=
ENV_POISON = "WORKBENCH_CAPTURE_POISON"  # Poison's words (the automatic points' capture)
ENV_EVERY = "WORKBENCH_CAPTURE_EVERY"  # a point every N-th optimizer step (after the first)
ENV_POINTS = "WORKBENCH_CAPTURE_POINTS"  # the automatic points to take, comma-separated (default: all)
ENV_ATTACH = "WORKBENCH_CAPTURE_ATTACH"  # post-mortem, on-error, on-deadlock (the default), off
ENV_DEADLINE = "WORKBENCH_CAPTURE_DEADLINE"  # seconds a post-mortem attach waits for a notebook
ENV_HANG_AFTER = "WORKBENCH_CAPTURE_HANG_AFTER"  # seconds a call waits before the ledgers may call it stuck
ENV_PID = "WORKBENCH_CAPTURE_PID"  # the process that captures: its children (workers) do not
ENV_HOME = "WORKBENCH_CAPTURE_HOME"  # where workbench lives, for a job whose python lacks it (the site hook's)
ENV_LAUNCHER = "WORKBENCH_CAPTURE_LAUNCHER_PID"  # the launcher's pid: what a wait line tells to kill (triggers.py)
ENV_WRITER = "WORKBENCH_CAPTURE_WRITER"  # "thread" or "inline": where points are finished (writer.py)

OFF = ("0", "off", "false", "no")  # switched off: WORKBENCH_CAPTURE, the ledger, the poison
ON = ("1", "on", "true", "yes")  # switched on (WORKBENCH_CAPTURE: on, into the script's own path; the ledger: full)
WORDS = ("", *OFF, *ON)  # WORKBENCH_CAPTURE's words, not directories
ATTACH = ("post-mortem", "on-error", "on-deadlock")  # WORKBENCH_CAPTURE_ATTACH's triggers; "off": none
WRITERS = ("thread", "inline")

POINTS = {
    "to_empty": "after nn.Module.to_empty (recurse=True): the module materialised",
    "fully_shard": "after FSDP2's fully_shard of a root (a module with sharded submodules)",
    "FullyShardedDataParallel": "after FSDP1's construction (the outermost wrap; its sync_module_states "
                                "in the point's note)",
    "load_state_dict": "after nn.Module.load_state_dict",
    "set_model_state_dict": "after torch.distributed.checkpoint's set_model_state_dict",
    "forward": "after the first forward of each wrapped root (fully_shard, FSDP1, DDP), its output as an output",
    "step": "after the first optimizer.step() (step1), then every N-th (--every N: step<N>, step<2N>, ...); "
            "nonfinite_loss: on every rank, once the backward after the one a first non-finite loss ran returned",
    "load_weights": "after a weight-sync receiver's load_weights (an nn.Module class that defines one)",
}


class Poison(enum.Enum):
    """What poison fills: what ``to_empty`` hands out (the default), every allocation too, or nothing."""

    TO_EMPTY = "to_empty"
    ALL = "all"
    OFF = "off"

    @property
    def arg(self) -> bool | str:
        """The value ``capture(poison=...)`` keeps and the manifest records: ``"to_empty"``, ``True``, ``False``."""
        return {Poison.TO_EMPTY: "to_empty", Poison.ALL: True, Poison.OFF: False}[self]

    @classmethod
    def of_word(cls, word: str) -> Poison | None:
        """The environment's word (any case), or None for one it does not know."""
        word = word.strip().lower()
        return cls.OFF if word in OFF else next((m for m in cls if m.value == word), None)

    @classmethod
    def of_arg(cls, value: Any) -> Poison | None:
        """A script's ``capture(poison=...)``: ``"to_empty"``, ``"all"``, ``True`` (all, as before), ``False``."""
        return {"to_empty": cls.TO_EMPTY, "all": cls.ALL, True: cls.ALL, False: cls.OFF}.get(value)


class Ledger(enum.Enum):
    """The collective record: around ``torch.distributed``'s calls (the default), every op, or none."""

    CALLS = "calls"
    FULL = "full"
    OFF = "off"

    @property
    def arg(self) -> bool | str:
        """The value ``capture(ledger=...)`` keeps and the manifest records: ``"calls"``, ``True``, ``False``."""
        return {Ledger.CALLS: "calls", Ledger.FULL: True, Ledger.OFF: False}[self]

    @classmethod
    def of_word(cls, word: str) -> Ledger | None:
        """The environment's word (any case): ``calls``/``default``, ``full`` or an ON word, ``off`` or an OFF word."""
        word = word.strip().lower()
        if word in ("calls", "default"):
            return cls.CALLS
        return cls.FULL if word == "full" or word in ON else cls.OFF if word in OFF else None

    @classmethod
    def of_arg(cls, value: Any) -> Ledger | None:
        """A script's ``capture(ledger=...)``: ``"calls"``, ``"full"``, ``True`` (full, as before), ``False``."""
        return {"calls": cls.CALLS, "full": cls.FULL, True: cls.FULL, False: cls.OFF}.get(value)


def check_points(names: Iterable[str]) -> tuple[str, ...]:
    """The automatic points' names, checked (the one check: ``workbench job --points``, the environment,
    ``Hooks``); a name none has raises one line naming them all."""
    names = tuple(names)
    unknown = [p for p in names if p not in POINTS]
    if unknown:
        raise ValueError(f"unknown point(s) {', '.join(unknown)}; the automatic points: {', '.join(POINTS)}")
    return names


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """What the environment says about the capture; every field's default is what an unset variable means.

    ``enabled``: False where ``WORKBENCH_CAPTURE`` is an OFF word; ``directory``: where it names one (an ON word or
    nothing: None). ``ledger``: None where unset (the script's own ``ledger=`` stands). ``attach``: None for off.
    ``problems``: each bad value's line, by variable (not compared: two configs that read alike are equal)."""

    enabled: bool = True
    directory: str | None = None
    job: str | None = None
    poison: Poison = Poison.TO_EMPTY
    ledger: Ledger | None = None
    every: int | None = None  # None: auto (every step on a GPU rank, the first step only on a CPU rank)
    points: tuple[str, ...] = tuple(POINTS)
    attach: str | None = "on-deadlock"
    attach_deadline: float = 600.0
    hang_after: float = 60.0
    pid: int | None = None
    home: str | None = None
    launcher_pid: int | None = None
    writer: str | None = None
    problems: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CaptureConfig:
        """The configuration ``env`` (default: this process's environment) holds. A bad value is left at its
        default and its line kept in ``problems``."""
        env = os.environ if env is None else env
        problems: dict[str, str] = {}
        fields: dict[str, Any] = {}
        where = env.get(ENV, "").strip()
        fields["enabled"] = where.lower() not in OFF
        fields["directory"] = None if where.lower() in WORDS else where
        fields["job"] = env.get(ENV_JOB) or None
        fields["home"] = env.get(ENV_HOME) or None
        for name, field, read, what in _READS:
            raw = env.get(name, "")
            if not raw.strip():
                continue
            value = read(raw)
            if value is _BAD:
                problems[name] = (f"{name}={raw!r} is not {what}: ignored, "
                                  f"{_default_word(field)} stands")
            else:
                fields[field] = value
        return cls(**fields, problems=problems)

    def to_env(self) -> dict[str, str]:
        """The variables that make ``from_env`` read this configuration back (what ``workbench job`` sets); a
        field at its unset default is left out, but for the automatic points' own (written, as the job reads
        them)."""
        every = "auto" if self.every is None else str(self.every)
        env = {ENV_EVERY: every, ENV_POINTS: "" if self.points == tuple(POINTS) else ",".join(self.points),
               ENV_ATTACH: self.attach or "off", ENV_DEADLINE: str(float(self.attach_deadline)),
               ENV_HANG_AFTER: str(float(self.hang_after)), ENV_POISON: self.poison.value}
        if not self.enabled or self.directory:
            env[ENV] = self.directory if self.enabled and self.directory else "0"
        optional = {ENV_JOB: self.job, ENV_LEDGER: self.ledger.value if self.ledger else None, ENV_PID: self.pid,
                    ENV_HOME: self.home, ENV_LAUNCHER: self.launcher_pid, ENV_WRITER: self.writer}
        env.update({k: str(v) for k, v in optional.items() if v is not None})
        return env

    def options(self) -> dict[str, Any]:
        """The automatic points' capture, as ``hooks.start`` passes it on (``hooks.options``)."""
        return {"every": self.every, "points": list(self.points), "poison": self.poison.arg, "attach": self.attach,
                "attach_deadline": self.attach_deadline, "hang_after": self.hang_after}


def from_env(env: Mapping[str, str] | None = None) -> CaptureConfig:
    """``CaptureConfig.from_env``."""
    return CaptureConfig.from_env(env)


_BAD = object()


def _count(raw: str) -> Any:
    """A whole number of steps, 0 or more; ``auto`` (or nothing): None."""
    if raw.strip().lower() in ("", "auto"):
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        return _BAD
    return value if value >= 0 else _BAD


def _seconds(raw: str) -> Any:
    """Positive, finite seconds."""
    try:
        value = float(raw.strip())
    except ValueError:
        return _BAD
    return value if value > 0 and math.isfinite(value) else _BAD


def _pid(raw: str) -> Any:
    raw = raw.strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else _BAD


def _points(raw: str) -> Any:
    names = [p.strip() for p in raw.split(",") if p.strip()]
    try:
        return check_points(names) if names else tuple(POINTS)
    except ValueError:
        return _BAD


def _attach(raw: str) -> Any:
    word = raw.strip().lower()
    return None if word in ("off", *OFF) else word if word in ATTACH else _BAD


def _word(choices: tuple[str, ...]) -> Any:
    return lambda raw: raw.strip().lower() if raw.strip().lower() in choices else _BAD


def _enum(kind: Any) -> Any:
    return lambda raw: _BAD if kind.of_word(raw) is None else kind.of_word(raw)


# variable, field, reader (its value or _BAD), what the variable takes (for the line a bad value gets)
_READS = (
    (ENV_LEDGER, "ledger", _enum(Ledger), "a ledger mode (calls or default, full or 1, off or 0)"),
    (ENV_POISON, "poison", _enum(Poison), "a poison mode (to_empty, all, off or 0)"),
    (ENV_EVERY, "every", _count, "a number of steps (0: the first step only) or auto"),
    (ENV_POINTS, "points", _points, f"automatic points, comma-separated ({', '.join(POINTS)})"),
    (ENV_ATTACH, "attach", _attach, f"an attach mode ({', '.join(ATTACH)}, off)"),
    (ENV_DEADLINE, "attach_deadline", _seconds, "positive seconds"),
    (ENV_HANG_AFTER, "hang_after", _seconds, "positive seconds"),
    (ENV_PID, "pid", _pid, "a process id"),
    (ENV_LAUNCHER, "launcher_pid", _pid, "a process id"),
    (ENV_WRITER, "writer", _word(WRITERS), f"a writer ({', '.join(WRITERS)})"),
)


def _default_word(field: str) -> str:
    """What a bad value leaves in force, in words."""
    if field == "ledger":
        return "the script's ledger"
    if field == "points":
        return "every point"
    if field == "every":
        return "every=auto"
    default = {f.name: f.default for f in dataclasses.fields(CaptureConfig)}[field]
    if isinstance(default, enum.Enum):
        default = default.value
    return "none" if default is None else f"{field}={default}"
