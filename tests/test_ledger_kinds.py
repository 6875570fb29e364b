"""The ledger over every kind of collective, in a user's own job on real gloo ranks (torchrun, 2 CPU ranks).

- A stack that patches torch before the job's first collective (DeepSpeed's ``zero.Init`` replaces
  ``torch.Tensor.__new__``) does not take the job down through the ledger (issue 60): the ledger takes its
  first uses of torch (``torch._dynamo``, which its dispatch mode's wrapper imports) at install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "jobs"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "WORKBENCH_CAPTURE",
              "WORKBENCH_CAPTURE_LEDGER", "TORCHELASTIC_RUN_ID")

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _torchrun(script: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, str(JOBS / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(**env))


def _rows(path: Path) -> dict[tuple, dict]:
    """(group, seq) -> the call's start row, with its end's state (``"started"`` while none)."""
    out: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        key = (ev.get("group"), ev.get("seq"))
        if ev["ev"] == "start":
            out[key] = {**ev, "state": "started"}
        elif key in out:
            out[key]["state"] = ev["state"]
    return out


@pytest.mark.parametrize("mode", ["calls", "full"])
def test_a_stack_that_replaces_tensor_new_runs_under_the_ledger(tmp_path, mode):
    """The collectives issued while ``torch.Tensor.__new__`` is DeepSpeed's ``new_tensor(cls, *args, **kwargs)``
    run and are recorded; before, the first one raised ``TypeError: Signature mismatch`` into the job."""
    run = _torchrun("tensor_new_job.py", str(tmp_path / "out"), mode)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Signature mismatch" not in run.stderr
    for rank in (0, 1):  # broadcast of rank 0's ones, then the sum over both ranks; the job's own tensor made
        assert f"rank {rank} weight [2.0, 2.0, 2.0, 2.0] made [3]" in run.stdout, run.stdout
        rows = _rows(tmp_path / "out" / f"rank{rank}" / f"rank{rank}.jsonl")
        ops = [r["op"] for r in sorted(rows.values(), key=lambda r: r["t"])]
        assert ops[:3] == ["broadcast", "all_reduce", "barrier"], ops
        assert {r["state"] for r in rows.values()} == {"completed"}, rows
