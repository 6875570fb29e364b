"""Where the test suite's CPU goes, by the kind of process that spent it: `python benchmarks/suite_cpu.py`.

The suite's wall time on the 2-core CI box is its CPU over the cores it keeps busy, so the question "why does
it take N minutes" is "which processes burn the CPU". pytest's ``--durations`` cannot say: a test's time is
mostly other processes' (engines, torchrun ranks, kernels), and a shared cluster's engines are billed to
nobody. Linux's process accounting (``acct(2)``, root only) records every process's CPU when it exits,
whatever ends it (a SIGKILLed engine included), with its pid and parent; a poll of ``/proc`` names each
process by its command line while it lives. Together: CPU-seconds per role (torchrun agent and ranks, engine
sets and forked engines, controllers, notebook kernels, the pytest lanes themselves, CLI runs, ...).

    python benchmarks/suite_cpu.py                 # make test (the README's test command)
    python benchmarks/suite_cpu.py -- bash .ci/run # any command; its exit status is this script's

Only the command's own process tree counts (a process whose first-seen parent chain reaches the command);
anything else exiting on the box meanwhile is one line of its own. A process still alive when the command
ends is not counted (the suite leaves none). Not a test: a measurement, printed as a table.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time

ACCT = struct.Struct("<BBHIIIIIIf8H16s")  # struct acct_v3 (linux/acct.h), 64 bytes
AHZ = 100  # acct_v3 times are in AHZ ticks

# (role, test on the command line); the first that matches names the process. Order matters.
ROLES = [
    ("torchrun agent", lambda c: "torch.distributed.run" in c or "/torchrun " in c + " "),
    ("engine set (imports, forks engines)", lambda c: "workbench.live.engine_fork" in c),
    ("engine nanny", lambda c: "ipyparallel.engine.nanny" in c),
    ("engine (plain)", lambda c: "ipyparallel.engine" in c or "ipengine" in c),
    ("controller", lambda c: "ipyparallel.controller" in c or "ipcontroller" in c),
    ("notebook kernel", lambda c: "ipykernel_launcher" in c),
    ("pytest lane", lambda c: "-m pytest" in c or "exec(eval(sys.stdin.readline()))" in c),
    ("workbench CLI", lambda c: "workbench.cli" in c or "bin/workbench " in c + " "),
    ("pip / venv", lambda c: " pip " in f" {c} " or "-m pip" in c or "ensurepip" in c),
]


def _program(cmd: str) -> str:
    """A python command line's script or module, short: ``examples/fsdp2_buffers_job.py``, ``-m venv``."""
    words = cmd.split()
    for i, w in enumerate(words[1:], 1):
        if w == "-m" and i + 1 < len(words):
            return f"-m {words[i + 1]}"
        if w == "-c":
            return "-c ..."
        if w.endswith(".py"):
            return "/".join(w.split("/")[-2:])
    return words[0].rsplit("/", 1)[-1] if words else "?"


def comp_t(v: int) -> float:
    """acct's 16-bit float: 13-bit mantissa, 3-bit base-8 exponent."""
    return (v & 0x1FFF) << (3 * (v >> 13))


