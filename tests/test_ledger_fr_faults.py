"""Flight Recorder's record when torch changes its API: said once, never hidden, never the job's error.

``ledger_fr.dump`` and ``ledger_fr.groups`` used to answer empty on any error, so a renamed dump function
(torch's private ``_dump_fr_trace``) read as "nothing recorded" for ever and the capture's line ("Flight
Recorder's record is no longer read") could never fire. An API-shaped failure (AttributeError, TypeError,
ImportError, KeyError) is now ``ledger_fr.Changed``, raised out of ``Complement.fill`` once; a record that
holds nothing stays quiet.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workbench.rank import ledger, ledger_fr

ROOT = Path(__file__).resolve().parent.parent
C10D = torch._C._distributed_c10d


@pytest.fixture(autouse=True)
def _fresh_module_fault(monkeypatch):
    """``groups()`` keeps the API fault it met for the process: each test starts without one."""
    monkeypatch.setattr(ledger_fr, "_changed", None, raising=False)


def _raise(exc: BaseException):
    def fn(*args, **kwargs):
        raise exc

    return fn


def test_a_renamed_dump_api_raises_changed_and_names_the_function(monkeypatch):
    monkeypatch.setattr(C10D, "_dump_fr_trace", _raise(AttributeError("'module' has no attribute 'fr_dump'")),
                        raising=False)
    with pytest.raises(ledger_fr.Changed) as got:
        ledger_fr.dump()
    assert "_dump_fr_trace" in str(got.value) and "AttributeError" in str(got.value)


def test_a_dump_format_torch_changed_raises_changed(monkeypatch):
    monkeypatch.setattr(C10D, "_dump_fr_trace", lambda *a: __import__("pickle").dumps(["entries"]), raising=False)
    with pytest.raises(ledger_fr.Changed, match="format"):
        ledger_fr.dump()  # a list where a dict was: its .get is gone


def test_no_dump_function_at_all_is_a_change(monkeypatch):
    for name in ledger_fr.DUMPS:
        monkeypatch.delattr(C10D, name, raising=False)
    with pytest.raises(ledger_fr.Changed, match="none of"):
        ledger_fr.dump()


def test_a_record_that_holds_nothing_stays_quiet(monkeypatch, capfd):
    monkeypatch.setattr(C10D, "_dump_fr_trace", _raise(RuntimeError("no Flight Recorder buffer")), raising=False)
    assert ledger_fr.dump() == []
    monkeypatch.setattr(C10D, "_dump_fr_trace", lambda *a: __import__("pickle").dumps({"version": "2.10"}),
                        raising=False)
    assert ledger_fr.dump() == []
    assert capfd.readouterr().err == ""


def test_a_changed_groups_table_answers_no_groups_and_the_next_fill_raises_once(monkeypatch, tmp_path):
    """``groups()`` runs at every point (``mark``): it never raises there, and the fill after says it (once)."""
    book = ledger.Ledger(str(tmp_path), 0, session="t", attempt=0)
    try:
        fr = ledger_fr.Complement(book)
        monkeypatch.setattr(dist.distributed_c10d, "_world", types.SimpleNamespace())  # pg_names renamed
        fr.mark("1")  # the point's own read: no raise into the job
        assert ledger_fr.groups() == []
        with pytest.raises(ledger_fr.Changed, match="pg_names"):
            fr.fill("at point `x`")
        assert fr.fill("at close") == 0  # said once: the complement is off now
    finally:
        book.close()


JOB = """
    import os, sys
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    import torch, torch.distributed as dist
    import workbench.job as wj

    d = sys.argv[1]
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)

    def renamed(*args, **kwargs):  # what a renamed attribute inside torch's dump raises
        raise AttributeError("module 'torch._C._distributed_c10d' has no attribute '_fr_buffer'")

    torch._C._distributed_c10d._dump_fr_trace = renamed
    cap = wj.capture(os.path.join(d, "run"))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    cap.point("built", model=model)
    for i in range(3):  # the reducer's all-reduces: issued from C++, Flight Recorder's to fill
        model(torch.ones(2, 4)).sum().backward()
        cap.point(f"step{i}", model=model)
    cap.close()
    dist.destroy_process_group()
    print("job done", flush=True)
"""


def test_a_job_whose_torch_renamed_the_dump_says_it_once_and_goes_on(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_CAPTURE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=180,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "job done", run.stdout
    said = [line for line in run.stderr.splitlines() if "Flight Recorder's record is no longer read" in line]
    assert len(said) == 1, run.stderr[-3000:]
    assert "_dump_fr_trace" in said[0] and "AttributeError" in said[0], said
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
