"""The diagnosis as a type: a ``Diagnosis`` is a list of clauses (``Clause``), each its words and the facts it tells.

It lives apart from the words the rules say (``workbench.analysis.diagnosis_words``, which reads tables) so that
code which only holds, builds or returns a diagnosis (a rule's signature, a grader, a figure) imports no pandas:
this module imports nothing heavy; its two tables' empty defaults import pandas only when one is built.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

EVIDENCE_COLUMNS = ["step", "rank", "what", "fact"]
GRID_COLUMNS = ["step", "step_index", "rank", "status", "label"]


@dataclass(frozen=True)
class Clause:
    """One clause of a diagnosis: its words (with their own leading ``; `` or ``: ``) and what it tells as data.

    ``kind``: ``said`` (words only), ``raised`` (``data``: the (rank, exception type) pairs it names),
    ``stuck`` (the ranks left timed out, hung or dead: ``where_stuck``'s rows), ``groups`` (a group that parted
    on its own: its ``Divergence``), ``tensors`` (the tensor names it is about), ``outputs`` (the bad outputs),
    ``floor`` (outputs within an engine's own floor), ``comparison`` (where a fix parts from the bug path)."""

    text: str
    kind: str = "said"
    data: Any = None


def _empty(columns: list[str]) -> pd.DataFrame:
    """An empty table of ``columns``; pandas is imported here, not at module import, to keep this module light."""
    import pandas as pd

    return pd.DataFrame(columns=columns)


@dataclass
class Diagnosis:
    """What went wrong first: mechanism, step, ranks, tensor, call; its clauses (the sentence); the rows behind it.

    ``clauses`` may be given as one string (a single plain clause)."""

    mechanism: str  # "clean", "reinterpreted", "mispaired", "collective-mismatch", "rank-missing", ...
    clauses: list[Clause] | str
    step: str | None = None  # the first step of the story
    ranks: list[int] = field(default_factory=list)
    tensor: str | None = None
    call: dict[str, Any] | None = None  # the first divergent ledger call (the deviating rank's)
    evidence: pd.DataFrame = field(default_factory=lambda: _empty(EVIDENCE_COLUMNS))
    grid: pd.DataFrame = field(default_factory=lambda: _empty(GRID_COLUMNS))  # for the figure
    parted: dict[str, Any] | None = None  # comparison: where bug and fix runs part
    fix: Diagnosis | None = None  # comparison: the fix run's own diagnosis

    def __post_init__(self) -> None:
        self.clauses = [Clause(self.clauses)] if isinstance(self.clauses, str) else list(self.clauses)

    @property
    def sentence(self) -> str:
        """The clauses' words: the one place the sentence is rendered."""
        return "".join(c.text for c in self.clauses)

    @property
    def clean(self) -> bool:
        return self.mechanism == "clean"

    # -- what the story already tells, read from its clauses ------------------------------------------
    def told(self, kind: str) -> list[Clause]:
        return [c for c in self.clauses if c.kind == kind]

    @property
    def raisers(self) -> set[tuple[int, str]]:
        """(rank, exception type) pairs the story already names as raised."""
        return {p for c in self.told("raised") for p in c.data}

    # -- building it ---------------------------------------------------------------------------------
    def add(self, *clauses: Clause) -> Diagnosis:
        self.clauses += clauses
        return self

    def lead(self, *clauses: Clause) -> Diagnosis:
        """``clauses`` before the story so far."""
        self.clauses[:0] = clauses
        return self

    def insert_before(self, kind: str, *clauses: Clause) -> Diagnosis:
        """``clauses`` just before the story's first non-empty clause of ``kind`` (else at its end)."""
        at = next((i for i, c in enumerate(self.clauses) if c.kind == kind and c.text), len(self.clauses))
        self.clauses[at:at] = clauses
        return self

    def to_dict(self) -> dict[str, Any]:
        from workbench.analysis.frames import jsonable, records

        return {"mechanism": self.mechanism, "sentence": self.sentence, "step": self.step, "ranks": self.ranks,
                "tensor": self.tensor, "call": jsonable(self.call), "evidence": records(self.evidence),
                "parted": jsonable(self.parted), "fix": None if self.fix is None else self.fix.to_dict()}

    def __str__(self) -> str:
        return self.sentence

    def __repr__(self) -> str:
        return f"<Diagnosis {self.mechanism}: {self.sentence}>"

    def _repr_html_(self) -> str:
        rows = self.evidence.to_html(index=False) if len(self.evidence) else ""
        return f"<p><b>{html.escape(self.mechanism)}</b>: {html.escape(self.sentence)}</p>{rows}"
