"""A notebook attached to a running FSDP2 job at ``cap.breakpoint()``, timed (issue 37's GPU proof).

    python scripts/job_attach_gpu.py --shape tiny                      # CPU: 2 ranks, gloo
    python scripts/job_attach_gpu.py --shape qwen3-1.7b --repeat 3     # one rank per GPU, NCCL
    bash scripts/job_attach_gpu.sh                                     # the device machine (4 GPUs)

The client (this process) launches ``torchrun --nproc-per-node N`` of this same file in the job role:
a Qwen3-shaped model (``scripts/job_capture_cost.py``'s shapes; ``qwen3-1.7b``: 28 layers, hidden 2048,
bf16) built on meta, ``fully_shard``-ed per layer, ``to_empty`` and initialised, a few SGD steps with
``wj.capture`` (a point at every step), then ``cap.breakpoint(deadline=..., opt=opt)`` on every rank,
then one more step and a result line. While the job waits, the client (same machine, a separate
process, as a notebook would be) waits for ``attach.json`` and times ``wb.connect(job=dir)``,
``cluster.probe("model")`` (first and second call), one ``cluster.run`` that changes the job (doubles
the final norm's weight on every rank and sets the optimizer's lr) and ``cluster.resume()``. The job
reports breakpoint-to-controller-up (``attach.json``'s ``ready_s``), its engines' registration, and
when each rank got back to the script (against the client's resume call, one clock). Checked: the job
ends with rc 0, its result shows the notebook's change, and no process of the run is left.

Writes ``<out>/job_attach_<N><gpu|cpu>.json`` and ``.txt`` (min / median / max over ``--repeat`` runs)
and each run's torchrun log; ``--out`` defaults to ``$OUT``. Exit status 0 only when every run passed.

``--post-mortem`` (``MODE=post-mortem`` in the .sh): the same job under ``capture(attach="on-error")`` and a
process group whose timeout (``--pg-timeout``, 600 s) outlasts the attach; after ``--steps`` steps rank
``--raise-rank`` (1) finds a token id past the vocabulary in its batch (a host-side check, before any collective)
and raises, while the other ranks go into that step's FSDP2 all-gathers. The client times raise -> ``attach.json``
and ``wb.connect``, reads ``cluster.post_mortem`` (the raise and where each other rank waits), dumps every
rank's thread stacks (SIGUSR1, the capture's faulthandler), runs a host-side cell on every rank (which thread
serves it), probes the raising rank alone, probes every rank on a side stream, then ``cluster.probe("model")``,
then ``cluster.resume()``; a call that fails is recorded (with the stacks then) and the job's own end is timed.
Checked: the job fails (rc != 0) with rank 1's own exception in its log, and no process is left. Writes
``job_postmortem_<N><gpu|cpu>.json`` / ``.txt`` (every run's timings, a failed run's too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEW_LR = 5e-5  # what the notebook sets the optimizer's lr to (the job starts at 1e-4)


# -- the job (every rank, under torchrun) -----------------------------------------------------------------
def build(shape: str, device, world: int):
    """``scripts/job_capture_cost.py``'s model: meta build, FSDP2 per layer, ``to_empty``, initialised."""
    from transformers import Qwen3Config

    sys.path.insert(0, str(ROOT / "scripts"))
    from job_capture_cost import SHAPES, build_model

    config = Qwen3Config(attn_implementation="sdpa", **SHAPES[shape])
    return build_model(config, device, world), config


