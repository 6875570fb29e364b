"""Hosts made of Linux namespaces on this machine: the multi-host path without a cluster.

Each host is a network namespace (its own interfaces, routes and ports) whose processes also
get their own UTS namespace (a hostname) and their own ``/tmp`` (as on real nodes, only the
profile directory is shared: it lives outside ``/tmp``, like a home directory on NFS). The
hosts are joined by veth links to a bridge in a namespace of its own; each host has loopback
and one address on its link, no default route, nothing reaches beyond. Processes are not in
a PID namespace, so the test process can signal any of them by pid.

``Hosts`` builds and tears it all down (every process in the namespaces is killed first);
``Group`` starts a real ``ipcontroller`` and ``ipengine``s on chosen hosts; ``Client`` runs a
Python process on a host that executes the code the test sends (the notebook's side of
``wb.connect``). Used by tests/test_multihost.py and benchmarks/multihost.py. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from typing import Any

PREFIX = "wbmh"
ROOT = "/var/tmp"  # per-host /tmp and the shared profile live here: outside /tmp, which each host replaces
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
# A host's process: its own hostname and /tmp, then the command ($0 = hostname, $1 = that host's /tmp).
_ENTER = 'hostname "$0" && mount --bind "$1" /tmp && shift && exec "$@"'


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for path, what in ((REPO, "the checkout"), (BIN, "the virtual environment")):
        if os.path.realpath(path) == "/tmp" or os.path.realpath(path).startswith("/tmp/"):
            return f"{what} is under /tmp ({path}), which each simulated host replaces with its own"
    for tool in ("ip", "unshare", "mount", "hostname", "ss"):
        if shutil.which(tool) is None:
            return f"no {tool!r} command"
    probe = f"{PREFIX}probe{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode:
        return f"cannot create a network namespace: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def reap_stale() -> None:
    """Remove what a killed earlier run left: namespaces whose owning pid is gone."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    for name in names:
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _kill_netns(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            shutil.rmtree(os.path.join(ROOT, f"{PREFIX}{pid}"), ignore_errors=True)


def _kill_netns(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


class Hosts:
    """N hosts ``hosta``, ``hostb``, ... on one bridge (10.77.0.0/24, .1 = hosta)."""

    def __init__(self, n: int, subnet: str = "10.77.0", debian: tuple[str, ...] = ()):
        """``debian``: hosts whose own /etc/hosts maps their name to 127.0.1.1, as Debian's installer does."""
        self.n, self.subnet, self.debian = n, subnet, debian
        self.tag = f"{PREFIX}{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.names = [f"host{chr(ord('a') + i)}" for i in range(n)]
        self.root = os.path.join(ROOT, self.tag)
        self.shared = os.path.join(self.root, "shared")  # the "network filesystem": profiles, scripts
        self.bridge = f"{self.tag}-br"
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host[-1]}"

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{self.names.index(host) + 1}"

    def tmp(self, host: str) -> str:
        return os.path.join(self.root, host, "tmp")

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> Hosts:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        os.makedirs(self.shared)
        _ip("netns", "add", self.bridge)
        self._made.append(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        others = "".join(f"{self.addr(h)} {h}\n" for h in self.names)
        for h in self.names:
            ns = self.ns(h)
            _ip("netns", "add", ns)
            self._made.append(ns)
            os.makedirs(self.tmp(h), mode=0o1777)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)  # `ip netns exec` binds it over /etc/hosts
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + (f"127.0.1.1 {h}\n" if h in self.debian else "") + others)
            port = self.port(h)
            _ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge, "link", "set", port, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def port(self, host: str) -> str:
        """The bridge's end of the host's link (taking it down is pulling the host's cable)."""
        return f"p{host[-1]}"

    def link(self, host: str, up: bool) -> None:
        _ip("-n", self.bridge, "link", "set", self.port(host), "up" if up else "down")

    def close(self) -> None:
        """Kill every process in the hosts, delete the namespaces and the per-host directories."""
        for p in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for ns in self._made:
            _kill_netns(ns)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir("/etc/netns")  # only when empty: nobody else's entries there

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running things on a host -----------------------------------------------------------
    def wrap(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` as a process of ``host``: its network, its hostname, its /tmp."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--mount", "--", "sh", "-c", _ENTER,
                host, self.tmp(host), *argv]

    def popen(self, host: str, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        p = subprocess.Popen(self.wrap(host, argv), env={**os.environ, **(env or {})}, start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def adopt(self, proc: subprocess.Popen) -> None:
        """A process started elsewhere (its own session) that ``close()`` must end too."""
        self._procs.append(proc)

    def run(self, host: str, argv: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(host, argv), capture_output=True, text=True, timeout=timeout, **kw)

    def listening(self, host: str) -> list[tuple[str, int, str]]:
        """(address, port, process) of every TCP listener in the host (``ss -ltnp``)."""
        out = _ip("netns", "exec", self.ns(host), "ss", "-Hltnp").stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            local = parts[3]
            addr, _, port = local.rpartition(":")
            rows.append((addr.strip("[]"), int(port), " ".join(parts[5:])))
        return rows


class Group:
    """A real ``ipcontroller`` on ``hosts.names[0]`` and ``ipengine``s, ``per_host`` on each of ``on``."""

    def __init__(self, hosts: Hosts, on: list[str], per_host: int = 2, env: dict[str, str] | None = None):
        self.hosts, self.on, self.per_host = hosts, on, per_host
        self.profile = os.path.join(hosts.shared, f"profile_{len(on)}x{per_host}")
        self.env = {"PYTHONPATH": REPO, "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
                    "PYTHONWARNINGS": "ignore", **(env or {})}
        self.engines: dict[str, list[subprocess.Popen]] = {h: [] for h in on}
        self.controller: subprocess.Popen | None = None

    @property
    def url_file(self) -> str:
        return os.path.join(self.profile, "security", "ipcontroller-client.json")

    def start(self) -> Group:
        head = self.hosts.names[0]
        os.makedirs(os.path.join(self.profile, "security"), exist_ok=True)
        self.controller = self.hosts.popen(head, [os.path.join(BIN, "ipcontroller"), f"--profile-dir={self.profile}",
                                                  f"--ip={self.hosts.addr(head)}", "--ping=500", "--log-level=WARN"],
                                           env=self.env)
        engine_file = os.path.join(self.profile, "security", "ipcontroller-engine.json")
        end = time.monotonic() + 60
        while not (os.path.isfile(engine_file) and os.path.isfile(self.url_file)):
            if time.monotonic() > end or self.controller.poll() is not None:
                raise RuntimeError(f"ipcontroller on {head} did not start")
            time.sleep(0.1)
        for h in self.on:
            for _ in range(self.per_host):
                self.add_engine(h)
        return self

    def add_engine(self, host: str) -> subprocess.Popen:
        p = self.hosts.popen(host, [os.path.join(BIN, "ipengine"), f"--profile-dir={self.profile}",
                                    "--log-level=WARN"], env=self.env)
        self.engines[host].append(p)
        return p

    @property
    def size(self) -> int:
        return len(self.on) * self.per_host


class Client:
    """A Python process on a host (the notebook's kernel): runs the code it is sent, keeps its globals.

    ``call(code, **values)`` binds ``values`` as globals, runs ``code`` and returns the global
    ``result`` (picklable); an exception comes back as ``ClientError`` with the client's traceback.
    A call that does not return within ``timeout`` raises ``TimeoutError``: a hung client is a
    test failure, never a hung test.
    """

    def __init__(self, hosts: Hosts, host: str, env: dict[str, str] | None = None):
        self.hosts, self.host = hosts, host
        self.env = {"PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore", "IPYTHONDIR": "/tmp/ipython",
                    "PATH": BIN + os.pathsep + os.environ.get("PATH", ""), **(env or {})}
        self.proc = hosts.popen(host, [sys.executable, "-u", os.path.join(HERE, "netns_client.py")], env=self.env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)

    def send(self, code: str, **values: Any) -> None:
        blob = pickle.dumps((code, values))
        self.proc.stdin.write(struct.pack("!I", len(blob)) + blob)
        self.proc.stdin.flush()

    def receive(self, timeout: float = 120) -> Any:
        data = self._read(4, timeout)
        status, value = pickle.loads(self._read(struct.unpack("!I", data)[0], timeout))
        if status == "error":
            raise ClientError(value)
        return value

    def call(self, code: str, timeout: float = 120, **values: Any) -> Any:
        self.send(code, **values)
        return self.receive(timeout)

    def _read(self, n: int, timeout: float) -> bytes:
        out, end, fd = b"", time.monotonic() + timeout, self.proc.stdout.fileno()
        while len(out) < n:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the client on {self.host} did not answer in {timeout:g}s")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise ClientError(f"the client on {self.host} exited (rc {self.proc.wait()})")
            out += chunk
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class ClientError(RuntimeError):
    """An exception raised in the client process (its text and traceback)."""


SBATCH = """#!/bin/bash
# sbatch stand-in: `sbatch --nodes=N --ntasks-per-node=M SCRIPT` runs SCRIPT on the first node with the
# variables Slurm sets in a batch job; srun (beside this file, first on PATH) starts the tasks on the nodes.
nodes=1; per=1
while [[ $1 == --* ]]; do
  case $1 in --nodes=*) nodes=${1#*=};; --ntasks-per-node=*) per=${1#*=};; esac; shift
done
script=$1; shift
list=$(echo {names} | cut -d' ' -f1-$nodes | tr ' ' ',')
head=${list%%,*}
export SLURM_JOB_ID=4242 SLURM_JOBID=4242 SLURM_JOB_NAME=wb-ipcluster SLURM_JOB_NODELIST=$list SLURM_NODELIST=$list
export SLURM_NNODES=$nodes SLURM_JOB_NUM_NODES=$nodes SLURM_NTASKS=$((nodes * per)) SLURM_NPROCS=$((nodes * per))
export SLURM_NTASKS_PER_NODE=$per SLURM_TASKS_PER_NODE="$per(x$nodes)" SLURM_SUBMIT_DIR=$PWD
export SLURM_SUBMIT_HOST=$(hostname)
export SLURMD_NODENAME=$head SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_CPUS_ON_NODE=2
export PATH={bin}:$PATH
echo "Submitted batch job $SLURM_JOB_ID"
exec ip netns exec {prefix}-${head: -1} unshare --uts --mount -- sh -c '{enter}' $head {root}/$head/tmp \\
  bash "$script" "$@"
"""

SRUN = """#!/bin/bash
# srun stand-in: `srun -n N --ntasks-per-node=M [--opts] CMD...` starts M tasks on each node of the job, each
# in its node's namespaces, with the variables srun sets (highest local id first: order must not matter).
n=1; per=1
while [[ $1 == -* ]]; do
  case $1 in -n) n=$2; shift;; --ntasks=*) n=${1#*=};; --ntasks-per-node=*) per=${1#*=};; esac; shift
done
IFS=, read -ra nodes <<< "$SLURM_JOB_NODELIST"
for i in "${!nodes[@]}"; do
  node=${nodes[$i]}
  for j in $(seq $((per - 1)) -1 0); do
    id=$((i * per + j)); [ $id -lt $n ] || continue
    SLURM_PROCID=$id SLURM_LOCALID=$j SLURM_NODEID=$i SLURMD_NODENAME=$node SLURM_STEPID=0 SLURM_STEP_ID=0 \\
      SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_NUM_TASKS=$n SLURM_TASK_PID=$$ \\
      ip netns exec {prefix}-${node: -1} unshare --uts --mount -- sh -c '{enter}' $node {root}/$node/tmp "$@" &
  done
done
wait
"""


def slurm_stand_ins(hosts: Hosts) -> str:
    """Write stand-in ``sbatch`` and ``srun`` for these hosts into a shared bin dir; its path."""
    d = os.path.join(hosts.shared, "slurm-bin")
    os.makedirs(d, exist_ok=True)
    fill = {"{names}": " ".join(hosts.names), "{bin}": d, "{prefix}": hosts.tag, "{enter}": _ENTER,
            "{root}": hosts.root}
    for name, text in (("sbatch", SBATCH), ("srun", SRUN)):
        path = os.path.join(d, name)
        for key, value in fill.items():
            text = text.replace(key, value)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
    return d
