#!/usr/bin/env bash
# Why do the HSDP scenario's engines die in `shard` on their second run on NCCL (fixtures/gpu/attempts/)?
# One device call on 4 GPUs: (A) the same sequence in plain torch under torchrun (form, mesh, fully_shard,
# forward, destroy; three rounds, with and without the earlier rounds' objects kept), (B) the scenario three
# times in the same workbench engines, a fresh group each run as scripts/gpu_suite.py does; the engines'
# own logs come back in $OUT/engine_logs.tgz.
# Device tool: run(command="bash scripts/gpu_hsdp_diag.sh", carry=[".whl"], kind="nvidia-h100-x4").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export TORCH_FR_BUFFER_SIZE=2000 TORCH_SHOW_CPP_STACKTRACES=1 NCCL_DEBUG=WARN PYTHONFAULTHANDLER=1
for keep in "" "--keep"; do
  echo "== A: plain torch $keep"
  timeout -k 5 90 $PY -m torch.distributed.run --nproc-per-node 4 --master-port 29610 \
    scripts/hsdp_reform_repro.py --rounds 3 $keep 2>&1 | grep -v "^\s*$" | tail -40
  echo "rc=${PIPESTATUS[0]}"
done
export IPYTHONDIR=$(mktemp -d)
echo "== B: workbench engines"
timeout -k 10 300 $PY - <<'PY' 2>&1 | tail -80
import glob, os, shutil, time, traceback
import workbench as wb
out = os.environ["OUT"]
c = wb.start(ranks=4, backend="nccl", timeout=60)
print("up", c.devices, flush=True)
def keep_logs(tag):
    d = os.path.join(out, "logs", tag); os.makedirs(d, exist_ok=True)
    for f in glob.glob(os.path.join(os.environ["IPYTHONDIR"], "profile_*", "log", "*.log")):
        shutil.copy(f, d)
try:
    for i, fix in enumerate(["seed-per-shard", "seed-per-shard", None, "broadcast-along-replicate"]):
        if i:
            c.dirty = True
        t0 = time.perf_counter()
        s = c.session("hsdp-replicas-diverge-at-init", fix=fix)
        try:
            s.run()
            ev = [(f.step, e.rank, e.kind, str(e.message)[:200]) for f in s.frames for e in f.events.itertuples()]
            print(f"run {i} fix={fix}: {time.perf_counter()-t0:.1f}s steps={[f.step for f in s.frames]} events={ev}", flush=True)
        except Exception as exc:
            print(f"run {i} fix={fix}: raised {type(exc).__name__}: {exc}", flush=True)
        keep_logs(f"run{i}")
        if not c.alive or c.dead_ranks():
            print("dead:", c.dead_ranks(), flush=True)
            break
finally:
    keep_logs("end")
    c.stop()
PY
( cd "$OUT" && tar czf engine_logs.tgz logs && rm -rf logs )
ls -la "$OUT"