def run_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import workbench.job as wj

    t_start = time.time()
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    if args.post_mortem:  # the group's timeout past the whole attach: NCCL's watchdog must not end the waiting ranks
        import datetime

        dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    else:
        dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cap = (wj.capture(args.job_dir, attach="on-error", attach_deadline=args.deadline) if args.post_mortem
           else wj.capture(args.job_dir))
    cap.local("loss")
    model, config = build(args.shape, device, world)
    sync()
    t_built = time.time()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)

    def step(n: int) -> float:
        ids = torch.randint(1, config.vocab_size, (1, args.seq_len), generator=g)
        if args.post_mortem and n == args.raise_at and rank == args.raise_rank:
            ids[0, -1] = config.vocab_size + 7  # the data loader's bug, on one rank
        if int(ids.max()) >= config.vocab_size:  # the batch's check, on the host: before any collective
            raise RuntimeError(f"batch {n} holds token id {int(ids.max())}, past the vocabulary ({config.vocab_size})")
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # NCCL's collectives are asynchronous: a rank whose peer never joins them waits here
        cap.point(f"step{len(cap.points)}", model=model, loss=loss.detach())
        return value

    # post mortem: one step more, in which rank --raise-rank raises (the others go on into its collectives)
    losses = [step(n) for n in range(args.steps + (1 if args.post_mortem else 0))]

    def norm_abs() -> float:  # the final norm's weight, whole (an all-gather of its shards), |w| summed
        with torch.no_grad():
            return float(model.model.norm.weight.full_tensor().float().abs().sum())

    before, lr_before = norm_abs(), opt.param_groups[0]["lr"]
    sync()
    t_bp = time.time()
    how = cap.breakpoint(deadline=args.deadline, opt=opt)
    t_back = time.time()
    after, lr_after = norm_abs(), opt.param_groups[0]["lr"]
    losses.append(step(len(losses)))
    sync()
    mine = {"rank": rank, "t_bp": t_bp, "t_back": t_back, "by": how.get("by"), "attach_s": how.get("attach_s"),
            "seconds": how.get("seconds"), "total_s": how.get("total_s"), "error": how.get("error"),
            "lr_after": lr_after, "pid": os.getpid()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        doc = {"shape": args.shape, "ranks": world, "backend": dist.get_backend(), "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
               "start_to_built_s": t_built - t_start, "start_to_breakpoint_s": t_bp - t_start,
               "losses": losses, "norm_abs_before": before, "norm_abs_after": after,
               "norm_ratio": after / before if before else None, "lr_before": lr_before, "ranks_back": every}
        Path(args.job_dir, "result.json").write_text(json.dumps(doc, indent=1))
        print(f"result: breakpoint ended by {how.get('by')}; final norm |w| x{doc['norm_ratio']:.4f} "
              f"({before:.4f} -> {after:.4f}), lr {lr_before:g} -> {lr_after:g} on ranks "
              f"{sorted({e['lr_after'] for e in every})}; the step after: loss {losses[-1]:.4f}", flush=True)
    cap.close()
    dist.destroy_process_group()


# -- the notebook (this process) ---------------------------------------------------------------------------
def _notebook_change(lr: float) -> list:
    """Sent by ``cluster.run`` (as a ``%%px`` cell would run): on every rank, the final norm's weight doubled
    in place (its shard) and the optimizer's lr set."""
    import torch

    from workbench.job.engine import here

    ns = here()
    model, opt = ns["model"], ns["opt"]
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    for group in opt.param_groups:
        group["lr"] = lr
    return [int(model.model.norm.weight.to_local().numel()), opt.param_groups[0]["lr"]]


def _env(cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_CAPTURE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_procs(marker: str) -> list[dict]:
    """Processes still running whose command line names this run's directory (ranks, torchrun, controller)."""
    import psutil

    me = os.getpid()
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["pid"] != me and marker in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append({"pid": p.info["pid"], "cmd": cmd[:200]})
        except (psutil.Error, TypeError):
            continue
    return left


def _kill(proc: subprocess.Popen) -> None:
    """torchrun runs in a session of its own: the session goes, and whatever it started."""
    import psutil

    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in kids:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _launch(args: argparse.Namespace, i: int, work: Path, nproc: int) -> tuple[subprocess.Popen, Path, Path, float]:
    """torchrun of this file in the job role, in a session of its own; its output in ``torchrun_run<i>.log``."""
    job_dir = work / f"run{i}"
    log_path = work / f"torchrun_run{i}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(Path(__file__).resolve()), "--role", "job", "--job-dir", str(job_dir), "--shape", args.shape,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--deadline", str(args.deadline)]
    env = _env(args.shape == "tiny" or not _gpus())
    if args.post_mortem:
        cmd += ["--post-mortem", "--raise-rank", str(args.raise_rank), "--raise-at", str(args.steps),
                "--pg-timeout", str(args.pg_timeout)]
        # a probe whose copy sits behind a stuck collective gives up after this long (default: the deadline)
        env["WORKBENCH_PROBE_SYNC_TIMEOUT"] = str(args.probe_sync_timeout)
    t_launch = time.time()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, job_dir, log_path, t_launch


def _wait_attach(proc: subprocess.Popen, job_dir: Path, timeout: float) -> dict:
    """``attach.json`` once it says waiting (the job's rank 0 writes it when every engine can be reached)."""
    path = job_dir / "attach.json"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited (rc {proc.returncode}) before it was attachable")
        if path.exists():
            try:
                doc = json.loads(path.read_text())
            except ValueError:
                doc = None
            if doc and doc.get("status") == "waiting":
                return doc
        time.sleep(0.05)
    raise RuntimeError(f"no attach.json after {timeout}s")


def _end(rec: dict, proc: subprocess.Popen, cluster: object, job_dir: Path, log_path: Path, t_launch: float) -> dict:
    """Detach, end what is left of the job's session, list what survived, keep the log's tail of a failed run."""
    if cluster is not None and cluster.alive:
        try:
            cluster.stop()
        except Exception as exc:
            rec.setdefault("stop_error", repr(exc))
    if proc.poll() is None:
        rec["killed"] = True
    _kill(proc)  # its session may still hold a straggler
    time.sleep(0.5)
    rec["left_behind"] = _run_procs(str(job_dir))
    if rec["left_behind"] and rec["ok"]:
        rec["ok"] = False
        rec["failure"] = f"processes left behind: {rec['left_behind']}"
    rec["log_tail"] = log_path.read_text()[-3000:] if not rec["ok"] else None
    rec["total_s"] = time.time() - t_launch
    return rec


def one_run(args: argparse.Namespace, i: int, work: Path, nproc: int) -> dict:
    import workbench as wb

    proc, job_dir, log_path, t_launch = _launch(args, i, work, nproc)
    rec: dict = {"run": i, "ok": False, "failure": None}
    cluster = None
    step = "waiting for attach.json"
    try:
        doc = _wait_attach(proc, job_dir, args.launch_timeout)
        rec["launch_to_attach_json_s"] = time.time() - t_launch
        rec["controller_up_s"] = doc["ready_s"]  # the job's view: breakpoint called -> controller up, file written
        rec["names"] = doc["names"]
        step = "wb.connect(job=dir)"
        t0 = time.perf_counter()
        cluster = wb.connect(job=job_dir)
        rec["connect_s"] = time.perf_counter() - t0
        rec["attached_world"] = cluster.world_size
        rec["attached_backend"] = cluster.backend
        for k in ("first", "second"):
            step = f"cluster.probe('model') ({k})"
            t0 = time.perf_counter()
            rows = cluster.probe("model")
            rec[f"probe_{k}_s"] = time.perf_counter() - t0
            rec["probe_rows"] = len(rows)
            rec["probe_ranks"] = sorted(int(r) for r in set(rows["rank"]))
        step = "cluster.run(change)"
        t0 = time.perf_counter()
        changed = cluster.run(_notebook_change, NEW_LR)
        rec["change_s"] = time.perf_counter() - t0
        rec["change_returned"] = {str(r): v for r, v in changed.items()}
        step = "cluster.resume()"
        t_resume = time.time()
        t0 = time.perf_counter()
        done = cluster.resume()
        rec["resume_s"] = time.perf_counter() - t0
        rec["resume_by"] = done.get("by")
        rec["resume_marked_s"] = done.get("resumed_at", t_resume) - t_resume  # rank 0 marked attach.json resumed
        step = "the job's end"
        rec["rc"] = proc.wait(timeout=args.end_timeout)
        step = "result.json"
        res = json.loads((job_dir / "result.json").read_text())
        back = res["ranks_back"]
        rec["resume_to_continue_s"] = {"min": min(b["t_back"] for b in back) - t_resume,
                                       "max": max(b["t_back"] for b in back) - t_resume}
        rec["engines_registered_s"] = max(b["attach_s"] or float("nan") for b in back)
        rec["breakpoint_served_s"] = max(b["seconds"] for b in back)
        rec["job"] = {k: res[k] for k in ("device_name", "backend", "ranks", "start_to_built_s",
                                          "start_to_breakpoint_s", "losses", "norm_abs_before", "norm_abs_after",
                                          "norm_ratio", "lr_before")}
        rec["ranks_by"] = sorted({b["by"] for b in back})
        rec["lr_after"] = sorted({b["lr_after"] for b in back})
        checks = {"rc 0": rec["rc"] == 0, "every rank resumed by the client": rec["ranks_by"] == ["client"],
                  "norm doubled": res["norm_ratio"] is not None and abs(res["norm_ratio"] - 2.0) < 1e-6,
                  "lr set on every rank": rec["lr_after"] == [NEW_LR],
                  "probe saw every rank": rec["probe_ranks"] == list(range(nproc)),
                  "result line": "result: breakpoint ended by client" in log_path.read_text()}
        rec["checks"] = checks
        bad = [k for k, v in checks.items() if not v]
        if bad:
            step = "checks"
            raise RuntimeError(f"checks failed: {bad}")
        rec["ok"] = True
    except Exception as exc:
        rec["failure"] = f"at {step}: {type(exc).__name__}: {exc}"
    finally:
        _end(rec, proc, cluster, job_dir, log_path, t_launch)
    return rec


# -- post mortem (--post-mortem): rank --raise-rank raises in step --steps, the others wait in its collectives ----
def _pm_view() -> dict:
    """Sent by ``cluster.run`` to every rank (host-side only, no device work): which thread serves it, the frame
    it serves at, what its namespace holds; the raising rank's exception."""
    import threading

    import torch

    from workbench.job.engine import here

    ns = here()
    frame, exc = ns.get("frame"), ns.get("exc")
    me = threading.current_thread()
    return {"thread": me.name, "main_thread": me is threading.main_thread(),
            "exc": f"{type(exc).__name__}: {exc}"[:200] if exc is not None else None,
            "frame": f"{frame.f_code.co_name} line {frame.f_lineno}" if frame is not None else None,
            "has_model": "model" in ns, "has_opt": "opt" in ns,
            "lr": ns["opt"].param_groups[0]["lr"] if "opt" in ns else None,
            "thread_cuda_device": torch.cuda.current_device() if torch.cuda.is_initialized() else None,
            "model_device": str(next(ns["model"].parameters()).device) if "model" in ns else None}


def _probe_side_stream() -> dict:
    """``cluster.probe``'s rows computed on a fresh stream of the model's device (not the stream that sits behind
    the stuck collective), the device made current on the serving thread: what a notebook can do by hand."""
    import contextlib

    import torch

    from workbench.job.engine import here
    from workbench.rank import phases

    model = here()["model"]
    dev = next(model.parameters()).device
    t0 = time.perf_counter()
    ctx = contextlib.ExitStack()
    if dev.type == "cuda":
        ctx.enter_context(torch.cuda.device(dev))
        ctx.enter_context(torch.cuda.stream(torch.cuda.Stream(dev)))
    with ctx:
        rows = phases.probe_rows({"model": model})
    return {"rows": len(rows), "s": time.perf_counter() - t0, "nan": int(sum(r.get("nan") or 0 for r in rows)),
            "device": str(dev)}


def _probe_here() -> int:
    """``cluster.probe``'s rows on this rank alone (its own stream): sent to the raising rank by ``cluster.run``."""
    from workbench.job.engine import here
    from workbench.rank import phases

    return len(phases.probe_rows({"model": here()["model"]}))


def _dump_stacks(pids: dict, job_dir: Path, seen: dict) -> dict:
    """Every thread's Python stack on every rank, now: SIGUSR1 makes the capture's faulthandler append them to
    ``rank<r>/stacks.txt`` (it runs in C, so it answers while threads hang); the new text of each file."""
    for pid in pids.values():
        try:
            os.kill(int(pid), signal.SIGUSR1)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    time.sleep(1.0)
    out = {}
    for r in pids:
        path = job_dir / f"rank{r}" / "stacks.txt"
        try:
            text = path.read_text()
        except OSError:
            continue
        out[str(r)] = text[seen.get(r, 0):][-20000:]
        seen[r] = len(text)
    spy = os.environ.get("PYSPY")  # py-spy's native frames too, where one is given: what a C call waits in
    for r, pid in pids.items():
        if spy:
            got = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=60, check=False)
            out[f"{r} native"] = (got.stdout + got.stderr)[-20000:]
    return out


