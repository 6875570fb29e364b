"""Issue 45's GPU proof: a user's own FSDP2 job under torchrun tells the truth, and every rank is readable post mortem.

    python scripts/job_truth_gpu.py --out $OUT            # the client: runs the three jobs below, one after another

1. clean: a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, GQA 32/8, vocab 128256, tied embeddings), bf16,
   built on meta, ``fully_shard`` per layer and at the root, ``to_empty``, parameters initialised with a seed, the
   rotary ``inv_freq`` forgotten (the user's bug); six steps with ``cap.point(f"step{i}", model=..., logits=...)``,
   then the loss all-reduced after the last point, ``cap.close()``, ``destroy_process_group()``: rc 0, and
   ``workbench report``'s sentence names ``inv_freq`` with no hang (``clean_sentence``).
2. postmortem: the same job with a bad batch on rank 2 at step 2 (``capture(attach="post-mortem")``): the client
   attaches, reads the account (rank 2's raise leads, its message whole), ``cluster.probe("model")`` returns rows
   for every rank (``postmortem_probe_ranks``; the waiting ranks' ``inv_freq`` NaN), then resumes: the job fails
   with rank 2's own exception and leaves no process.
3. deadlock: rank 1 all-reduces on a second group while the others all-reduce on the world
   (``capture(attach="on-deadlock")``): the ledgers prove it, the client attaches, probes, resumes; the job ends
   within seconds of the resume (``deadlock_end_after_resume_s``), not at its group's 600 s timeout.

Writes ``job_truth_<N>gpu.json`` and ``.txt`` (and each job's torchrun log) into ``--out``. Without GPUs it runs the
same on gloo with a tiny model (``--shape tiny``, 2 ranks: a dry run of the script itself). Exit status 0 only when
every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


# -- the jobs (every rank, under torchrun) -----------------------------------------------------------------------
def job(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import workbench.job as wj

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda" if cuda else "cpu")
    if args.mode.startswith("deadlock"):
        return deadlock_job(args, dev, rank)
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(attach="post-mortem", attach_deadline=300) if args.mode == "postmortem" else {}
    cap = wj.capture(args.job_dir, **kw)
    cfg = LlamaConfig(**SHAPES[args.shape], tie_word_embeddings=True, rope_theta=500000.0,
                      max_position_embeddings=2048)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    cap.point("meta", model=model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=dev)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    # (the user forgot model.model.rotary_emb's inv_freq: a non-persistent buffer, never written)
    cap.point("materialize", model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator(device="cpu").manual_seed(rank)
    bad_rank = min(2, world - 1)
    for i in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (2, args.seq_len), generator=g).to(dev)
        if args.mode == "postmortem" and i == 2 and rank == bad_rank:
            ids = ids.float()  # a data-loader bug on one rank
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        cap.point(f"step{i}", model=model, logits=out.logits)
    loss = out.loss.detach().float()
    dist.all_reduce(loss)  # after the last point: still on the device when the capture closes
    cap.close()
    dist.destroy_process_group()


def deadlock_job(args: argparse.Namespace, dev, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import workbench.job as wj

    # a second group over the same ranks: on the job's backend (a data-parallel group, say), or ``--side gloo``:
    # a CPU group the job keeps for host-side coordination beside its NCCL world
    mixed = args.mode == "deadlock_mixed"
    side = dist.new_group(backend="gloo") if mixed else dist.new_group()
    warm = torch.ones(1, device=dev)
    dist.all_reduce(warm)
    dist.all_reduce(warm.cpu() if mixed else warm, group=side)  # both groups up before the capture
    cap = wj.capture(args.job_dir, attach="on-deadlock", attach_deadline=300, hang_after=args.hang_after)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(dev)
    cap.point("built", model=model)
    for n in range(4):
        loss = model(torch.ones(8, 64, device=dev) * (n + 1)).pow(2).mean()
        if n == 2 and rank == 1:  # rank 1: the wrong group
            dist.all_reduce(loss.detach().cpu() if mixed else loss, group=side)
        else:
            dist.all_reduce(loss)
        print(f"rank {rank} step {n} loss {loss.item():.4f}", flush=True)
    cap.close()
    dist.destroy_process_group()


# -- the client ---------------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_CAPTURE")}
    env["PYTHONPATH"] = os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]), str(ROOT)])
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


class Run:
    """torchrun of this file in the job role, in a session of its own (everything it starts goes with kill())."""

    def __init__(self, args: argparse.Namespace, mode: str, work: Path):
        self.dir = work / mode
        self.log_path = work / f"torchrun_{mode}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               str(Path(__file__).resolve()), "--role", "job", "--mode", mode, "--job-dir", str(self.dir),
               "--shape", args.shape, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
               "--hang-after", str(args.hang_after)]
        self.t0 = time.time()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=_env(), cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def attach_doc(self, timeout: float) -> dict:
        path = self.dir / "attach.json"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job exited (rc {self.proc.returncode}) before it was attachable")
            try:
                doc = json.loads(path.read_text())
                if doc.get("status") == "waiting":
                    return doc
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no attach.json after {timeout:.0f}s")

    def kill(self) -> None:
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in kids:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def left_behind(self) -> list[str]:
        import psutil

        left = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if str(self.dir) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE and p.info["pid"] != os.getpid():
                    left.append(f"{p.info['pid']} {cmd[:160]}")
            except (psutil.Error, TypeError):
                continue
        return left


def _check(rec: dict, name: str, ok: bool, detail: str = "") -> None:
    rec.setdefault("checks", []).append({"check": name, "ok": bool(ok), "detail": detail[:600]})


def clean(args: argparse.Namespace, work: Path) -> dict:
    import workbench as wb
    from workbench.postmortem import shards

    rec: dict = {"job": "clean"}
    run = Run(args, "clean", work)
    try:
        rc = run.proc.wait(timeout=args.limit)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        run.kill()
    rec["rc"], rec["job_s"] = rc, time.time() - run.t0
    _check(rec, "the job ended rc 0", rc == 0, run.log()[-1500:] if rc != 0 else "")
    b = wb.load(run.dir)
    r = b.bug
    d = r.diagnose()
    led = r.ledger
    rec.update(sentence=d.sentence, mechanism=d.mechanism, hangs=len(r.manifest["hangs"]), steps=r.steps,
               ledger_states={str(k): int(v) for k, v in led["state"].value_counts().items()} if len(led) else {},
               problems=b.problems, status=r.manifest["job"]["status"])
    last = led[led["step"] == f"after step{args.steps - 1}"] if len(led) else led
    rec["after_last_point"] = [f"rank {x.rank} {x.op} #{x.seq}: {x.state}" for x in last.itertuples()]
    _check(rec, "no hang in the shards", rec["hangs"] == 0 and shards.STILL_INSIDE not in d.sentence
           and "hung" not in d.sentence, d.sentence)
    _check(rec, "the sentence names inv_freq", "inv_freq" in d.sentence, d.sentence)
    _check(rec, "the all-reduce after the last point: completed on every rank",
           len(last) == args.nproc and set(last["state"]) == {"completed"}, "; ".join(rec["after_last_point"]))
    _check(rec, "every rank finished", set(rec["status"].values()) == {"finished"}, str(rec["status"]))
    from workbench.postmortem import report

    html = report.render(b)
    _check(rec, "the report: title once, no 'bug path'", "bug path" not in html
           and html.count("the job&#x27;s own capture") >= 1 and "clean: clean:" not in html)
    return rec


def postmortem(args: argparse.Namespace, work: Path) -> dict:
    import numpy as np

    import workbench as wb

    rec: dict = {"job": "postmortem"}
    run = Run(args, "postmortem", work)
    cluster = None
    bad = min(2, args.nproc - 1)
    try:
        doc = run.attach_doc(args.limit)
        rec["launch_to_attach_s"] = time.time() - run.t0
        t = time.perf_counter()
        cluster = wb.connect(job=run.dir)
        rec["connect_s"] = time.perf_counter() - t
        pm = cluster.post_mortem
        rec["account"] = pm["line"]
        _check(rec, f"the account leads with rank {bad}'s raise",
               pm["line"].startswith(f"rank {bad} raised RuntimeError: "), pm["line"])
        _check(rec, "its message whole", "while checking arguments for embedding)" in pm["line"], pm["line"])
        rec["names"] = {str(r): len(n) for r, n in cluster.names.items()}
        _check(rec, "names without module dunders", not any(n.startswith("__") for ns in cluster.names.values()
                                                              for n in ns), repr(cluster)[:400])
        t = time.perf_counter()
        try:
            rows = cluster.probe("model")
        except Exception as exc:
            rows = None
            rec["probe_error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:600]
        rec["probe_s"] = time.perf_counter() - t
        if rows is not None:
            rec["postmortem_probe_ranks"] = sorted(int(r) for r in set(rows["rank"]))
            rec["probe_problems"] = rows.attrs.get("problems", [])
            rec["probe_as_of"] = ({str(int(r)): str(a) for r, a in rows[rows["as_of"].notna()][["rank", "as_of"]]
                                   .drop_duplicates().itertuples(index=False)} if "as_of" in rows else {})
            inv = rows[rows["name"].str.endswith("rotary_emb.inv_freq")]
            rec["inv_freq_nan"] = {str(int(x.rank)): int(x.nan) for x in inv.itertuples()}
            rec["inv_freq_head"] = {str(int(x.rank)): [float(v) for v in list(x.head or [])[:3]]
                                    for x in inv.itertuples()}
        else:
            rec["postmortem_probe_ranks"] = []
        _check(rec, "cluster.probe('model') returns rows for every rank",
               rec["postmortem_probe_ranks"] == list(range(args.nproc)),
               rec.get("probe_error", "") + " " + "; ".join(rec.get("probe_problems", [])))
        waiting = [str(r) for r in range(args.nproc) if r != bad]
        _check(rec, "the waiting ranks' inv_freq NaN visible",
               all(rec.get("inv_freq_nan", {}).get(r, 0) > 0 for r in waiting), str(rec.get("inv_freq_nan")))
        t = time.perf_counter()
        done = cluster.resume()
        rec["resume_s"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            rec["rc"] = run.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rec["rc"] = None
        rec["resume_to_end_s"] = time.perf_counter() - t
        log = run.log()
        _check(rec, "resumed by the client", done.get("by") == "client", str(done.get("by")))
        _check(rec, "the job failed (rc != 0) with rank's own exception",
               rec["rc"] not in (0, None) and f"[rank{bad}]: RuntimeError: Expected tensor for argument #1 'indices'"
               in log, log[-1500:])
        rec["released_lines"] = [ln for ln in log.splitlines() if "was released" in ln][:8]
        pids = [*cluster.pids.values(), doc.get("controller_pid")]
        import psutil

        time.sleep(1.0)
        alive = [p for p in pids if p and psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        _check(rec, "no process left", not alive and not run.left_behind(), f"{alive} {run.left_behind()}")
    except Exception as exc:
        _check(rec, "the run went through", False, " ".join(f"{type(exc).__name__}: {exc}".split()))
        rec["log_tail"] = run.log()[-3000:]
    finally:
        if cluster is not None and cluster.alive:
            cluster.stop()
        run.kill()
    del np
    return rec


def deadlock(args: argparse.Namespace, work: Path, mode: str = "deadlock") -> dict:
    import workbench as wb

    rec: dict = {"job": mode}
    run = Run(args, mode, work)
    cluster = None
    try:
        doc = run.attach_doc(args.limit)
        rec["launch_to_attach_s"] = time.time() - run.t0
        cluster = wb.connect(job=run.dir)
        pm = cluster.post_mortem
        rec["account"] = pm["line"]
        _check(rec, "the ledgers proved a deadlock", pm["reason"] == "deadlock", pm["line"])
        t = time.perf_counter()
        try:
            rows = cluster.probe("model")
            rec["probe_ranks"] = sorted(int(r) for r in set(rows["rank"]))
            rec["probe_problems"] = rows.attrs.get("problems", [])
        except Exception as exc:
            rec["probe_error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:600]
            rec["probe_ranks"] = []
        rec["probe_s"] = time.perf_counter() - t
        _check(rec, "cluster.probe('model') on every rank", rec["probe_ranks"] == list(range(args.nproc)),
               rec.get("probe_error", ""))
        t = time.perf_counter()
        cluster.resume()
        rec["resume_s"] = time.perf_counter() - t
        try:
            rec["rc"] = run.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rec["rc"] = None
        rec["deadlock_end_after_resume_s"] = time.perf_counter() - t
        log = run.log()
        rec["end_lines"] = [ln for ln in log.splitlines() if "ends now" in ln or "was released" in ln][:8]
        _check(rec, "the job ended within 5 s of resume", rec["rc"] not in (0, None)
               and rec["deadlock_end_after_resume_s"] < 5.0, f"{rec['deadlock_end_after_resume_s']:.2f}s")
        del doc
    except Exception as exc:
        _check(rec, "the run went through", False, " ".join(f"{type(exc).__name__}: {exc}".split()))
        rec["log_tail"] = run.log()[-3000:]
        rec["diagnosis"] = _diagnose(run)
    finally:
        if cluster is not None and cluster.alive:
            cluster.stop()
        run.kill()
    return rec


def _diagnose(run: Run) -> dict:
    """What each rank was doing when the run failed: every thread's Python stack (SIGUSR1: the capture's
    faulthandler), its open calls from its ledger, whether the attach's controller started."""
    from workbench.postmortem import shards

    out: dict = {}
    pids = {}
    for d in sorted(run.dir.glob("rank*")):
        try:
            doc = json.loads((d / shards.MANIFEST).read_text())
            pids[int(doc["rank"])] = int(doc["pid"])
        except (OSError, ValueError, KeyError):
            continue
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(3.0)
    for r in sorted(pids):
        try:
            text = (shards.rank_dir(run.dir, r) / shards.STACKS).read_text(errors="replace")
        except OSError:
            text = ""
        out[f"rank{r}_stacks"] = text[-4000:]
    for r in sorted(pids):
        try:
            lines = shards.ledger_file(run.dir, r).read_text().splitlines()[-3:]
            out[f"rank{r}_ledger_tail"] = [{k: json.loads(x).get(k) for k in ("ev", "op", "group", "seq", "state",
                                                                             "error", "note")} for x in lines]
        except (OSError, ValueError) as exc:
            out[f"rank{r}_ledger_tail"] = repr(exc)
    try:
        led = shards.read(run.dir)[0].ledger
        out["open_calls"] = [f"rank {x.rank} {x.op} #{x.seq} group {x.group}" for x in
                             led[led["state"] == "started"].itertuples()]
    except Exception as exc:
        out["open_calls"] = repr(exc)
    out["controller_log"] = (run.dir / "attach" / "controller.log").read_text()[-1500:] \
        if (run.dir / "attach" / "controller.log").exists() else None
    return out


