"""Whose line issued a collective: the user's own (a scenario file, a test), whatever workbench mode sits between."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

RAGGED = '''
import torch
import torch.distributed as dist
import workbench as wb

sc = wb.Scenario("ragged-broadcast")


@sc.step
def send(ctx):
    x = torch.ones(7 + ctx.rank)  # rank 0 sends 7 floats, rank 1 posts 8: gloo accepts it silently
    dist.broadcast(x, src=0)
'''
LINE = RAGGED.splitlines().index("    dist.broadcast(x, src=0)") + 1  # the file starts with RAGGED's first line


def test_a_scenario_file_run_by_the_cli_names_the_users_line(tmp_path):
    path = tmp_path / "ragged.py"
    path.write_text(textwrap.dedent(RAGGED))
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "run", f"{path}:sc", "--timeout", "8",
                          "--no-progress", "--json", str(tmp_path / "run.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if "diagnosis" in ln)
    assert "(collective-mismatch)" in line and "different sizes" in line, line
    where = f"ragged.py:{LINE} send"
    assert f"rank 0: broadcast #1 float32 [7] 28 B src=0 at {tmp_path.name}/{where}" in line, line
    assert f"rank 1: broadcast #1 float32 [8] 32 B src=0 at {tmp_path.name}/{where}" in line, line
    assert "poison.py" not in out.stdout
    assert json.loads((tmp_path / "run.json").read_text())["diagnosis"]