def _top_frames(dump: str, n: int = 4) -> list[str]:
    """A faulthandler dump, the threads that matter: the post-mortem watcher (``postmortem._watch`` at its bottom)
    and the main thread (the job's script, or the excepthook serving it), each as one line of its ``n`` innermost
    frames."""
    lines = []
    for block in dump.strip().split("\n\n"):
        rows = [f.strip() for f in block.strip().splitlines() if f.strip()]
        if len(rows) < 2:
            continue
        frames = [f.replace('File "', "").replace('", line ', ":") for f in rows[1:]]
        if any(f.endswith(" in _watch") and "triggers.py" in f for f in frames):
            who = "watcher thread"
        elif any("job_attach_gpu.py" in f or "workbench/job/triggers.py" in f for f in frames):
            who = "main thread"
        else:
            continue
        short = [os.path.basename(f.split(":")[0]) + ":" + f.split(":", 1)[1] if ":" in f else f for f in frames[:n]]
        lines.append(f"{who}: " + " <- ".join(short))
    return lines


def one_run_pm(args: argparse.Namespace, i: int, work: Path, nproc: int) -> dict:
    """Launch; rank --raise-rank raises in step --steps (a bad batch, caught on the host before any collective)
    while the others go on into that step's collectives; attach post mortem, read the account, probe, resume;
    the job must fail with that rank's own exception and leave no process."""
    import workbench as wb

    proc, job_dir, log_path, t_launch = _launch(args, i, work, nproc)
    raiser = args.raise_rank
    rec: dict = {"run": i, "ok": False, "failure": None, "errors": {}}
    cluster = None
    step = "waiting for attach.json"
    checks: dict = {}
    rec["checks"] = checks
    try:
        doc = _wait_attach(proc, job_dir, args.launch_timeout)
        t_seen = time.time()
        rec["launch_to_attach_json_s"] = t_seen - t_launch
        rec["kind"] = doc.get("kind")
        pm = doc.get("post_mortem") or {}
        rec["raise_to_attach_json_s"] = doc["started_at"] + doc["ready_s"] - pm["t"]  # the job's clock
        rec["raise_to_client_sees_s"] = t_seen - pm["t"]  # one host, one clock
        rec["raise_to_attach_start_s"] = doc["started_at"] - pm["t"]  # rank 0's watcher saw the trigger
        rec["controller_up_s"] = doc["ready_s"]
        rec["deadline_s"] = doc["deadline_at"] - doc["started_at"]
        rec["names"] = doc["names"]
        step = "wb.connect(job=dir)"
        t0 = time.perf_counter()
        cluster = wb.connect(job=job_dir, timeout=args.call_timeout)  # a call's deadline: 1.5 x this + 10 s
        rec["connect_s"] = time.perf_counter() - t0
        rec["attached_world"], rec["attached_backend"] = cluster.world_size, cluster.backend
        rec["call_deadline_s"] = cluster.deadline
        seen: dict = {}
        rec["stacks"] = {"attached": _dump_stacks(cluster.pids, job_dir, seen)}  # where each thread is, attached
        step = "cluster.post_mortem"
        acc = cluster.post_mortem or {}
        rec["account"] = {k: acc.get(k) for k in ("reason", "rank", "error", "where", "line")}
        rec["account_ranks"] = {r: {k: v.get(k) for k in ("role", "where", "open_calls")}
                                for r, v in (acc.get("ranks") or {}).items()}
        others = [r for r in range(nproc) if r != raiser]
        checks["account: rank raised RuntimeError (its batch)"] = (
            acc.get("reason") == "error" and acc.get("rank") == raiser
            and str(acc.get("error", "")).startswith(f"RuntimeError: batch {args.steps} holds token id"))
        checks["account: where it raised (job_attach_gpu.py, step)"] = (
            "job_attach_gpu.py:" in str(acc.get("where")) and str(acc.get("where")).endswith(" in step"))
        checks["account: every other rank waits, with a line"] = all(
            (acc.get("ranks") or {}).get(str(r), {}).get("role") == "waiting"
            and "job_attach_gpu.py:" in str((acc.get("ranks") or {}).get(str(r), {}).get("where")) for r in others)
        step = "cluster.run(view)"
        t0 = time.perf_counter()
        try:
            view = cluster.run(_pm_view)
            rec["run_view_s"] = time.perf_counter() - t0
            rec["view"] = {str(r): v for r, v in view.items()}
        except Exception as exc:
            rec["run_view_fail_s"] = time.perf_counter() - t0
            rec["errors"]["cluster.run(view)"] = f"{type(exc).__name__}: {exc}"[:2000]
            view = {}
        checks["every rank's engine answers (cluster.run)"] = sorted(view) == list(range(nproc))
        checks["raising rank serves on its main thread, at its exception"] = bool(
            view.get(raiser, {}).get("main_thread") and str(view.get(raiser, {}).get("exc")).startswith("RuntimeError"))
        checks["waiting ranks serve from the watcher thread"] = all(
            view.get(r, {}).get("thread") == "workbench-postmortem" for r in others)
        step = "cluster.run(probe) on the raising rank alone"
        t0 = time.perf_counter()
        try:
            rec["probe_raiser_rows"] = cluster.run(_probe_here, ranks=[raiser])[raiser]
            rec["probe_raiser_s"] = time.perf_counter() - t0
        except Exception as exc:
            rec["probe_raiser_fail_s"] = time.perf_counter() - t0
            rec["errors"]["cluster.run(probe) on the raising rank alone"] = f"{type(exc).__name__}: {exc}"[:3000]
        # before cluster.probe, which may hang on a waiting rank (its engine then takes no other call): the probe's
        # rows on a fresh stream of each rank's device, not the one behind the stuck collective
        step = "cluster.run(probe on a side stream)"
        t0 = time.perf_counter()
        try:
            side = cluster.run(_probe_side_stream)
            rec["probe_side_stream_s"] = time.perf_counter() - t0
            rec["probe_side_stream"] = {str(r): v for r, v in side.items()}
        except Exception as exc:
            rec["probe_side_stream_fail_s"] = time.perf_counter() - t0
            rec["errors"]["cluster.run(probe on a side stream)"] = f"{type(exc).__name__}: {exc}"[:3000]
            rec["stacks"]["side-stream probe failed"] = _dump_stacks(cluster.pids, job_dir, seen)
        for k in ("first", "second"):
            step = f"cluster.probe('model') ({k})"
            t0 = time.perf_counter()
            try:
                rows = cluster.probe("model")
                rec[f"probe_{k}_s"] = time.perf_counter() - t0
                rec["probe_rows"] = len(rows)
                rec["probe_ranks"] = sorted(int(r) for r in set(rows["rank"]))
            except Exception as exc:
                rec[f"probe_{k}_fail_s"] = time.perf_counter() - t0
                rec["errors"][f"cluster.probe('model') ({k})"] = f"{type(exc).__name__}: {exc}"[:3000]
                rec["stacks"]["probe hung"] = _dump_stacks(cluster.pids, job_dir, seen)  # where each thread hangs
                break  # the same call again says the same
        checks["cluster.probe('model') answers on every rank"] = rec.get("probe_ranks") == list(range(nproc))
        step = "cluster.resume()"
        t_resume = time.time()
        t0 = time.perf_counter()
        try:  # a rank whose engine still runs a hung cell cannot take it: the job's own end is then timed
            done = cluster.resume()
            rec["resume_s"] = time.perf_counter() - t0
            rec["resume_by"] = done.get("by")
        except Exception as exc:
            done = {}
            rec["resume_fail_s"] = time.perf_counter() - t0
            rec["errors"]["cluster.resume()"] = f"{type(exc).__name__}: {exc}"[:3000]
        checks["resumed by the client"] = done.get("status") == "resumed" and done.get("by") == "client"
        step = "the job's end"
        rec["rc"] = proc.wait(timeout=args.end_timeout)
        rec["resume_to_job_end_s"] = time.time() - t_resume
        log = log_path.read_text()
        needle = f"RuntimeError: batch {args.steps} holds token id"
        checks["job failed (rc != 0)"] = rec["rc"] != 0
        checks["the raising rank's own exception in the job's log"] = needle in log and "Traceback" in log
        rec["log_exception_lines"] = [ln for ln in log.splitlines() if needle in ln][:4]
        rec["log_failures"] = [ln.strip() for ln in log.splitlines()
                               if any(w in ln for w in ("exitcode", "rank    ", "error_file", "Watchdog", "watchdog",
                                                         "NCCL", "ProcessGroupNCCL", "SIGTERM", "Signal"))][:30]
        bad = [k for k, v in checks.items() if not v]
        if bad:
            step = "checks"
            raise RuntimeError(f"checks failed: {bad}")
        rec["ok"] = True
    except Exception as exc:
        rec["failure"] = f"at {step}: {type(exc).__name__}: {exc}"
    finally:
        _end(rec, proc, cluster, job_dir, log_path, t_launch)
    checks["no process left"] = not rec["left_behind"]
    return rec


