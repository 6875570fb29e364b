"""The capture is a guest in the user's job: its own faults never change the job's fate (issue 49).

Real torchrun (2 ranks, gloo, CPU) runs ``tests/fault_job.py`` with a real fault on each rank: a shard on a
tiny tmpfs that fills up before step 2, a path below a regular file, a read-only mount, an object the probe
cannot read, a bug planted in the ledger's and in the poison's hook. Each faulty rank says one line on
stderr (the cause and what was kept), its capture turns itself off, and the job runs to its own end: rc 0,
every step's loss printed, no traceback. ``strict=True`` raises instead; an install that fails half way
leaves nothing installed. A rank killed after a point is named dead, with the surviving rank's own error.
The mounts need root (CI runs as root); without it those cases skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
import workbench.job as wj

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "fault_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "WORKBENCH_CAPTURE",
              "WORKBENCH_CAPTURE_LEDGER", "TORCHELASTIC_RUN_ID")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _run(tmp: Path, *args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, *launcher, str(JOB), str(tmp / "out"), *args], capture_output=True,
                          text=True, timeout=300, env=_env(), cwd=tmp)


@pytest.fixture
def mounts():
    """Mount tiny tmpfs file systems (root only); every one is unmounted at the end, whatever happened."""
    made: list[Path] = []

    def mount(where: Path, size: str = "256k", read_only: bool = False) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root; CI runs as root): {got.stderr.strip()}")
        made.append(where)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        return where

    yield mount
    for where in reversed(made):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# rank -> (fault, what its one line says after "workbench: rank R: capture stopped ")
CASES = {
    "path-and-full-disk": {
        0: ("unmakeable-path", r"at capture: not a directory \(\S*a-file-0/runs\S*\); nothing was kept"),
        1: ("full-disk", r"at point `step2`: no space left on device \(\S*rank1\); \S*rank1 keeps 2 point\(s\) up "
                         r"to `step1`")},
    "read-only-and-odd-object": {
        0: ("read-only", r"at capture: read-only file system \(\S*/ro/runs\S*\); nothing was kept"),
        1: ("odd-object", r"at point `step1`: RuntimeError: this wrapper's parameters cannot be listed here; "
                          r"\S*rank1 keeps 1 point\(s\) up to `step0`")},
    "hook-bugs": {
        0: ("ledger-bug", r"in the ledger's hook: ZeroDivisionError: a bug in the ledger's hook; \S*rank0 keeps "
                          r"0 point\(s\)"),
        1: ("poison-bug", r"in the poison's hook: ZeroDivisionError: a bug in the poison's hook; \S*rank1 keeps "
                          r"0 point\(s\)")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_in_the_capture_is_one_line_and_the_job_runs_to_its_end(case, tmp_path, mounts):
    faults = CASES[case]
    args = [a for r, (fault, _) in faults.items() for a in ("--fault", f"{r}={fault}")]
    if case == "path-and-full-disk":
        mounts(tmp_path / "out" / "rank1")  # rank 1's shard on a disk of its own, 256 KB
    if case == "read-only-and-odd-object":
        mounts(tmp_path / "ro", read_only=True)
        args += ["--read-only", str(tmp_path / "ro")]
    run = _run(tmp_path, *args)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    # the job's own output, whole: every step's loss on both ranks (the same: they all-reduce it), then done
    losses = {(int(r), int(s)): v for r, s, v in re.findall(r"^rank (\d) step (\d) loss (\S+)$", run.stdout, re.M)}
    assert len(losses) == 8 and all(losses[0, s] == losses[1, s] for s in range(4)), run.stdout
    assert sorted(re.findall(r"^rank (\d) done$", run.stdout, re.M)) == ["0", "1"], run.stdout
    said = [line for line in run.stderr.splitlines() if line.startswith("workbench:")]
    assert len(said) == 2, run.stderr[-4000:]
    for r, (_, expect) in faults.items():
        mine = [line for line in said if line.startswith(f"workbench: rank {r}: ")]
        assert len(mine) == 1, said
        assert re.fullmatch(rf"workbench: rank {r}: capture stopped {expect}; the job goes on without it", mine[0]), \
            mine[0]
    if case == "path-and-full-disk":  # what was written before the disk filled still opens
        rec = wb.load(tmp_path / "out").bug
        assert sorted(set(rec.tensors[rec.tensors["rank"] == 1]["step"])) == ["step0", "step1"]


def _stacks() -> tuple[int, int]:
    import torch

    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


@pytest.fixture
def alone(monkeypatch):
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORKBENCH_JOB_ID", "faults")


def test_strict_raises_and_the_default_is_one_line(tmp_path, alone, capfd):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError):
        wj.capture(tmp_path / "a-file" / "runs", strict=True)
    cap = wj.capture(tmp_path / "a-file" / "runs")
    assert not cap.enabled and cap.point("p") is None
    err = capfd.readouterr().err
    assert re.fullmatch(r"workbench: rank 0: capture stopped at capture: not a directory \(\S+\); nothing was kept; "
                        r"the job goes on without it\n", err), err


@pytest.mark.parametrize("blocked", ["stacks.txt", "rank0.jsonl"])
@pytest.mark.parametrize("ledger", [True, "calls"])
def test_an_install_that_fails_half_way_leaves_nothing_installed(tmp_path, alone, blocked, ledger):
    """The stacks file (or the ledger's) cannot be opened: what was installed before it is undone."""
    import torch.distributed as dist
    from torch import nn

    from workbench.rank import poison

    (tmp_path / "runs" / "rank0" / blocked).mkdir(parents=True)  # a directory where the file goes
    before = (_stacks(), sys.excepthook, dist.all_reduce, nn.Module.to_empty, poison._STATE["poison"])
    with pytest.raises(IsADirectoryError):
        wj.capture(tmp_path / "runs", ledger=ledger, strict=True)
    assert (_stacks(), sys.excepthook, dist.all_reduce, nn.Module.to_empty, poison._STATE["poison"]) == before


def test_a_failing_hook_turns_the_capture_off_and_its_modes_go(tmp_path, alone, monkeypatch, capfd):
    import torch

    from workbench.rank import poison

    before = _stacks()
    cap = wj.capture(tmp_path / "runs", ledger=True, poison=True)  # both modes (no longer the defaults)
    assert cap.point("first", model=torch.nn.Linear(2, 2))["rows"] == 2
    assert _stacks() == (before[0] + 1, before[1] + 1)

    def broken(*a, **k):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(poison, "track", broken)
    x = torch.empty(3)  # the job's own call: it gets its tensor, whatever the hook did
    assert x.shape == (3,)
    assert cap.point("second") is None and not cap.enabled
    assert _stacks() == before  # both modes gone at the job's next call into the capture
    cap.close()
    err = capfd.readouterr().err
    assert err.count("workbench:") == 1 and "in the poison's hook: ZeroDivisionError: planted" in err, err


def test_an_unknown_ledger_mode_in_the_environment_is_refused_in_one_line(tmp_path, alone, monkeypatch, capfd):
    monkeypatch.setenv("WORKBENCH_CAPTURE_LEDGER", "cals")
    with wj.capture(tmp_path / "runs", ledger="calls", poison=False) as cap:
        assert cap.doc["ledger"] == "calls"  # the script's own choice stands, not the most expensive mode
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "WORKBENCH_CAPTURE_LEDGER='cals'" in err, err
    with pytest.raises(ValueError, match="WORKBENCH_CAPTURE_LEDGER"):
        wj.capture(tmp_path / "runs", strict=True)
    monkeypatch.setenv("WORKBENCH_CAPTURE_LEDGER", "0")
    with wj.capture(tmp_path / "runs", poison=False) as cap:
        assert cap.doc["ledger"] is False


def test_a_point_keeps_no_strong_reference_to_its_objects_without_attach(tmp_path, alone):
    import gc
    import weakref

    import torch

    with wj.capture(tmp_path / "runs", poison=False, ledger=False) as cap:
        model = torch.nn.Linear(4, 4)
        ref = weakref.ref(model)
        cap.point("p", model=model)
        del model
        gc.collect()
        assert ref() is None


def test_a_killed_rank_is_named_dead_with_the_survivors_error(tmp_path):
    """Rank 1 SIGKILLs itself after point step1; rank 0 fails in the all-reduce it waited in and serves post mortem
    (2 s, no client). The job takes torchrun's SIGTERM itself (as one that checkpoints on preemption), so rank 0
    serves before it exits. The report and the post mortem's account both name rank 1 dead."""
    run = _run(tmp_path, "--fault", "1=die", "--attach", "on-error", "--deadline", "2", "--own-sigterm")
    assert run.returncode != 0
    out = tmp_path / "out"
    rec = wb.load(out).bug
    d = rec.diagnose()
    dead = "rank 1 stopped after point `step1` (its shard ends without a close: killed or crashed)"
    head = f"{dead}; rank 0 failed in all_reduce #3: "
    led = rec.ledger
    error = led[(led["rank"] == 0) & (led["seq"] == 3)]["error"].iloc[0]
    assert error and d.sentence == head + error, d.sentence
    report = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(out)], capture_output=True,
                            text=True, timeout=120, env=_env(), cwd=tmp_path)  # its page goes beside the job
    assert head in report.stdout, report.stdout + report.stderr
    account = json.loads((out / "attach.json").read_text())["post_mortem"]
    assert account["ranks"]["1"]["role"] == "dead"
    assert account["line"].startswith("rank 0 raised RuntimeError: ") and account["line"].endswith(f"; {dead}"), \
        account["line"]
    assert "did not say their engines stopped" not in run.stderr  # a dead rank is not waited for


