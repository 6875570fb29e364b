"""A captured job across two simulated hosts (tests/netns.py): torchrun's c10d rendezvous, one rank per host.

Each host has its own network, hostname and /tmp; the capture directory sits on the shared
directory (a network filesystem's stand-in). The uneven eval loop hangs across the hosts; the
shards, read while it hangs, name both stuck calls and both hosts, and carry the rendezvous id as
the job id.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import netns

import workbench as wb
from workbench.postmortem import shards

pytestmark = pytest.mark.slow
WHY = netns.unavailable()
if WHY:
    pytest.skip(f"no simulated hosts: {WHY}", allow_module_level=True)

EXAMPLE = os.path.join(netns.REPO, "examples", "uneven_eval_job.py")


def _open_calls(out: str) -> dict[int, str]:
    try:
        led = shards.read(out)[0].ledger
    except Exception:
        return {}
    return {int(r.rank): str(r.op) for r in led[led["state"] == "started"].itertuples()} if len(led) else {}


def test_a_job_across_two_hosts_hangs_and_its_shards_name_it(tmp_path):
    netns.reap_stale()
    with netns.Hosts(2) as hosts:
        out = os.path.join(hosts.shared, "eval")
        env = {"PYTHONPATH": netns.REPO, "OMP_NUM_THREADS": "1"}
        logs = []
        for h in hosts.names:
            log = open(tmp_path / f"{h}.log", "w")
            logs.append(log)
            hosts.popen(h, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr('hosta')}:29411",
                            "--rdzv-id", "wbjob42", EXAMPLE, out], env=env, stdout=log, stderr=log)
        t0 = time.monotonic()
        # a state the job reaches, not a time: the bound only ends a broken run
        while _open_calls(out) != {0: "all_gather_into_tensor", 1: "all_reduce"}:
            assert time.monotonic() - t0 < 240, "".join((tmp_path / f"{h}.log").read_text()[-2000:]
                                                        for h in hosts.names)
            time.sleep(0.5)
        rec = wb.load(out).bug
        docs = [json.loads(open(os.path.join(out, f"rank{r}", shards.MANIFEST)).read()) for r in (0, 1)]
        for log in logs:
            log.close()
    d = rec.diagnose()
    assert d.mechanism == "collective-mismatch", d.sentence
    assert "rank 0: all_gather_into_tensor" in d.sentence and "rank 1 hung in all_reduce" in d.sentence
    job = rec.manifest["job"]
    assert job["id"] == "torchrun-wbjob42" and job["hosts"] == ["hosta", "hostb"]
    assert sorted(d["host"] for d in docs) == ["hosta", "hostb"]
