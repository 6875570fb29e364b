"""The CLI as a user runs it: real engines in a subprocess, JSON and HTML out, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "workbench.cli"]
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "bundles" / "fsdp1-rotary-meta-init.wbundle"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["run", "no-such-incident"], "unknown scenario 'no-such-incident'; valid: "),
    (["run", "fsdp1-rotary-meta-init", "--fix", "nope"], "valid: cast-params-only, recompute-after-wrap"),
    (["run", "fsdp1-rotary-meta-init", "--set", "nope=1"], "unknown parameter"),
    (["run", "fsdp1-rotary-meta-init", "--set", "head_dim=abc"], "expected int"),
    (["run", "fsdp1-rotary-meta-init", "--ranks", "0"], "ranks must be >= 1"),
    (["run", "missing/file.py:sc"], "does not exist"),
])
def test_bad_input_is_one_line_without_traceback(args, needle):
    out = cli(*args, timeout=60)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_list_names_every_scenario_and_fix():
    out = cli("list", timeout=60)
    assert out.returncode == 0
    assert "fsdp1-rotary-meta-init" in out.stdout and "--fix cast-params-only" in out.stdout
    # a declared non-fix is flagged, and a doc's first sentence survives a dotted name inside it
    line = next(x for x in out.stdout.splitlines() if "--fix recompute-after-wrap" in x)
    assert "NON-FIX" in line
    line = next(x for x in out.stdout.splitlines() if "--fix materialize-meta-only" in x)
    assert "Module._apply with an is_meta guard" in line


def test_run_writes_json_in_the_frames_vocabulary_and_a_report(tmp_path):
    js, html = tmp_path / "run.json", tmp_path / "r.html"
    out = cli("run", "fsdp1-rotary-meta-init", "--timeout", "8", "--json", str(js), "--report", str(html),
              "--set", "seq_len=8")
    # The bug path's wrap deadlocks on gloo (rank 0's call released): a run whose steps failed exits 1, its outputs
    # still written.
    assert out.returncode == 1 and "1 step(s) failed (bug path: wrap_fsdp1)" in out.stderr, out.stderr[-2000:]
    summary = out.stdout[out.stdout.index("== fsdp1-rotary-meta-init"):]
    assert summary.splitlines()[2].startswith("  diagnosis (reinterpreted): rank 1's `inv_freq` is rank 0's fp32")
    assert "tensors not ok after 'forward'" in summary and len(summary.splitlines()) < 25  # grouped, not per tensor
    doc = json.loads(js.read_text())
    assert {"scenario", "fix", "backend", "ranks", "frames", "outputs", "diagnosis"} <= set(doc)
    assert doc["diagnosis"]["mechanism"] == "reinterpreted" and doc["diagnosis"]["step"] == "cast"
    assert doc["backend"] == "gloo" and doc["ranks"] == 2 and doc["params"]["seq_len"] == 8
    assert [f["step"] for f in doc["frames"]] == ["load", "cast", "wrap_fsdp1", "forward"]
    wrap = doc["frames"][2]
    assert set(wrap["rank_errors"]) == {"0"} and wrap["hang"]["caught_by"] == "ledger deadlock"
    row = next(r for r in wrap["tensors"] if r["rank"] == 1 and r["name"].endswith("rotary_emb.inv_freq"))
    assert {"rank", "name", "kind", "dtype", "is_meta", "nan", "inf", "head", "fingerprint"} <= set(row)
    assert row["dtype"] == "bfloat16" and row["kind"] == "non-persistent buffer" and row["head"][:2] == [0.0, 1.0]
    logits = {r["rank"]: r for r in doc["outputs"]["logits"]}
    assert logits[0]["nan"] == 0 and logits[1]["nan"] == logits[1]["numel"]
    page = html.read_text()
    assert "plotly" in page.lower() and "<script" in page and "fsdp1-rotary-meta-init" in page


def test_make_demo_the_main_job_succeeds_and_says_the_failure_is_the_incident():
    """`make demo` is the README's first command: the bug path's failed step is the incident it
    shows, not a failed demo, so make must not end with 'Error 1'; a missing report still fails it."""
    import pathlib
    import shutil

    root = pathlib.Path(__file__).resolve().parent.parent
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    report = root / "reports" / "fsdp1-rotary-meta-init.html"
    out = subprocess.run(["make", "-s", "demo"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    assert "diagnosis (reinterpreted): rank 1's `inv_freq` is rank 0's fp32 bytes" in out.stdout
    assert report.stat().st_size > 10_000
    assert "demo: the bug path failed as the incident does" in out.stdout


# -- outputs never lost ----------------------------------------------------------
def test_outputs_naming_one_file_are_refused_before_engines_start(tmp_path):
    o = str(tmp_path / "o")
    out = cli("run", "fsdp1-rotary-meta-init", "--json", o, "--bundle", o + ".wbundle", "--report", o, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--report" in out.stderr and "same file as --json" in out.stderr and "Traceback" not in out.stderr
    out = cli("run", "fsdp1-rotary-meta-init", "--json", o + ".wbundle", "--bundle", o, timeout=60)
    assert out.returncode == 2 and "same file as --json" in out.stderr  # --bundle o writes o.wbundle
    assert list(tmp_path.iterdir()) == []


def test_report_onto_its_own_bundle_is_refused_and_the_bundle_kept(tmp_path, capsys):
    import shutil

    from workbench.cli import main
    from workbench.postmortem import bundle

    b = tmp_path / "v.wbundle"
    shutil.copy(FIXTURE, b)
    before = b.read_bytes()
    assert main(["report", str(b), "-o", str(b)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bundle itself" in err
    d = bundle.unpack(b, tmp_path / "unpacked")
    assert main(["report", str(d), "-o", str(d / "manifest.json")]) == 2
    assert b.read_bytes() == before and len(bundle.load(d)) == len(bundle.load(b))


TINY_FILE = '''
import workbench as wb

SCENARIO = wb.Scenario("tiny-cli", probe=None)


@SCENARIO.step
def hello(ctx):
    import torch
    for i in range(200):
        print("line", i)
    ctx.output("x", torch.ones(2) * ctx.rank)
'''


def test_a_closed_stdout_pipe_still_writes_the_bundle(tmp_path):
    """`workbench run ... --bundle b | head -1`: the reader goes away; the run still ends cleanly."""
    sc = tmp_path / "tiny.py"
    sc.write_text(TINY_FILE)
    b = tmp_path / "b.wbundle"
    proc = subprocess.Popen([*CLI, "run", f"{sc}:", "--timeout", "8", "--bundle", str(b), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each line reaches the pipe at once
    proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err
    from workbench.postmortem import bundle

    assert bundle.load(b).scenario == "tiny-cli"