def read_acct(path: str) -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds, comm) for every process that exited while accounting was on."""
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    for i in range(0, len(data) - ACCT.size + 1, ACCT.size):
        f = ACCT.unpack_from(data, i)
        out[f[6]] = (f[7], (comp_t(f[10]) + comp_t(f[11])) / AHZ, f[18].split(b"\0")[0].decode(errors="replace"))
    return out


class ProcWatch(threading.Thread):
    """pid -> (command line, parent pid) as first seen, polled from /proc until stopped."""

    def __init__(self, every: float = 0.1):
        super().__init__(daemon=True)
        self.every, self.seen, self.done = every, {}, threading.Event()

    def poll(self) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in self.seen:
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            self.seen[int(name)] = (cmd, ppid)

    def run(self) -> None:
        while not self.done.is_set():
            self.poll()
            self.done.wait(self.every)


def role(cmd: str | None, comm: str, parent_role: str | None) -> str:
    if parent_role == "torchrun agent" and (cmd is None or "python" in cmd or cmd.endswith(".py")):
        return "torchrun rank (the job's script)"
    if cmd is None:  # never seen alive: short-lived, or started and gone between two polls
        return f"unnamed ({comm})" if comm else "unnamed"
    for name, test in ROLES:
        if test(cmd):
            if name.startswith("engine set") and parent_role and parent_role.startswith("engine set"):
                return "engine (forked from its set)"
            return name
    if "python" in cmd.split(" ", 1)[0]:
        return f"other python ({_program(cmd)})"
    return f"other ({comm or cmd.split(' ', 1)[0].rsplit('/', 1)[-1]})"


def account(root: int, acct: dict[int, tuple[int, float, str]], seen: dict[int, tuple[str, int]]):
    """CPU-seconds per role for the processes under ``root``, and the CPU of those outside it."""
    parent = {pid: seen[pid][1] if pid in seen else acct[pid][0] for pid in set(acct) | set(seen)}
    memo: dict[int, str | None] = {}

    def role_of(pid: int, depth: int = 0) -> str | None:
        """The pid's role, or None when it is not under ``root``."""
        if pid in memo:
            return memo[pid]
        if pid == root:
            memo[pid] = "the command itself"
            return memo[pid]
        pp = parent.get(pid)
        if pp is None or pp in (0, 1, pid) or depth > 60:
            memo[pid] = None
            return None
        up = role_of(pp, depth + 1)
        memo[pid] = None if up is None else role(seen.get(pid, (None,))[0], acct.get(pid, (0, 0, ""))[2], up)
        return memo[pid]

    cpu, count, outside = collections.Counter(), collections.Counter(), 0.0
    for pid, (_, seconds, _) in acct.items():
        r = role_of(pid)
        if r is None:
            outside += seconds
        else:
            cpu[r] += seconds
            count[r] += 1
    return cpu, count, outside


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="*", help="the command to measure (after --); default: make test")
    args = ap.parse_args()
    cmd = args.command or ["make", "test"]  # the Makefile says how the suite runs (its lanes), not a copy here
    libc = ctypes.CDLL(None, use_errno=True)
    fd, path = tempfile.mkstemp(prefix="wb-acct-")
    os.close(fd)
    if libc.acct(path.encode()) != 0:
        os.unlink(path)
        print(f"suite_cpu: process accounting refused ({os.strerror(ctypes.get_errno())}): it needs root "
              "(CAP_SYS_PACCT)", file=sys.stderr)
        return 2
    watch = ProcWatch()
    watch.start()
    t0, rc, proc = time.perf_counter(), 1, None
    try:
        proc = subprocess.Popen(cmd)
        watch.seen[proc.pid] = (" ".join(cmd), os.getpid())
        rc = proc.wait()
    except OSError as exc:  # no such command: nothing ran
        print(f"suite_cpu: could not start {cmd[0]}: {exc.strerror}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        if proc is not None:
            proc.terminate()
            rc = proc.wait()
    finally:
        wall = time.perf_counter() - t0
        time.sleep(0.5)  # the last exits land in the file
        libc.acct(None)
        watch.done.set()
        watch.join()
    try:
        if proc is None:
            return rc
        cpu, count, outside = account(proc.pid, read_acct(path), watch.seen)
    finally:
        os.unlink(path)
    total = sum(cpu.values())
    print(f"\n{' '.join(cmd)}: exit {rc}, {wall:.0f} s wall, {total:.0f} CPU-s in {sum(count.values())} processes "
          f"({total / wall:.2f} cores busy on average of {os.cpu_count()})")
    print(f"{'role':40s} {'CPU-s':>8s} {'share':>6s} {'procs':>6s} {'CPU-s each':>10s}")
    for r, s in cpu.most_common():
        print(f"{r:40s} {s:8.0f} {s / total:6.1%} {count[r]:6d} {s / count[r]:10.2f}")
    print(f"(not traced to the command: reparented before the first poll, or other work on this box: "
          f"{outside:.0f} CPU-s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
