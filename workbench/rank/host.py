"""Where an engine runs: what an attached cluster asks each engine before it forms a group.

Engines someone else launched (``ipcluster``, Slurm, MPI) may sit on several hosts, so
the client cannot see their hosts, GPUs or free ports from where it runs: each engine
answers for itself. Stdlib and psutil only; no torch until a GPU count is asked for.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from workbench.errors import ClusterError

# Launchers that set a per-host index, in the order they are trusted: torchrun/our own,
# Slurm's srun, Open MPI's mpiexec, MPICH/Intel MPI (hydra).
LOCAL_INDEX_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def whoami() -> dict[str, Any]:
    """Host, pid, the launcher's local index (None when no launcher set one), GPUs and addresses."""
    local = None
    for var in LOCAL_INDEX_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            local = int(value)
            break
    return {"host": socket.gethostname(), "pid": os.getpid(), "local_env": local, "gpus": gpu_count(),
            "cpus": os.cpu_count() or 1, "addrs": _addresses()}


GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")  # NVIDIA's driver, AMD's (ROCm)


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU the NVIDIA driver drives


def gpu_count(nvidia_gpus: str = NVIDIA_GPUS) -> int:
    """GPUs this process would see, without importing torch where the driver says (importing it costs the
    client 1.5 s on a CPU box and 3-4 s of a 4-GPU start): no driver, none; NVIDIA's, its GPU folders, as many
    as ``CUDA_VISIBLE_DEVICES`` lets through; otherwise (ROCm) torch counts them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", None)
    if visible in ("", "-1") or not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return 0
    try:
        driven = len(os.listdir(nvidia_gpus))
    except OSError:
        driven = None
    if driven is not None:
        if visible is None:
            return driven
        listed = [v.strip() for v in visible.split(",")]
        # CUDA stops at the first entry that names no device (a negative index, say); an index past the count too
        usable = 0
        for v in listed:
            if v.lstrip("-").isdigit() and (int(v) < 0 or int(v) >= driven):
                break
            usable += 1
        return min(usable, driven)
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses (the candidates for a rendezvous address)."""
    import psutil

    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                out.append(a.address)
    return out


def interface_of(addr: str) -> str | None:
    """The name of the interface holding ``addr`` on this host (None when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None


def rendezvous_addr(peer_addrs: list[str]) -> str:
    """The address of this host that the peers' hosts reach: the source address the kernel
    routes towards a peer (a UDP connect sends nothing); else the first non-loopback one."""
    for peer in peer_addrs:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((peer, 9))
            except OSError:
                continue
            addr = s.getsockname()[0]
            if not addr.startswith("127.") and addr != "0.0.0.0":
                return addr
    own = _addresses()
    return own[0] if own else socket.gethostbyname(socket.gethostname())


def free_port(addr: str = "127.0.0.1") -> int:
    """A port free on this host for the TCP store (asked of rank 0, not of the client)."""
    with socket.socket() as s:
        s.bind(("" if addr != "127.0.0.1" else addr, 0))
        return s.getsockname()[1]


def set_threads(engines_on_host: int) -> int:
    """Split this host's cores among its engines (the client cannot see remote hosts' cores)."""
    import torch

    n = max(1, (os.cpu_count() or 1) // max(1, engines_on_host))
    torch.set_num_threads(n)
    return n


def order(infos: dict[int, dict[str, Any]]) -> list[tuple[int, int]]:
    """(engine id, local index) in rank order, from every engine's ``whoami()``: by hostname, then by
    local index (the launcher's, else pid order)."""
    hosts: dict[str, list[int]] = {}
    for eid, info in infos.items():
        hosts.setdefault(info["host"], []).append(eid)
    out = []
    for host in sorted(hosts):
        eids = hosts[host]
        envs = [infos[e]["local_env"] for e in eids]
        if None not in envs and len(set(envs)) == len(envs):
            out += sorted(((e, infos[e]["local_env"]) for e in eids), key=lambda t: t[1])
        else:  # no launcher index (or a clash): process order, which is launch order
            out += [(e, i) for i, e in enumerate(sorted(eids, key=lambda e: infos[e]["pid"]))]
    return out


def pick_backend(wish: str, infos: list[dict[str, Any]], local: list[int]) -> str:
    """gloo, or NCCL when every rank has its GPU (its local index, or the one GPU a launcher left it)."""
    if wish not in ("auto", "gloo", "nccl"):
        raise ClusterError(f"unknown backend {wish!r}; valid: auto, gloo, nccl")
    if wish == "gloo":
        return "gloo"
    missing = [r for r, (info, li) in enumerate(zip(infos, local)) if not (info["gpus"] == 1 or li < info["gpus"])]
    if wish == "nccl" and missing:
        r = missing[0]
        raise ClusterError(f"backend 'nccl' needs one GPU per rank: rank {r} on {infos[r]['host']} has local index "
                           f"{local[r]} but sees {infos[r]['gpus']} GPU(s)")
    return "nccl" if not missing else "gloo"
