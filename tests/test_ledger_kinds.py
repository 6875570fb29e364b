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


# Every collective kind torch.distributed offers -> the op rank 0's first row of it reads as (rank 0 takes the side
# that waits for its peer: the receiver, a rooted call's non-root). ``tests/jobs/held_back_job.py`` issues them.
KINDS = {
    "barrier": "barrier", "monitored_barrier": "monitored_barrier", "all_reduce": "all_reduce",
    "async_all_reduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce", "gather": "gather",
    "scatter": "scatter", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter_tensor", "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all_single", "all_reduce_coalesced": "all_reduce_coalesced",
    "coalescing_manager": "all_reduce_coalesced", "send_recv": "recv", "isend_irecv": "recv",
    "batch_isend_irecv": "recv", "send_recv_object_list": "recv", "all_gather_object": "all_gather",
    "broadcast_object_list": "broadcast", "scatter_object_list": "broadcast", "gather_object": "all_gather",
    "functional_all_reduce": "all_reduce",
}
# Not seen by the calls ledger, as its docstring says: functional collectives pass no function of torch.distributed.
NOT_IN_CALLS = {"functional_all_reduce"}


def _said(stdout: str, word: str) -> dict[str, list[str]]:
    """kind -> the states the job printed after ``word`` (``HELD``: rank 0's rows while rank 1 held back)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith(word + " "):
            _, kind, states = line.split(" ", 2)
            out[kind] = json.loads(states)
    return out


@pytest.mark.parametrize("mode", ["calls", "full"])
def test_no_row_ends_before_its_peer_joins(tmp_path, mode):
    """For every kind, rank 0's row stays open while rank 1 holds back (it read the row, looked again half a second
    later) and ends completed once rank 1 joined. Before, a bare ``Work`` (barrier, send, recv, reduce, gather,
    all_to_all_single, the coalesced calls) and gloo's work without a future (reduce_scatter) ended their row as
    the op returned, before the call did: a deadlock through them was never proven."""
    kinds = [k for k in KINDS if not (mode == "calls" and k in NOT_IN_CALLS)]
    run = _torchrun("held_back_job.py", str(tmp_path / "out"), mode, ",".join(kinds))
    assert run.returncode == 0, run.stderr[-3000:]
    held, after = _said(run.stdout, "HELD"), _said(run.stdout, "AFTER")
    ended_early = {k: held.get(k) for k in kinds if not held.get(k) or "started" not in held[k]}
    assert not ended_early, f"rank 0's rows ended (or never started) while its peer held back: {ended_early}"
    unended = {k: after.get(k) for k in kinds if not after.get(k) or set(after[k]) != {"completed"}}
    assert not unended, f"rank 0's rows not completed after its peer joined: {unended}"
    rows = sorted(_rows(tmp_path / "out" / "rank0" / "rank0.jsonl").values(), key=lambda r: r["t"])
    first = {}
    for row in rows:
        first.setdefault(row.get("label"), row["op"])
    assert {k: first.get(k) for k in kinds} == {k: KINDS[k] for k in kinds}
    # Flight Recorder's complement adds only what C++ issued (gloo's reduce_scatter runs an all_reduce of its own),
    # never a call the ledger has: it wrote the barrier after a send again, as a C++ call, where gloo's count of
    # the send shifted the backend's numbers from the record's
    ours = {(r["op"], r.get("caller")) for r in rows if r.get("source") != "flight_recorder"}
    again = [(r["op"], r["seq"], r.get("caller")) for r in rows if r.get("source") == "flight_recorder"
             and (r["op"], r.get("caller")) in ours]
    assert not again, f"rows the ledger had, written again from Flight Recorder's record: {again}"


JOB = [sys.executable, "-m", "workbench.cli", "job"]


def _job(out: Path, *args: str) -> subprocess.CompletedProcess:
    """``data_runs_dry_job.py`` under ``workbench job``, nobody watching (no TTY): a proven deadlock is said and
    ended after ``--attach-deadline``. Without the proof it would wait for gloo's own timeout (30 min): 300 s."""
    env = _env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return subprocess.run([*JOB, str(out), "--hang-after", "2", "--attach-deadline", "5", "--", *TORCHRUN,
                           str(JOBS / "data_runs_dry_job.py"), *args], capture_output=True, text=True, env=env,
                          cwd=out.parent, stdin=subprocess.DEVNULL, timeout=300)


