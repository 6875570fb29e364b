"""Every notebook executes end to end on a real kernel (they start their own engines)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_clean_and_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert dirty == [], f"{path.name}: cells {dirty} were committed with outputs"
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []


def test_the_exercises_instructions_say_where_the_fix_runs():
    """The exercise's instruction is put together from a template: it once lost its verb in every notebook."""
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        said = [c.source for c in nb.cells if c.cell_type == "markdown" and "A step function:" in c.source]
        for text in said:
            assert "A step function: it runs " in text, f"{path.name}: {text[:80]}"