def test_a_breakpoint_whose_controller_cannot_start_says_so_in_one_line(tmp_path, alone, capfd):
    with wj.capture(tmp_path / "runs", poison=False, ledger=False) as cap:
        (tmp_path / "runs" / "attach").write_text("a file where the breakpoint's folder goes\n")
        how = cap.breakpoint(deadline=5)
    assert how["by"] == "error"
    err = capfd.readouterr().err
    assert re.fullmatch(r"workbench: rank 0: no breakpoint: the controller did not start \(FileExistsError: .*\); "
                        r"every rank goes on\n", err), err


def test_a_full_disk_when_the_job_raises_is_one_line_before_the_jobs_own_traceback(tmp_path, mounts):
    disk = mounts(tmp_path / "disk", size="64k")
    script = (f"import workbench.job as wj\n"
              f"cap = wj.capture({str(disk)!r}, poison=False, ledger=False)\n"
              f"with open({str(disk / 'filler')!r}, 'wb', buffering=0) as f:\n"
              f"    try:\n        while True: f.write(bytes(4096)); f.flush()\n    except OSError: pass\n"
              f"raise ValueError('the job fails on its own')\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**_env(), "WORKBENCH_JOB_ID": "x"}, cwd=tmp_path)
    assert run.returncode == 1
    lines = run.stderr.splitlines()
    said = [line for line in lines if line.startswith("workbench:")]
    assert said == [f"workbench: rank 0: capture stopped recording the job's exception: no space left on device "
                    f"({disk / 'rank0'}); {disk / 'rank0'} keeps 0 point(s); the job goes on without it"], run.stderr
    assert lines.index(said[0]) < lines.index("Traceback (most recent call last):")
    assert lines[-1] == "ValueError: the job fails on its own"


def _published(row: dict) -> str:
    """A ledger row as a rank's watcher publishes its open call in the job's store."""
    from workbench.job.triggers import KEEP

    return json.dumps([{k: row.get(k) for k in KEEP}], default=str)


def test_the_deadlock_proof_pairs_calls_by_the_analysis_rule(healthy):
    """The post mortem's proof pairs two ranks' open calls as the analysis does (``mismatch_kind``): every op used
    right, as the ledger recorded it on real gloo ranks, is one call on both ranks (a scatter's root records its
    whole list, the receiver one tensor), so ranks waiting in it past ``hang_after`` are no proof; a planted dtype
    mismatch is one."""
    import torch.distributed as dist
    from test_ledger_ops import OPS, _scenario

    from workbench.job import keys, triggers

    def pairs(names: list[str], plant: str = "") -> dict:
        """Each call both ranks made, as their ledger files hold it (read as the job's watcher reads them)."""
        from workbench.rank.ledger_read import LedgerReader

        s = healthy.session(_scenario(names, plant=plant))
        s.run()
        reader = LedgerReader(s.ledger_dir)
        reader.poll()
        out: dict = {}
        for row in reader.calls():
            out.setdefault((row["step"], str(row["group"]), int(row["seq"])), {})[int(row["rank"])] = row
        return {k: v for k, v in out.items() if len(v) == 2}

    right = pairs(OPS)
    assert {k[0] for k in right} == set(OPS)
    assert [k for k, v in right.items() if not triggers._same(v[0], v[1])] == []
    store = dist.HashStore()
    scatter = next(v for k, v in right.items() if k[0] == "scatter")
    key = keys.Attach("pm")
    for r in (0, 1):
        store.set(key.open(r), _published(scatter[r]))
    assert triggers._prove(store, key, 2) is None  # both wait in the same scatter: slow, not deadlocked
    planted = next(v for k, v in pairs(["scatter"], plant="scatter").items() if k[0] == "scatter")
    assert not triggers._same(planted[0], planted[1])
    for r in (0, 1):
        store.set(key.open(r), _published(planted[r]))
    proof = triggers._prove(store, key, 2)
    assert proof is not None and proof["ranks"] == [0, 1]


def test_a_full_disk_on_the_writer_thread_is_the_same_one_line(tmp_path, alone, mounts, monkeypatch, capfd):
    """A GPU job's points are finished on the capture's writer thread (``job/writer.py``; forced here on CPU): the
    point returns at once, its line is on disk after ``flush``, and the writer's fault is the same one line as the
    job's thread's, counting only the points written; the capture is off from the job's next call."""
    import torch

    monkeypatch.setenv("WORKBENCH_CAPTURE_WRITER", "thread")
    disk = mounts(tmp_path / "disk", size="64k")
    cap = wj.capture(disk / "runs", poison=False, ledger=False)
    # a line over a page (12 rows): the next line always needs a page of its own (a short one may still fit the
    # last page its file holds, and the manifest is rewritten at most once a second: ``MANIFEST_EVERY_S``)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    info = cap.point("step0", model=model)
    assert cap._writer is not None and cap.flush() and info["bytes"] > 4096
    shard = disk / "runs" / "rank0"
    lines = (shard / "points.jsonl").read_text().splitlines()
    assert info["bytes"] == len(lines[-1]) + 1 and json.loads(lines[-1])["point"] == "step0"
    with open(disk / "filler", "wb", buffering=0) as f:  # another writer fills the disk, to the last byte
        for chunk in (4096, 1):
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * chunk)
    assert cap.point("step1", model=model) is not None  # handed over: the job's thread does not meet the disk
    cap.flush()
    assert cap.point("step2", model=model) is None and not cap.enabled
    cap.close()
    err = capfd.readouterr().err
    # the count said is the count on disk
    written = [json.loads(x)["point"] for x in (shard / "points.jsonl").read_text().splitlines() if x.endswith("}")]
    assert written[0] == "step0" and "step2" not in written
    assert re.fullmatch(r"workbench: rank 0: capture stopped at point `step1`: no space left on device \(\S+\); "
                        rf"\S+rank0 keeps {len(written)} point\(s\) up to `{written[-1]}`; "
                        r"the job goes on without it\n", err), err


