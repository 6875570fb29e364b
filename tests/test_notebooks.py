"""Every notebook executes end to end on a real kernel (they start their own engines).

Two at a time (``WORKBENCH_NOTEBOOK_LANES``, default 2): a notebook spends much of its time waiting (engines
starting, a deadline, a rendezvous), and they share nothing (each starts its own cluster on free ports), so
running them side by side takes about a third off the suite's longest part on a 2-core box. Each test still
reports its own notebook.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
LANES = max(1, int(os.environ.get("WORKBENCH_NOTEBOOK_LANES", "2")))
TEST = "test_notebook_is_committed_clean_and_runs"


def _execute(path: Path, workdir: Path, env: dict[str, str]) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    workdir.mkdir(parents=True, exist_ok=True)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(workdir)}}).execute(env=env)
    return nb


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
    """The selected notebooks, started in the background as soon as the first of them is asked for."""
    chosen = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", None) == TEST and hasattr(item, "callspec")]
    base = tmp_path_factory.mktemp("notebooks")
    # The kernels' environment is copied here, on pytest's thread: a lane copying os.environ itself raced pytest
    # setting and removing PYTEST_CURRENT_TEST between each test's phases (KeyError inside jupyter_client).
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    pool = ThreadPoolExecutor(LANES, thread_name_prefix="notebook")
    runs: dict[Path, Future] = {p: pool.submit(_execute, p, base / p.stem, env) for p in chosen}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_clean_and_runs(path, executed):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert dirty == [], f"{path.name}: cells {dirty} were committed with outputs"
    ran = executed[path].result()
    errors = [o for c in ran.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == [], [f"{e.ename}: {e.evalue}" for e in errors]


def test_the_exercises_instructions_say_where_the_fix_runs():
    """The exercise's instruction is put together from a template: it once lost its verb in every notebook."""
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        said = [c.source for c in nb.cells if c.cell_type == "markdown" and "A step function:" in c.source]
        for text in said:
            assert "A step function: it runs " in text, f"{path.name}: {text[:80]}"