PM_MEASURES = [
    ("launch_to_attach_json_s", "launch -> attach.json (build, steps, the raise, attach)"),
    ("raise_to_attach_start_s", "job: raise -> rank 0's watcher starts the attach"),
    ("controller_up_s", "job: attach start -> controller up, attach.json"),
    ("raise_to_attach_json_s", "job: raise -> attach.json written"),
    ("raise_to_client_sees_s", "client: raise -> attach.json seen"),
    ("connect_s", "client: wb.connect(job=dir)"),
    ("run_view_s", "client: cluster.run(view), host-side, every rank"),
    ("probe_raiser_s", "client: probe of the raising rank alone (cluster.run)"),
    ("probe_raiser_fail_s", "client: probe of the raising rank alone FAILED after"),
    ("probe_side_stream_s", "client: cluster.run(probe on a side stream)"),
    ("probe_side_stream_fail_s", "client: cluster.run(probe on a side stream) FAILED after"),
    ("probe_first_s", "client: cluster.probe('model'), first"),
    ("probe_second_s", "client: cluster.probe('model'), second"),
    ("probe_first_fail_s", "client: cluster.probe('model') FAILED after"),
    ("resume_s", "client: cluster.resume()"),
    ("resume_fail_s", "client: cluster.resume() FAILED after"),
    ("resume_to_job_end_s", "client: resume call -> the job ended (rc != 0)"),
    ("total_s", "whole run (launch -> job ended)"),
]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


