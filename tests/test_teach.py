"""The exercises at the end of notebooks 01-08 and 11: each grader, on live ranks, against what it must tell apart.

For every exercise the reference solution is graded *fixed*, the bug path (the slot holding the step it
replaces, or nothing) *not fixed*, and the known non-fix what it is (*fixed the symptom only* where the
notebook's symptom goes away and the cause stays). One shared 2-rank gloo cluster (conftest).
"""

from __future__ import annotations

import inspect
import json
import pickle
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from workbench import teach
from workbench.errors import UnknownName, WorkbenchError
from workbench.teach import FIXED, NOT_FIXED, SYMPTOM_ONLY, steps

IDS = sorted(teach.EXERCISES)
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _grade(cluster, ex_id: str, path: str):
    ex = teach.exercise(ex_id)
    if path == "reference":
        return teach.check(cluster, ex.reference, exercise=ex_id)
    if path == "bug":
        return teach.check(cluster, ex.bug_step(), exercise=ex_id)
    mode, where = ex.nonfix_slot or ex.slot
    return teach.check(cluster, ex.nonfix, exercise=ex_id, **{mode: where})


@pytest.mark.parametrize("ex_id", IDS)
def test_the_reference_solution_is_graded_fixed(healthy, ex_id):
    v = _grade(healthy, ex_id, "reference")
    assert v.status == FIXED, str(v)
    assert v.fixed and v.diagnosis.clean and v.problems == []


@pytest.mark.parametrize("ex_id", IDS)
def test_the_bug_path_is_graded_not_fixed(healthy, ex_id):
    v = _grade(healthy, ex_id, "bug")
    assert v.status == NOT_FIXED, str(v)
    assert not v.diagnosis.clean and v.sentence == v.diagnosis.sentence


@pytest.mark.parametrize("ex_id", IDS)
def test_the_known_nonfix_is_rejected(healthy, ex_id):
    ex = teach.exercise(ex_id)
    v = _grade(healthy, ex_id, "nonfix")
    assert v.status == ex.nonfix_verdict, str(v)
    if v.status == SYMPTOM_ONLY:  # the symptom went away, the diagnosis still names the cause
        assert not v.diagnosis.clean and "but the cause is still there" in v.sentence


def test_a_todo_step_is_rejected_naming_the_error(healthy):
    def my_fix(ctx):
        raise NotImplementedError("TODO: write your fix")

    v = teach.check(teach.exercise("02").session(healthy), my_fix)  # its diagnosis would name never-written buffers
    assert v.status == NOT_FIXED
    assert v.sentence.startswith("your step raised on ranks 0,1: NotImplementedError: TODO")


def test_bad_input_is_one_line_before_any_rank_runs(cluster):
    s = teach.exercise("01").session(cluster)
    with pytest.raises(WorkbenchError, match="wants your step function"):
        teach.check(s, "not a function")
    with pytest.raises(WorkbenchError, match="must take one argument, ctx"):
        teach.check(s, lambda: None)
    with pytest.raises(WorkbenchError, match="not both"):
        teach.check(s, steps.nothing, after="cast", replace="cast")
    with pytest.raises(UnknownName, match="no_such_step"):
        teach.check(s, steps.nothing, after="no_such_step")
    with pytest.raises(WorkbenchError, match="not a str"):
        teach.check("cluster", steps.nothing, exercise="01")
    with pytest.raises(UnknownName, match="exercise"):
        teach.check(cluster, steps.nothing, exercise="42")
    with pytest.raises(WorkbenchError, match="session of an exercise"):
        teach.check(cluster.session("to-empty-clobbers-buffers"), steps.nothing)
    assert s.frames == []


def test_the_hint_ladder_reveals_one_hint_at_a_time():
    teach.reset_hints("04")
    shown = [str(teach.hint("04")) for _ in range(4)]
    assert [h.split("**")[1] for h in shown[:3]] == ["Hint 1/3", "Hint 2/3", "Hint 3/3"]
    assert len(set(shown)) == 4 and 'wb.teach.solution("04")' in shown[3]
    assert str(teach.hint(4, 1)) == shown[0]  # any rung again, by number
    with pytest.raises(ValueError, match="hints 1-3"):
        teach.hint("04", 7)
    assert "def ref_04" in teach.solution("04")


def test_solutions_stay_out_of_the_notebooks_and_each_ends_with_its_exercise():
    for ex_id in IDS:
        path = next(NOTEBOOKS.glob(f"{ex_id}_*.ipynb"))
        cells = json.loads(path.read_text())["cells"]
        text = "".join("".join(c["source"]) for c in cells)
        start = max(i for i, c in enumerate(cells) if "".join(c["source"]).startswith(f"## Exercise {ex_id}"))
        tail = "".join("".join(c["source"]) for c in cells[start:])  # the exercise is the notebook's end
        assert "".join(cells[-1]["source"]) == "cluster.stop()"
        assert f'wb.teach.exercise("{ex_id}")' in tail and "wb.teach.check(" in tail, path.name
        assert f'wb.teach.hint("{ex_id}")' in tail and "NotImplementedError" in tail, path.name
        # the reference's own lines (its code, not its imports) are not in the notebook
        code = [ln.strip() for ln in inspect.getsource(teach.exercise(ex_id).reference).splitlines()[1:]]
        code = [ln for ln in code if len(ln) > 25 and not ln.startswith(("from ", "import ", '"""'))]
        shown = [ln for ln in code if ln in text]  # a shared line of boilerplate (a seed) is no solution
        assert code and len(shown) < len(code) / 2, f"{path.name} shows the reference solution: {shown}"


def test_exercise_steps_travel_by_reference_and_the_client_imports_no_torch():
    for ex in teach.EXERCISES.values():
        for fn in [*(f for _, f in ex.scenario().steps), ex.reference, ex.nonfix]:
            assert pickle.loads(cloudpickle.dumps(fn)) is fn, f"{ex.id}: {fn.__name__} would travel by value"
    code = ("import sys, workbench as wb\n"
            "[e.with_step(print).step_names for e in wb.teach.EXERCISES.values()]\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
