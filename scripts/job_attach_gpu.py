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
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen3Config

    sys.path.insert(0, str(ROOT / "scripts"))
    from job_capture_cost import SHAPES

    config = Qwen3Config(attn_implementation="sdpa", **SHAPES[shape])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for m in model.modules():
            if hasattr(m, "inv_freq"):
                inv, _ = m.compute_default_rope_parameters(m.config)
                m.inv_freq.copy_(inv.to(device))
                m.original_inv_freq = m.inv_freq.clone()
    return model, config


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

    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cap = wj.capture(args.job_dir)
    cap.local("loss")
    model, config = build(args.shape, device, world)
    sync()
    t_built = time.time()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)

    def step() -> float:
        ids = torch.randint(1, config.vocab_size, (1, args.seq_len), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cap.point(f"step{len(cap.points)}", model=model, loss=loss.detach())
        return float(loss)

    losses = [step() for _ in range(args.steps)]

    def norm_abs() -> float:  # the final norm's weight, whole (an all-gather of its shards), |w| summed
        with torch.no_grad():
            return float(model.model.norm.weight.full_tensor().float().abs().sum())

    before, lr_before = norm_abs(), opt.param_groups[0]["lr"]
    sync()
    t_bp = time.time()
    how = cap.breakpoint(deadline=args.deadline, opt=opt)
    t_back = time.time()
    after, lr_after = norm_abs(), opt.param_groups[0]["lr"]
    losses.append(step())
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

    from workbench.job.attach import here

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


def one_run(args: argparse.Namespace, i: int, work: Path, nproc: int) -> dict:
    import workbench as wb

    job_dir = work / f"run{i}"
    log_path = work / f"torchrun_run{i}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(Path(__file__).resolve()), "--role", "job", "--job-dir", str(job_dir), "--shape", args.shape,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--deadline", str(args.deadline)]
    rec: dict = {"run": i, "ok": False, "failure": None}
    t_launch = time.time()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=_env(args.shape == "tiny" or not _gpus()), cwd=work, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    cluster = None
    step = "waiting for attach.json"
    try:
        path = job_dir / "attach.json"
        end = time.monotonic() + args.launch_timeout
        doc = None
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"the job exited (rc {proc.returncode}) before its breakpoint")
            if path.exists():
                try:
                    doc = json.loads(path.read_text())
                except ValueError:
                    doc = None
                if doc and doc.get("status") == "waiting":
                    break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"no attach.json after {args.launch_timeout}s")
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
        if cluster is not None and cluster.alive:
            try:
                cluster.stop()
            except Exception as exc:
                rec.setdefault("stop_error", repr(exc))
        if proc.poll() is None:
            rec["killed"] = True
            _kill(proc)
        else:
            _kill(proc)  # its session may still hold a straggler
    time.sleep(0.5)
    rec["left_behind"] = _run_procs(str(job_dir))
    if rec["left_behind"] and rec["ok"]:
        rec["ok"] = False
        rec["failure"] = f"processes left behind: {rec['left_behind']}"
    rec["log_tail"] = log_path.read_text()[-3000:] if not rec["ok"] else None
    rec["total_s"] = time.time() - t_launch
    return rec


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


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # a run's finally still ends its torchrun session


def client(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    gpus = _gpus()
    cpu = args.shape == "tiny" or gpus == 0
    nproc = args.nproc or (2 if cpu else gpus)
    out = Path(args.out or os.environ.get("OUT") or "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    tag = f"job_attach_{nproc}{'cpu' if cpu else 'gpu'}"
    work = Path(tempfile.mkdtemp(prefix="wb-job-attach-"))
    runs: list[dict] = []
    interrupted = None
    try:
        for i in range(1, args.repeat + 1):
            rec = one_run(args, i, work, nproc)
            rec["resume_to_continue_max_s"] = (rec.get("resume_to_continue_s") or {}).get("max")
            rec["resume_to_continue_min_s"] = (rec.get("resume_to_continue_s") or {}).get("min")
            runs.append(rec)
            print(f"run {i}: {'ok' if rec['ok'] else 'FAILED ' + str(rec['failure'])}; "
                  + ", ".join(f"{k} {rec[k]:.2f}" for k, _ in MEASURES if isinstance(rec.get(k), float)), flush=True)
    except KeyboardInterrupt as exc:  # a run's own finally has ended its job; what was measured is still written
        interrupted = f"interrupted ({exc}) during run {len(runs) + 1}"
    for log in sorted(work.glob("torchrun_run*.log")):
        (out / f"{tag}_{log.stem.split('_')[-1]}.log").write_text(log.read_text()[-200_000:])
    summary = {}
    for key, _ in MEASURES:
        vals = [r[key] for r in runs if r["ok"] and isinstance(r.get(key), float)]
        if vals:
            summary[key] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}
    job0 = next((r["job"] for r in runs if r.get("job")), {})
    doc = {"issue": 37, "shape": args.shape, "ranks": nproc, "device": job0.get("device_name", "?"),
           "backend": job0.get("backend"), "steps_before": args.steps, "seq_len": args.seq_len,
           "repeat": args.repeat, "ok": bool(runs) and all(r["ok"] for r in runs) and not interrupted,
           "interrupted": interrupted, "commit": os.environ.get("WB_COMMIT", ""),
           "summary": summary, "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (out / f"{tag}.json").write_text(json.dumps(doc, indent=1))
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
        lines.append(f"probe rows {ok_run['probe_rows']} over ranks {ok_run['probe_ranks']}; the notebook's change "
                     f"seen by the job: final norm |w| x{j['norm_ratio']:.4f}, lr {j['lr_before']:g} -> "
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
    args = ap.parse_args()
    if args.role == "job":
        run_job(args)
        return
    sys.exit(client(args))


if __name__ == "__main__":
    main()