MEASURES = [  # (key in a run's record, what the table calls it)
    ("launch_to_attach_json_s", "launch -> attach.json (build, steps, breakpoint)"),
    ("controller_up_s", "job: breakpoint -> controller up"),
    ("engines_registered_s", "job: engines registered (max over ranks)"),
    ("connect_s", "client: wb.connect(job=dir)"),
    ("probe_first_s", "client: cluster.probe('model'), first"),
    ("probe_second_s", "client: cluster.probe('model'), second"),
    ("change_s", "client: cluster.run(change)"),
    ("resume_s", "client: cluster.resume()"),
    ("resume_to_continue_max_s", "job: resume call -> last rank back in the script"),
    ("resume_to_continue_min_s", "job: resume call -> first rank back in the script"),
    ("total_s", "whole run (launch -> job ended)"),
]


def _pm_lines(args: argparse.Namespace, doc: dict, runs: list[dict], summary: dict, nproc: int) -> list[str]:
    """The post mortem's table (every run's timings, a failed run's too), then what the account and each call said."""
    lines = [f"issue 37: post-mortem attach to a {args.shape} FSDP2 job, {nproc} ranks ({doc['device']}, "
             f"{doc['backend']}): rank {args.raise_rank} raises in step {args.steps}, the others wait in its "
             f"collectives; {sum(r['ok'] for r in runs)}/{len(runs)} runs passed every check; seconds "
             f"(n: runs that reached it)",
             f"{'measure':<58} {'min':>7} {'median':>7} {'max':>7} {'n':>3}"]
    for key, name in PM_MEASURES:
        s = summary.get(key)
        if s:
            lines.append(f"{name:<58} {s['min']:>7.2f} {s['median']:>7.2f} {s['max']:>7.2f} {s['n']:>3}")
    for r in runs:
        lines.append(f"run {r['run']}: {'ok' if r['ok'] else 'FAILED ' + str(r['failure'])}; rc {r.get('rc')}; "
                     f"left behind {r.get('left_behind')}")
        if r.get("account"):
            lines.append(f"  account: {r['account'].get('line')}")
        for k, v in (r.get("checks") or {}).items():
            lines.append(f"  check {'ok  ' if v else 'FAIL'} {k}")
        for k, v in (r.get("errors") or {}).items():
            lines.append(f"  {k}: {v[:600]}")
        if r.get("view"):
            lines.append("  cluster.run(view): " + "; ".join(
                f"rank {k}: {v['thread']}{' (main)' if v['main_thread'] else ''} at {v['frame']}, thread's cuda "
                f"device {v['thread_cuda_device']}, model on {v['model_device']}" for k, v in r["view"].items()))
        for label, dumps in (r.get("stacks") or {}).items():
            for rank, dump in dumps.items():
                for ln in _top_frames(dump, 3):
                    lines.append(f"  stacks ({label}) rank {rank}: {ln[:400]}")
        if r.get("probe_side_stream"):
            lines.append("  side-stream probe: " + "; ".join(
                f"rank {k}: {v['rows']} rows in {v['s']:.2f}s" for k, v in r["probe_side_stream"].items()))
        for ln in r.get("log_exception_lines") or []:
            lines.append(f"  log: {ln.strip()[:200]}")
    return lines


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # a run's finally still ends its torchrun session


