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


def _torchrun(hosts, script: str, out: str, tmp_path, tag: str, *args: str) -> list:
    procs = []
    for h in hosts.names[:2]:
        log = open(tmp_path / f"{tag}-{h}.log", "w")
        procs.append(hosts.popen(h, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                     "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                     f"{hosts.addr('hosta')}:29412", "--rdzv-id", f"wb{tag}",
                                     os.path.join(netns.REPO, "examples", script), out, *args],
                                 env={"PYTHONPATH": netns.REPO, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log))
        log.close()
    return procs


def _attachable(out: str, procs, logs, limit: float = 240) -> dict:
    t0 = time.monotonic()
    while True:
        try:
            doc = json.loads(open(os.path.join(out, "attach.json")).read())
            if doc.get("status") == "waiting":
                return doc
        except (OSError, ValueError):
            pass
        assert all(p.poll() is None for p in procs), logs()
        assert time.monotonic() - t0 < limit, logs()
        time.sleep(0.3)


def test_a_job_across_two_hosts_attaches_from_a_third(tmp_path):
    """torchrun across two hosts (c10d rendezvous): stopped at ``cap.breakpoint()``, then post mortem after rank 1
    raises. A client on a third host connects through the shared directory, probes every rank and resumes; the
    controller listens on the job's own network only (the rendezvous host's address, never every interface)."""
    netns.reap_stale()
    with netns.Hosts(3) as hosts:
        client = netns.Client(hosts, "hostc")
        try:
            for tag, script, args in (("bp", "breakpoint_job.py", ("--deadline", "240")),
                                      ("pm", "postmortem_job.py", ("--deadline", "240"))):
                out = os.path.join(hosts.shared, tag)
                procs = _torchrun(hosts, script, out, tmp_path, tag, *args)

                def logs(tag=tag) -> str:
                    return "".join((tmp_path / f"{tag}-{h}.log").read_text()[-2000:] for h in hosts.names[:2])

                doc = _attachable(out, procs, logs)
                ctl = [(a, p) for h in hosts.names[:2] for a, p, who in hosts.listening(h)
                       if f"pid={doc['controller_pid']}," in who]
                assert ctl and all(a == hosts.addr(doc["host"]) for a, _ in ctl), (ctl, doc["host"])
                got = client.call("import workbench as wb\n"
                                  "cluster = wb.connect(job=out)\n"
                                  "rows = cluster.probe('model')\n"
                                  "result = [sorted(set(rows['rank'])), sorted(set(cluster.hosts.values())),\n"
                                  "          cluster.post_mortem and cluster.post_mortem['line']]\n"
                                  "cluster.resume()", out=out, timeout=240)
                assert got[0] == [0, 1] and got[1] == ["hosta", "hostb"], got
                codes = [p.wait(timeout=120) for p in procs]
                if tag == "bp":
                    assert codes == [0, 0], logs()
                    assert json.loads(open(os.path.join(out, "result.json")).read())["by"] == "client"
                else:
                    assert got[2].startswith("rank 1 raised RuntimeError: mat1 and mat2 shapes"), got[2]
                    assert any(c != 0 for c in codes), logs()
        finally:
            client.close()
