"""Teaching: the "break it, fix it" exercise at the end of each incident notebook, graded on live ranks.

Each of notebooks 01-08 and 11 ends with a variant of its incident (``exercises.py`` says what changed), a
cell where the learner writes a fix as a step function, and a grading cell::

    ex = wb.teach.exercise("01")
    s = ex.session(cluster); s.run(); s.diagnose()    # the variant's bug path, to explore
    def my_fix(ctx): ...                              # runs on every rank in the exercise's slot
    wb.teach.check(s, my_fix)                         # fixed / not fixed / fixed the symptom only
    wb.teach.hint("01")                               # three hints, one more per call

The grader answers from the workbench's own diagnosis (``grade.py``); the reference solutions and
the known non-fixes it is tested against live in ``solutions.py``, out of the notebooks' sight
(``wb.teach.solution("01")`` prints one). This package drives sessions on the client, like ``live/``:
it may import ``live`` and ``analysis``; nothing imports it but ``workbench/__init__``.
"""

from __future__ import annotations

import inspect

from workbench.teach.exercises import EXERCISES, FIXED, NOT_FIXED, SYMPTOM_ONLY, Exercise, get
from workbench.teach.grade import Verdict, check

__all__ = ["EXERCISES", "FIXED", "NOT_FIXED", "SYMPTOM_ONLY", "Exercise", "Verdict", "check", "exercise", "hint",
           "reset_hints", "solution"]

_shown: dict[str, int] = {}  # exercise id -> hints revealed so far


class Text(str):
    """A string that a notebook shows as Markdown and a console prints plainly."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_markdown_(self) -> str:
        return str(self)


def exercise(exercise_id: str | int) -> Exercise:
    """The exercise of a notebook: ``exercise("01")``."""
    return get(exercise_id)


def hint(exercise_id: str | int, n: int | None = None) -> Text:
    """The next hint of the ladder (or hint ``n``, 1-3); after the third, where the solution is."""
    ex = get(exercise_id)
    if n is None:
        n = _shown.get(ex.id, 0) + 1
    if not 1 <= n <= len(ex.hints) + 1:
        raise ValueError(f"exercise {ex.id} has hints 1-{len(ex.hints)}; got {n}")
    _shown[ex.id] = max(_shown.get(ex.id, 0), n)
    if n > len(ex.hints):
        return Text(f"No more hints for exercise {ex.id}. `wb.teach.solution(\"{ex.id}\")` shows the reference "
                    "solution.")
    return Text(f"**Hint {n}/{len(ex.hints)}** (exercise {ex.id}): {ex.hints[n - 1]}")


def solution(exercise_id: str | int) -> Text:
    """The reference solution's source, and where it goes (for after you tried)."""
    ex = get(exercise_id)
    src = inspect.getsource(ex.reference)
    return Text(f"Exercise {ex.id}: a step that {ex.slot_text()}.\n\n```python\n{src}```")


def reset_hints(exercise_id: str | int | None = None) -> None:
    """Start the hint ladder again (one exercise, or all)."""
    if exercise_id is None:
        _shown.clear()
    else:
        _shown.pop(get(exercise_id).id, None)



