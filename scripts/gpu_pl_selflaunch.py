"""The Lightning Trainer started by its own launcher on 2 GPUs (NCCL) under ``workbench job``: what each run printed,
what its capture reads, and where each rank's ledger rows came from. Run by ``scripts/gpu_pl_selflaunch.sh``.

    python scripts/gpu_pl_selflaunch.py OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "stack_pl_trainer.py"


def run(cmd: list[str], log: Path) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=log.parent)
    log.write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("workbench:")]
    return {"rc": p.returncode, "s": round(time.perf_counter() - t0, 1), "stdout": p.stdout, "workbench_said": said}


def capture(path: Path) -> dict:
    import workbench as wb

    out: dict = {"ranks": {}}
    for r in (0, 1):
        d = path / f"rank{r}"
        if not d.is_dir():
            continue
        man = json.loads((d / "shard.json").read_text())
        sources: dict[str, int] = {}
        for ln in (d / f"rank{r}.jsonl").read_text().splitlines():
            src = json.loads(ln).get("source", "calls")
            sources[src] = sources.get(src, 0) + 1
        out["ranks"][r] = {k: man.get(k) for k in ("rank", "world_size", "local_rank", "launcher", "backend",
                                                   "device", "points", "status")} | {"ledger_rows": sources}
    d = wb.load(path).bug.diagnose()
    out["diagnosis"] = {"clean": d.clean, "ranks": list(d.ranks or []), "step": d.step, "sentence": d.sentence}
    return out


def main() -> None:
    out = Path(sys.argv[1])
    work = Path(tempfile.mkdtemp())
    rec: dict = {"runs": {}}
    for bug in (False, True):
        flags = ["--gpu", *(["--clip-on-zero"] if bug else [])]
        name = "bug" if bug else "right"
        plain = run([sys.executable, str(JOB), *flags], out / f"plain_{name}.log")
        job = run([sys.executable, "-m", "workbench.cli", "job", str(work / name), "--", sys.executable, str(JOB),
                   *flags], out / f"job_{name}.log")
        rec["runs"][name] = {"plain": plain, "job": job, "same_stdout": plain["stdout"] == job["stdout"],
                             "capture": capture(work / name) if (work / name).is_dir() else None}
        print(name, {k: v for k, v in rec["runs"][name].items() if k not in ("plain", "job")}, flush=True)
        print(name, "rc plain/job", plain["rc"], job["rc"], "said", job["workbench_said"], flush=True)
    (out / "pl_selflaunch_2gpu.json").write_text(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    main()
