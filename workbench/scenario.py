"""Declaring a scenario: ordered steps that run on every rank, named fixes, parameters.

Layer-neutral on purpose: a scenario file imports this and the rank layer only, so the
same object is declared in the client and unpickled on the engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import UnknownName, WorkbenchError

Step = Callable[[Any], None]
# What a parameter's or the mesh's rule raises on a value it cannot judge (a string where it compares numbers, a
# key it does not find, a division by zero): the value fails the rule, said in one line. A rule that raises
# anything else has a bug of its own, which shows as such.
RULE_FAULTS = (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError)


@dataclass
class Scenario:
    """A bug path as ordered steps, plus the fixes a step can read from ``ctx.fix``."""

    name: str
    title: str = ""
    doc: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    fixes: dict[str, str] = field(default_factory=dict)
    probe: list[str] | None = None  # ctx attributes to probe; None: every module / tensor dict
    incident: str = ""
    steps: list[tuple[str, Step]] = field(default_factory=list)
    rules: dict[str, list[tuple[Callable[[Any], bool], str]]] = field(default_factory=dict)
    non_fixes: set[str] = field(default_factory=set)  # fixes kept to show why they do not fix
    meshes: str = "any N >= 2"  # the --ranks N its roles lay out on, as `workbench list` says it
    mesh_rule: Callable[[int, dict[str, Any]], bool] | None = None

    def __post_init__(self) -> None:
        # The name goes into temp dir and file names on every rank: a '/' there failed after engines started.
        if not isinstance(self.name, str) or not self.name.strip() or any(
                c in self.name for c in "/\\\0") or self.name in (".", "..") or len(self.name) > 120:
            raise WorkbenchError(f"scenario name {self.name!r}: give a file-name-safe name (no '/', '\\', NUL; "
                                 "at most 120 characters)")

    def step(self, fn: Step | None = None, *, name: str | None = None) -> Any:
        """Decorator: append ``fn`` as the next step (named after the function)."""
        def add(f: Step) -> Step:
            step_name = name or f.__name__
            if step_name in self.step_names:
                raise WorkbenchError(f"scenario {self.name!r} already has a step {step_name!r}")
            self.steps.append((step_name, f))
            return f
        return add(fn) if fn is not None else add

    def fix(self, name: str, doc: str = "", *, non_fix: bool = False) -> str:
        """Declare a fix the steps switch on with ``ctx.fix == name``. ``non_fix``: a tempting change
        that does not close the gap (kept because an incident tried it or a reader would): listings
        warn, and the comparison is expected not to read clean."""
        self.fixes[name] = doc
        if non_fix:
            self.non_fixes.add(name)
        return name

    def require(self, param: str, rule: Callable[[Any], bool], why: str) -> None:
        """Declare that ``param`` must satisfy ``rule``; ``why`` says what it must be. Checked by
        ``resolve_params``, so a bad ``--set`` fails before any engine starts, not three steps in."""
        if param not in self.params:
            raise UnknownName(f"parameter of {self.name}", param, sorted(self.params))
        self.rules.setdefault(param, []).append((rule, why))

    def mesh(self, describe: str, rule: Callable[[int, dict[str, Any]], bool]) -> None:
        """Declare which world sizes the scenario lays its roles out on: ``rule(n, params)``, and
        ``describe`` in words ("N = pp x ep, pp >= 1"). A sweep skips the rest, a run refuses them
        before any engine starts."""
        self.meshes, self.mesh_rule = describe, rule

    def check_ranks(self, n: int, params: dict[str, Any] | None = None) -> None:
        """One clear error, before any engine starts, for a world size the roles cannot lay out on."""
        params = self.resolve_params(params)
        try:
            ok = n >= 2 and (self.mesh_rule is None or bool(self.mesh_rule(n, params)))
        except RULE_FAULTS:
            ok = False
        if not ok:
            raise WorkbenchError(f"{self.name} runs on {self.meshes}; {n} rank(s) is not one of them"
                                 + (f" with {_shown(params, self.params)}" if _shown(params, self.params) else ""))

    @property
    def step_names(self) -> list[str]:
        return [n for n, _ in self.steps]

    def check_fix(self, fix: str | None) -> None:
        if fix is not None and fix not in self.fixes:
            raise UnknownName(f"fix for {self.name}", fix, list(self.fixes))

    def resolve_params(self, overrides: dict[str, Any] | None) -> dict[str, Any]:
        """Defaults updated by ``overrides``; strings (from ``--set``) take the default's type."""
        merged = dict(self.params)
        for key, value in (overrides or {}).items():
            if key not in self.params:
                raise UnknownName(f"parameter of {self.name}", key, sorted(self.params))
            merged[key] = coerce(value, self.params[key], key)
        for key, rules in self.rules.items():
            for rule, why in rules:
                try:
                    ok = bool(rule(merged[key]))
                except RULE_FAULTS:
                    ok = False
                if not ok:
                    raise WorkbenchError(f"parameter {key}={merged[key]!r}: {why}")
        return merged


def _shown(params: dict[str, Any], defaults: dict[str, Any]) -> str:
    """The parameters that differ from the defaults, as ``k=v`` (what a mesh error names)."""
    return ", ".join(f"{k}={v}" for k, v in params.items() if defaults.get(k) != v)


def coerce(value: Any, default: Any, key: str) -> Any:
    if not isinstance(value, str) or isinstance(default, str) or default is None:
        return value
    try:
        if isinstance(default, bool):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        out = type(default)(value)
    except ValueError:
        raise WorkbenchError(f"parameter {key}={value!r}: expected {type(default).__name__}") from None
    if isinstance(out, int) and not -(2**63) <= out < 2**63:  # else torch's C++ overflow, naming no key
        raise WorkbenchError(f"parameter {key}={value}: out of range for a 64-bit integer")
    return out