def client(args: argparse.Namespace) -> int:
    import shutil

    out = Path(args.out or os.environ.get("OUT") or "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or "/tmp/wb-job-truth")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary: dict = {"device": device, "gpus": torch.cuda.device_count(), "nproc": args.nproc, "shape": args.shape,
                     "steps": args.steps, "torch": torch.__version__, "commit": os.environ.get("WB_COMMIT", ""),
                     "python": sys.version.split()[0]}
    runs = []
    for part in args.parts.split(","):
        t = time.time()
        rec = {"clean": clean, "postmortem": postmortem, "deadlock": deadlock,
               "deadlock_mixed": lambda a, w: deadlock(a, w, "deadlock_mixed")}[part](args, work)
        rec["part_s"] = time.time() - t
        runs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "log_tail"}, default=str)[:3000], flush=True)
        shutil.copy(work / f"torchrun_{part}.log", out / f"job_truth_{part}.log")
    by = {r["job"]: r for r in runs}
    summary.update(
        clean_sentence=by.get("clean", {}).get("sentence"),
        postmortem_probe_ranks=by.get("postmortem", {}).get("postmortem_probe_ranks"),
        deadlock_end_after_resume_s=by.get("deadlock", {}).get("deadlock_end_after_resume_s"),
        deadlock_mixed_end_after_resume_s=by.get("deadlock_mixed", {}).get("deadlock_end_after_resume_s"),
        ok=all(c["ok"] for r in runs for c in r.get("checks", [])), runs=runs)
    n = args.nproc
    (out / f"job_truth_{n}gpu.json").write_text(json.dumps(summary, indent=1, default=str))
    lines = [f"issue 45: a user's FSDP2 job tells the truth ({args.shape}, {n} ranks, {device}, torch "
             f"{summary['torch']}); all checks passed: {summary['ok']}",
             f"clean_sentence: {summary['clean_sentence']}",
             f"postmortem_probe_ranks: {summary['postmortem_probe_ranks']}",
             f"deadlock_end_after_resume_s: {summary['deadlock_end_after_resume_s']}",
             f"deadlock_mixed_end_after_resume_s: {summary['deadlock_mixed_end_after_resume_s']}"]
    for r in runs:
        lines.append(f"-- {r['job']} ({r['part_s']:.1f}s)")
        for k in ("rc", "job_s", "launch_to_attach_s", "connect_s", "probe_s", "resume_s", "resume_to_end_s",
                  "deadlock_end_after_resume_s", "account", "probe_problems", "probe_as_of", "inv_freq_nan",
                  "after_last_point", "ledger_states", "released_lines", "end_lines", "probe_error"):
            if k in r:
                v = r[k]
                lines.append(f"  {k}: {v:.2f}" if isinstance(v, float) else f"  {k}: {v}")
        for c in r.get("checks", []):
            lines.append(f"  check {'ok  ' if c['ok'] else 'FAIL'} {c['check']}" + (f": {c['detail']}" if
                                                                                    not c["ok"] else ""))
        if r.get("log_tail"):
            lines.append("  log: " + r["log_tail"][-1500:].replace("\n", "\n    "))
        for k, v in (r.get("diagnosis") or {}).items():
            lines.append(f"  {k}: " + str(v).replace("\n", "\n    "))
    (out / f"job_truth_{n}gpu.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if summary["ok"] else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["client", "job"], default="client")
    ap.add_argument("--mode", choices=["clean", "postmortem", "deadlock", "deadlock_mixed"], default="clean")
    ap.add_argument("--job-dir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--work", default="")
    ap.add_argument("--parts", default="clean,postmortem,deadlock")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--nproc", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--hang-after", type=float, default=3.0)
    ap.add_argument("--limit", type=float, default=240.0, help="seconds a job may take to end or attach")
    args = ap.parse_args()
    if args.role == "job":
        job(args)
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.nproc = args.nproc or (gpus or 2)
    args.shape = args.shape or ("llama-1b" if gpus else "tiny")
    if not gpus:
        args.seq_len = min(args.seq_len, 16)
    sys.exit(client(args))


if __name__ == "__main__":
    main()
