"""Attach, per-step overhead and hang recovery across simulated hosts, next to the same on one host.

    python benchmarks/multihost.py [--layouts 1x4,2x2,1x8,4x2] [--steps 8] [--cycles 3]   (root)

Hosts are Linux namespaces on this machine (tests/netns.py: own network, hostname and /tmp,
joined by a bridge). Per layout HxE: a real ``ipcontroller`` on the first host, E ``ipengine``s
on each of H hosts, the client on the first host attaching with ``wb.connect`` (gloo, CPU).
1xN is the one-host figure (the group on loopback); HxE with H > 1 crosses the bridge.
 - attach (cold): ``wb.connect`` on engines fresh from their launcher (torch imported in it);
   attach (warm): detach and attach again (order ranks, form the group);
 - per-step overhead: a step's client wall time minus the slowest rank's own time, median over
   ``--steps`` steps that each all-reduce 4 floats;
 - hang: rank 0 all-reduces alone; the ledgers prove the deadlock (``detect_deadlocks``):
   declared = seconds from the last rank blocking to the hang frame, recover = ``s.recover()``
   (control threads cut the group's sockets, the same engines re-form the group), medians over
   ``--cycles``; every cycle's check step must give the right sum.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netns  # the namespace harness lives with the tests that use it

CLIENT_CODE = """
import statistics, time
import torch
import workbench as wb

t = time.perf_counter()
cluster = wb.connect(url_file=url, ranks=ranks, backend="gloo", timeout=30, wait=180)
cold = time.perf_counter() - t
cluster.stop()
t = time.perf_counter()
cluster = wb.connect(url_file=url, ranks=ranks, backend="gloo", timeout=30)
warm = time.perf_counter() - t
cluster.step_deadline = 120
cluster.progress = False

steps = wb.Scenario("bench-steps", probe=None)
for i in range(n_steps):
    def step(ctx, i=i):
        import torch.distributed as dist
        dist.all_reduce(torch.ones(4))
    step.__name__ = f"s{i}"
    steps.step(step)
s = cluster.session(steps)
overheads = []
while not s.done:
    t1 = time.perf_counter()
    frame = s.step()
    overheads.append(time.perf_counter() - t1 - max(frame.elapsed.values()))
s.close()

hang = wb.Scenario("bench-lonely")

@hang.step
def setup(ctx):
    ctx.x = torch.ones(4)

@hang.step
def lonely(ctx):
    import torch.distributed as dist
    if ctx.rank == 0:
        dist.all_reduce(ctx.x)

@hang.step
def together(ctx):
    import torch.distributed as dist
    y = ctx.x.clone()
    dist.all_reduce(y)
    ctx.output("sum", y)

cluster.detect_deadlocks = True
declared, recovered, same, right = [], [], True, True
for _ in range(cycles):
    pids = dict(cluster.pids)
    s = cluster.session(hang)
    s.step()
    f = s.step()
    declared.append(f.hang.declared_at - f.hang.blocked_at)
    t = time.perf_counter()
    info = s.recover()
    recovered.append(time.perf_counter() - t)
    same = same and info["action"].startswith("re-formed") and cluster.pids == pids
    after = s.step()
    sums = after.outputs[after.outputs["name"] == "sum"]["head"].map(lambda h: h[0]).tolist()
    right = right and sums == [float(ranks)] * ranks
    s.close()
result = dict(cold=cold, warm=warm, step=statistics.median(overheads), declared=statistics.median(declared),
              recover=statistics.median(recovered), same=same, right=right, hosts=len(set(cluster.hosts.values())))
cluster.shutdown()
"""


def measure(layout: str, n_steps: int, cycles: int) -> dict:
    h, e = (int(x) for x in layout.split("x"))
    with netns.Hosts(h) as hosts:
        group = netns.Group(hosts, hosts.names, per_host=e).start()
        client = netns.Client(hosts, hosts.names[0])
        try:
            return client.call(CLIENT_CODE, timeout=900, url=group.url_file, ranks=h * e, n_steps=n_steps,
                               cycles=cycles)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="1x4,2x2,1x8,4x2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"multihost: no simulated hosts: {why}", file=sys.stderr)
        return 2
    netns.reap_stale()
    print(f"{'hosts x ranks':>13} {'attach cold':>12} {'attach warm':>12} {'step overhead':>14} "
          f"{'hang declared':>14} {'recover':>8}  same engines, right sums")
    for layout in args.layouts.split(","):
        t = time.perf_counter()
        r = measure(layout, args.steps, args.cycles)
        print(f"{layout:>13} {r['cold']:>11.2f}s {r['warm']:>11.2f}s {r['step'] * 1000:>12.0f}ms "
              f"{r['declared']:>13.2f}s {r['recover']:>7.2f}s  {r['same']}, {r['right']}"
              f"   ({r['hosts']} host(s), {time.perf_counter() - t:.0f}s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
