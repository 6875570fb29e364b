"""Where this process sits in the job, as its launcher says: read here, once, for the whole job package.

torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``) wins over srun (``SLURM_PROCID``/
``SLURM_NTASKS``/``SLURM_LOCALID``, the ranks on this node from ``SLURM_STEP_TASKS_PER_NODE`` or the node
count) where both are set (torchrun inside an allocation); else the process group, else one rank alone.
The capture's shard, the breakpoint's controller address and the engines' ``whoami`` all read this, so
they agree (before, the breakpoint read ``WORLD_SIZE`` alone and put a multi-node srun job's controller on
loopback).
"""

from __future__ import annotations

import os
import re
from typing import Any


def launcher_env(dist_ok: bool = True) -> dict[str, Any]:
    """Rank, world size, local rank, how many ranks run on this host, the rendezvous address and port, and the
    launcher that set them (None where none did). ``dist_ok=False``: never ask the process group."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        out = {"launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env", "rank": int(env["RANK"]),
               "world_size": world, "local_rank": int(env.get("LOCAL_RANK", 0) or 0),
               "local_world_size": int(env.get("LOCAL_WORLD_SIZE") or world)}
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        out = {"launcher": "srun", "rank": int(env["SLURM_PROCID"]), "world_size": world,
               "local_rank": int(env.get("SLURM_LOCALID", 0) or 0), "local_world_size": _slurm_local(world)}
    else:
        rank, world = 0, 1
        if dist_ok:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
        # the group's ranks on one host unless the environment says where (Lightning's launcher sets LOCAL_RANK)
        out = {"launcher": None, "rank": rank, "world_size": world, "local_rank": int(env.get("LOCAL_RANK") or rank),
               "local_world_size": int(env.get("LOCAL_WORLD_SIZE") or world)}
    out["master_addr"] = env.get("MASTER_ADDR") or None
    out["master_port"] = int(env.get("MASTER_PORT") or 0)
    return out


def _slurm_local(world: int) -> int:
    """The tasks of this step on one node: ``SLURM_STEP_TASKS_PER_NODE`` (``2(x2)``, ``2,1``), else the world over
    the step's node count."""
    env = os.environ
    per = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    m = re.match(r"\s*(\d+)", per or "")
    if m:
        return int(m.group(1))
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    return -(-world // max(nodes, 1))


def one_host(where: dict[str, Any] | None = None) -> bool:
    """Whether every rank of the job runs on this host."""
    where = where or launcher_env()
    return where["local_world_size"] >= where["world_size"]