def client(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    gpus = _gpus()
    cpu = args.shape == "tiny" or gpus == 0
    nproc = args.nproc or (2 if cpu else gpus)
    out = Path(args.out or os.environ.get("OUT") or "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    tag = f"job_{'postmortem' if args.post_mortem else 'attach'}_{nproc}{'cpu' if cpu else 'gpu'}"
    measures = PM_MEASURES if args.post_mortem else MEASURES
    runner = one_run_pm if args.post_mortem else one_run
    work = Path(tempfile.mkdtemp(prefix="wb-job-attach-"))
    runs: list[dict] = []
    interrupted = None
    try:
        for i in range(1, args.repeat + 1):
            rec = runner(args, i, work, nproc)
            rec["resume_to_continue_max_s"] = (rec.get("resume_to_continue_s") or {}).get("max")
            rec["resume_to_continue_min_s"] = (rec.get("resume_to_continue_s") or {}).get("min")
            runs.append(rec)
            print(f"run {i}: {'ok' if rec['ok'] else 'FAILED ' + str(rec['failure'])}; "
                  + ", ".join(f"{k} {rec[k]:.2f}" for k, _ in measures if isinstance(rec.get(k), float)), flush=True)
    except KeyboardInterrupt as exc:  # a run's own finally has ended its job; what was measured is still written
        interrupted = f"interrupted ({exc}) during run {len(runs) + 1}"
    for log in sorted(work.glob("torchrun_run*.log")):
        (out / f"{tag}_{log.stem.split('_')[-1]}.log").write_text(log.read_text()[-200_000:])
    summary = {}
    for key, _ in measures:  # post mortem: a failed run's timings too (a negative finding is timed as well)
        vals = [r[key] for r in runs if (r["ok"] or args.post_mortem) and isinstance(r.get(key), float)]
        if vals:
            summary[key] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}
    job0 = next((r["job"] for r in runs if r.get("job")), {})
    if args.post_mortem and _gpus() and not cpu:
        import torch

        job0 = {"device_name": torch.cuda.get_device_name(0), "backend": "nccl"}
    elif args.post_mortem:
        job0 = {"device_name": "cpu", "backend": "gloo"}
    doc = {"issue": 37, "shape": args.shape, "ranks": nproc, "device": job0.get("device_name", "?"),
           "backend": job0.get("backend"), "steps_before": args.steps, "seq_len": args.seq_len,
           "repeat": args.repeat, "ok": bool(runs) and all(r["ok"] for r in runs) and not interrupted,
           "interrupted": interrupted, "commit": os.environ.get("WB_COMMIT", ""),
           "summary": summary, "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if args.post_mortem:
        doc.update(mode="post-mortem", raise_rank=args.raise_rank, raise_at_step=args.steps,
                   pg_timeout_s=args.pg_timeout, attach_deadline_s=args.deadline,
                   probe_sync_timeout_s=args.probe_sync_timeout)
    (out / f"{tag}.json").write_text(json.dumps(doc, indent=1))
    if args.post_mortem:
        lines = _pm_lines(args, doc, runs, summary, nproc)
    else:
        lines = [f"issue 37: attach to a {args.shape} FSDP2 job at cap.breakpoint(), {nproc} ranks "
                 f"({doc['device']}, {doc['backend']}), {sum(r['ok'] for r in runs)}/{len(runs)} runs passed; seconds",
                 f"{'measure':<52} {'min':>8} {'median':>8} {'max':>8}"]
        for key, name in MEASURES:
            s = summary.get(key)
            if s:
                lines.append(f"{name:<52} {s['min']:>8.2f} {s['median']:>8.2f} {s['max']:>8.2f}")
        ok_run = next((r for r in runs if r["ok"]), None)
        if ok_run:
            j = ok_run["job"]
            lines.append(f"probe rows {ok_run['probe_rows']} over ranks {ok_run['probe_ranks']}; the notebook's "
                         f"change seen by the job: final norm |w| x{j['norm_ratio']:.4f}, lr {j['lr_before']:g} -> "
                         f"{ok_run['lr_after']}; losses {[round(x, 4) for x in j['losses']]}; rc {ok_run['rc']}; "
                         f"left behind {ok_run['left_behind']}")
    for r in runs:
        if not r["ok"]:
            lines.append(f"run {r['run']} FAILED {r['failure']}")
    if interrupted:
        lines.append(interrupted)
    text = "\n".join(lines) + "\n"
    (out / f"{tag}.txt").write_text(text)
    print(text, end="")
    left = _run_procs(str(work))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    if left:
        print(f"left behind: {left}")
    return 0 if doc["ok"] and not left else 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["client", "job"], default="client")
    ap.add_argument("--shape", choices=["tiny", "qwen3-1.7b"], default="tiny")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: one per GPU, else 2)")
    ap.add_argument("--steps", type=int, default=2, help="training steps before the breakpoint")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--deadline", type=float, default=300.0, help="the breakpoint's deadline (s)")
    ap.add_argument("--repeat", type=int, default=1, help="whole runs, one after another (min / median)")
    ap.add_argument("--launch-timeout", type=float, default=300.0, help="seconds until attach.json")
    ap.add_argument("--end-timeout", type=float, default=120.0, help="seconds from resume to the job's end")
    ap.add_argument("--out", default=None, help="where the JSON, table and logs go (default: $OUT)")
    ap.add_argument("--job-dir", default=None, help="(job role) the capture directory")
    ap.add_argument("--post-mortem", action="store_true",
                    help="post mortem: capture(attach='on-error'), rank --raise-rank raises in step --steps")
    ap.add_argument("--raise-rank", type=int, default=1, help="(post mortem) the rank whose batch is bad")
    ap.add_argument("--raise-at", type=int, default=2, help="(job role) the step in which it raises")
    ap.add_argument("--pg-timeout", type=float, default=600.0,
                    help="(post mortem) the process group's timeout (s): NCCL's watchdog ends a stuck rank after it")
    ap.add_argument("--call-timeout", type=float, default=20.0,
                    help="(post mortem) wb.connect(timeout=): a call on the engines gives up after 1.5 x this + 10 s")
    ap.add_argument("--probe-sync-timeout", type=float, default=20.0,
                    help="(post mortem) WORKBENCH_PROBE_SYNC_TIMEOUT in the job: a probe stuck behind a collective "
                         "gives up after this long")
    args = ap.parse_args()
    if args.role == "job":
        run_job(args)
        return
    sys.exit(client(args))


if __name__ == "__main__":
    main()