def test_a_point_holds_collection_off_only_while_its_rows_live(tmp_path, alone, monkeypatch):
    """A full collection in a GPU job's next step took 0.4-0.5 s after a point made one due (2 x H200): the capture
    holds automatic collection off from the point until its rows are written, then gives it back; the last point is
    kept as its line, so its rows do not age into the oldest generation; a user's own ``gc.disable()`` stands."""
    import gc

    import torch

    monkeypatch.setenv("WORKBENCH_CAPTURE_WRITER", "thread")
    cap = wj.capture(tmp_path / "runs", poison=False, ledger=False)
    seen: list[bool] = []
    finish = cap._finish_point

    def watched(*args):
        seen.append(gc.isenabled())
        return finish(*args)

    cap._finish_point = watched
    cap.point("p0", model=torch.nn.Linear(2, 2))
    assert cap.flush() and seen == [False] and gc.isenabled()
    assert isinstance(cap._latest, str) and cap.latest["point"] == "p0" and len(cap.latest["tensors"]) == 2
    gc.disable()
    try:
        cap.point("p1", model=torch.nn.Linear(2, 2))
        assert cap.flush() and seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
    cap.close()


def test_a_process_forked_while_a_point_holds_collection_starts_with_it_on(tmp_path, alone):
    """A DataLoader's worker forked while the writer still writes a point must not inherit the hold."""
    import gc

    from workbench.job import writer

    hold = writer.GcHold()
    hold.hold()
    try:
        assert not gc.isenabled()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave at once
            os.write(w, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 1) == b"1"
    finally:
        hold.release()
    assert gc.isenabled()