def _report(out: Path) -> str:
    got = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(out)], capture_output=True, text=True,
                         env=_env(), cwd=out.parent, timeout=300)
    return got.stdout + got.stderr


# what each rank waits in: rank 1's data ran dry a step early (3 batches to rank 0's 4), so rank 0's fourth call of
# the loop meets rank 1's barrier, the fourth call of group 0 on rank 1
PARTINGS = {"all_reduce": ("all_reduce #4 on group 0", ()), "send": ("recv #4 on group 0:1->0", ("send",))}


@pytest.mark.parametrize("kind", PARTINGS)
def test_a_deadlock_through_the_final_barrier_is_proven_named_and_ended(tmp_path, kind):
    """Rank 1 waits in its final barrier while rank 0 waits in the step's all_reduce (or its recv from rank 1):
    the ledgers prove it past --hang-after, the line names both ranks' calls, every rank ends (exit status 1) after
    --attach-deadline, as docs/your-code.md promises, and the report's sentence names both. Before, the barrier's
    row ended as it began: no proof, the job waited for gloo's timeout."""
    out = tmp_path / "cap"
    got = _job(out, *PARTINGS[kind][1])
    zero = f"rank 0 waits in {PARTINGS[kind][0]}"
    one = "rank 1 waits in barrier #4 on group 0"
    assert got.returncode == 1, got.stderr[-3000:]
    # the job's own output: the three steps both ranks took, printed by rank 0, and nothing of ours
    assert [ln.split(" loss ")[0] for ln in got.stdout.splitlines()] == ["step 0", "step 1", "step 2"], got.stdout
    proven = [ln for ln in got.stderr.splitlines() if ln.startswith("workbench: the ledgers proved a deadlock")]
    assert len(proven) == 1 and zero in proven[0] and one in proven[0], got.stderr[-3000:]
    for r in (0, 1):
        assert f"workbench: rank {r} ends now (exit status 1): the ledgers proved a deadlock ({zero}" in got.stderr
    pm = json.loads((out / "attach.json").read_text())
    assert pm["status"] == "resumed" and pm["by"] == "deadline" and pm["post_mortem"]["reason"] == "deadlock"
    sentence = _report(out)
    assert "rank 0" in sentence and PARTINGS[kind][0].split(" on ")[0] in sentence, sentence
    assert "rank 1" in sentence and "barrier #4" in sentence, sentence


# -- the same parting in a live session: declared from the ledgers while the step runs, and released -----------
def _dry(ctx) -> None:
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:  # its data ran dry: it goes to the final barrier
        dist.barrier()
    elif ctx.kind == "send":
        dist.recv(torch.zeros(()), src=1)
    else:
        dist.all_reduce(torch.ones(()))


@pytest.mark.parametrize("kind", PARTINGS)
def test_in_a_live_session_the_barrier_parting_is_declared_and_released(healthy, kind):
    """docs/collectives.md: a deadlock is declared from the ledgers, not waited for, and only the calls that can
    never complete are released; through a barrier too (before, its row ended as it began: gloo's timeout). The
    recv-against-barrier parting is a cycle across two groups (the channel 0:1->0 and group 0): no group proves
    it alone (before, gloo's timeout ended it)."""
    import workbench as wb

    sc = wb.Scenario(f"dry-{kind}", probe=None)

    def step(ctx) -> None:
        ctx.kind = kind
        _dry(ctx)

    sc.step(step, name="last")
    s = healthy.session(sc)
    frame = s.step()
    assert frame.hang is not None and frame.hang.caught_by == "ledger deadlock", frame.rank_errors
    assert sorted(frame.released) == [0, 1] and set(frame.hang.stuck) == {0, 1}, frame.rank_errors
    d = s.diagnose()
    assert "barrier #" in d.sentence and PARTINGS[kind][0].split(" #")[0] in d.sentence, d.sentence
    assert healthy.wait_idle(5) and not healthy.dead_ranks()  # no rank is left inside its call
