"""What must agree across ranks, learned on the rank from what the job itself says.

Every probed tensor and output gets three small columns:

- ``agree``: the global ranks that must hold the same bytes of it, this rank among them (``"0,2"``), or
  ``""``: this rank's own (a shard, an expert, a per-rank batch's output), never compared with another rank;
- ``agree_by``: what said so (``mesh dim `replicate```, ``DDP replica``, ``FSDP``, ``broadcast``, ...);
- ``replica``: for a DTensor, this rank's coordinate along the mesh dims it is replicated on (``"1"``):
  ranks with one value hold one replica, so a sentence can say which replicas parted.

Where it comes from, strongest first: DTensor placements (ranks along the ``Replicate`` mesh dims, at the
same coordinates on the others); a declaration (``ctx.output(..., same_on=...)``, ``replicated(module)``,
``ctx.local`` for the opposite); a wrapper (a DDP module is a replica across DDP's group, FSDP1's wrapped
module across FSDP's, an FSDP2 module's plain buffers across its mesh, DeepSpeed's engine's module at ZeRO stage
0-2 across its data-parallel group), whether the point names the wrapper or the module it holds (``wrapped``);
a collective (a tensor broadcast or
all-reduced whole across a group, or a parameter whose gradient was, agrees across it from then on: the
ledger tells ``synced`` as it records the call). Without any of these a tensor is this rank's own: data,
expert and pipeline parallel code holds per-rank values by design.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from workbench.rank import mesh_facts, probe_cpu

COLUMNS = ("agree", "agree_by", "replica")
_CAP = 200_000  # storages remembered; the oldest go first
_SYNCED: OrderedDict[tuple, tuple[Any, tuple[int, ...], str]] = OrderedDict()  # storage key -> (weak ref, ranks, how)
_DECLARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (ranks, how, how for buffers)
_VERSION = [0]  # bumped whenever what ``_SYNCED`` or ``_DECLARED`` answers may change: ``annotate``'s cache key


def ranks_text(ranks: Iterable[int]) -> str:
    return ",".join(str(int(r)) for r in sorted(set(ranks)))


def _world() -> tuple[int, ...]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return tuple(range(dist.get_world_size()))
    return ()


def group_ranks(spec: Any) -> tuple[int, ...] | None:
    """The ranks ``spec`` names: ``"world"`` (or True), a process group, a device mesh, a list of ranks; None
    (or False, ``""``): no rank but this one (``()``). Returns None for a spec it cannot read."""
    import torch.distributed as dist

    if spec is None or spec is False or spec == "":
        return ()
    if spec is True or spec == "world":
        return _world()
    if isinstance(spec, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(spec))
    mesh = getattr(spec, "mesh", None)
    if isinstance(mesh, torch.Tensor):  # a DeviceMesh
        return tuple(int(r) for r in mesh.flatten().tolist())
    if isinstance(spec, (list, tuple, set, frozenset)) and all(isinstance(r, int) for r in spec):
        return tuple(sorted(spec))
    return None


# -- what the collectives said ------------------------------------------------------------------
def _storage_key(t: torch.Tensor) -> tuple | None:
    try:
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "to_local"):
            return None  # a DTensor: its placements say it
        if t.device.type == "meta":
            return None
        s, size = t.untyped_storage(), t.element_size()  # in bytes: a byte view of a tensor is the same memory
        return (s.data_ptr(), t.storage_offset() * size, t.numel() * size)
    except (RuntimeError, TypeError, AttributeError):  # no storage of its own (a fake or wrapper subclass)
        return None


def synced(tensors: Iterable[torch.Tensor], ranks: Iterable[int] | None, how: str) -> None:
    """``tensors`` were broadcast or all-reduced whole across ``ranks``: they agree there from now on. Called by
    the ledger as it records the call (a call that then fails was still meant to make them agree)."""
    ranks = tuple(sorted(int(r) for r in ranks or ()))
    if len(ranks) < 2:
        return
    from torch.multiprocessing.reductions import StorageWeakRef

    for t in tensors:
        key = _storage_key(t)
        if key is None:
            continue
        try:
            ref = StorageWeakRef(t.untyped_storage())  # the memory, not this Python object (p.data is a new one)
        except (RuntimeError, TypeError):  # a storage that cannot be referred to weakly: nothing to remember
            continue
        _SYNCED.pop(key, None)
        _SYNCED[key] = (ref, ranks, how)
        _VERSION[0] += 1
        while len(_SYNCED) > _CAP:
            _SYNCED.popitem(last=False)


def _synced_of(t: torch.Tensor | None) -> tuple[tuple[int, ...], str] | None:
    if t is None:
        return None
    key = _storage_key(t)
    hit = _SYNCED.get(key) if key is not None else None
    if hit is None:
        return None
    ref, ranks, how = hit
    if ref.expired():  # freed since: its address now holds another tensor
        _SYNCED.pop(key, None)
        _VERSION[0] += 1
        return None
    return ranks, how


def forget() -> None:
    """A new session or capture: what earlier calls synced is not this run's."""
    _SYNCED.clear()
    _VERSION[0] += 1


# -- what the user declared -------------------------------------------------------------------------
def replicated(module: nn.Module, group: Any = "world") -> nn.Module:
    """Declare ``module`` a replica across ``group`` (``"world"``, a process group, a mesh, a list of ranks):
    its parameters and buffers must hold the same bytes there. Returns the module."""
    ranks = group_ranks(group)
    if ranks is None:
        raise ValueError(f"replicated: cannot read the ranks of {group!r} (give 'world', a process group, a "
                         "device mesh or a list of ranks)")
    _declare(module, (ranks, "declared replicated", "declared replicated"))
    return module


def wrapped(module: nn.Module, wrappers: Iterable[nn.Module]) -> None:
    """What ``wrappers`` (outermost first) say of the module they hold, for a point that probes ``module`` alone
    (a job's automatic points name the module inside DDP or DeepSpeed's engine): the outermost that makes it a
    replica speaks. A user's own declaration (``replicated``) stands. Asked again with the same wrappers (a job's
    next step point), it asks them nothing: DeepSpeed's rule walks the module's parameters."""
    wrappers = list(wrappers)
    if not wrappers or not isinstance(module, nn.Module):  # a point on what no wrapper holds: nothing to say
        return
    ids = tuple(map(id, wrappers))
    if _ASKED.get(module) == ids:
        return
    said = next((w for w in map(_wrapper, wrappers) if w is not None), None)
    _ASKED[module] = ids
    if said is None:
        return
    held = _DECLARED.get(module)
    if held == said or (held is not None and held[1] == "declared replicated"):
        return
    _declare(module, said)


_ASKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> id() of the wrappers last asked for it


def _declare(module: nn.Module, said: tuple[tuple[int, ...], str, str]) -> None:
    _DECLARED[module] = said
    _OWNED.clear()  # what a cached walk said no longer holds
    _VERSION[0] += 1


def declared_output(spec: Any) -> dict[str, str]:
    """The columns of an output declared ``same_on=spec``."""
    ranks = group_ranks(spec)
    if ranks is None:
        raise ValueError(f"same_on: cannot read the ranks of {spec!r} (give 'world', a process group, a device "
                         "mesh, a list of ranks or None)")
    return {"agree": ranks_text(ranks) if len(ranks) > 1 else "", "agree_by": "declared" if ranks else "declared "
            "per rank", "replica": ""}


# -- the wrappers ---------------------------------------------------------------------------------------
def _wrapper(mod: nn.Module) -> tuple[tuple[int, ...], str, Any] | None:
    """(ranks, how for parameters, how for buffers) when ``mod`` is a wrapper that makes its module a replica; the
    buffers' may be (their own ranks, how): DDP's are rank 0's at each forward's start and each rank's own after
    it (a BatchNorm's running statistics from the rank's own batch), so at a point they are not compared."""
    import torch.distributed as dist

    name = type(mod).__name__
    try:
        if name == "DistributedDataParallel" and isinstance(mod, nn.parallel.DistributedDataParallel):
            ranks = tuple(dist.get_process_group_ranks(mod.process_group))
            bufs = (((), "DDP broadcasts them from rank 0 at each forward; between forwards each rank's forward "
                         "updates its own") if getattr(mod, "broadcast_buffers", True) else
                    "DDP replica, but broadcast_buffers=False: DDP never syncs its buffers")
            return ranks, "DDP replica", bufs
        if name == "FullyShardedDataParallel":
            pg = getattr(mod, "process_group", None)
            ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else _world()
            return ranks, "FSDP", "FSDP"
        if any(c.__name__ == "FSDPModule" for c in type(mod).__mro__):
            for p in mod.parameters():
                mesh = getattr(p, "device_mesh", None)
                if mesh is not None:
                    ranks = mesh_facts.ranks(mesh)
                    return ranks, "FSDP2", "FSDP2 (a plain buffer: replicated)"
            return _world(), "FSDP2", "FSDP2 (a plain buffer: replicated)"
        if any(c.__name__ == "DeepSpeedEngine" for c in type(mod).__mro__):
            return _deepspeed(mod)
    except (KeyError, ValueError, RuntimeError, AttributeError):  # its group no longer registered, an odd mesh
        return None
    return None


def _deepspeed(engine: nn.Module) -> tuple[tuple[int, ...], str, str] | None:
    """DeepSpeed's engine below ZeRO-3: its module is whole on every rank of its data-parallel group, a replica
    (``_broadcast_model`` broadcasts its parameters at ``initialize``, the optimizer gathers them after each step),
    but nothing in DeepSpeed ever syncs its buffers. ZeRO-3 partitions the parameters (``_zero``); a model with
    expert parameters (``allreduce=False``: replicas only across their expert group) or ``OptimizedLinear``'s
    (``ds_optim_param``: one shard of a base weight per rank, never broadcast) is left to the collectives."""
    import torch.distributed as dist

    stage = int(engine.zero_optimization_stage())
    module = getattr(engine, "module", None)
    if stage >= 3 or not isinstance(module, nn.Module) or any(
            getattr(p, "allreduce", True) is False or hasattr(p, "ds_optim_param") for p in module.parameters()):
        return None
    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else _world()
    how = f"DeepSpeed ZeRO-{stage} replica" if stage else "DeepSpeed replica"
    return ranks, how, f"{how}, but DeepSpeed broadcasts parameters only: a buffer is never synced"


def _zero(model: nn.Module) -> tuple[tuple[int, ...], str, str] | None:
    """(ranks, how, how for buffers) when ``model`` holds ZeRO-3 partitioned parameters (``ds_id``): they are shards
    (``of_tensor``), its buffers stay whole on every rank of the parameters' group, so they are replicated."""
    import torch.distributed as dist

    zero = next((p for p in model.parameters() if "ds_id" in p.__dict__), None)
    if zero is None:
        return None
    try:
        group = zero.__dict__.get("ds_process_group")
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else _world()
    except (KeyError, ValueError, RuntimeError):  # a group torch does not register: ZeRO's world
        ranks = _world()
    return ranks, "ZeRO-3", "ZeRO-3 (a buffer: replicated)"


def _owned(objects: Mapping[str, Any]) -> dict[int, tuple[tuple[int, ...], str]]:
    """id(tensor) -> (ranks, how) for every tensor a wrapper or a declaration makes a replica."""
    out: dict[int, tuple[tuple[int, ...], str]] = {}
    seen: set[int] = set()
    for obj in objects.values():
        if not isinstance(obj, nn.Module):
            continue
        for _, mod in obj.named_modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            w = _wrapper(mod) or (_zero(mod) if mod is obj else None)
            if w is None and mod in _DECLARED:
                w = _DECLARED[mod]
            if w is None:
                continue
            ranks, p_how, b_how = w
            b_ranks, b_how = b_how if isinstance(b_how, tuple) else (ranks, b_how)
            inner = getattr(mod, "module", mod) if isinstance(getattr(mod, "module", None), nn.Module) else mod
            for sub in {id(m): m for m in [mod, *inner.modules()]}.values():
                for p in sub._parameters.values():
                    if p is not None:
                        out.setdefault(id(p), (ranks, p_how))
                for b in sub._buffers.values():
                    if b is not None:
                        out.setdefault(id(b), (b_ranks, b_how))
    return out


# -- placements --------------------------------------------------------------------------------------------
def placement(t: Any) -> dict[str, str] | None:
    """A DTensor's columns: the ranks along its Replicate mesh dims at this rank's coordinates on the others."""
    mesh, placements = getattr(t, "device_mesh", None), getattr(t, "placements", None)
    if mesh is None or placements is None:
        return None
    try:
        key = (id(mesh), tuple(placements))
        hit = _PLACED.get(key)
        if hit is not None and hit[0] is mesh:
            return None if hit[1] is None else dict(hit[1])
        cols = _placement(mesh, placements)
        if len(_PLACED) >= 1024:
            _PLACED.clear()
        _PLACED[key] = (mesh, cols)
        return None if cols is None else dict(cols)
    except (AttributeError, TypeError, IndexError, RuntimeError):  # a mesh or placements only like a DTensor's
        return None


_PLACED: dict[tuple, tuple[Any, dict[str, str] | None]] = {}  # (mesh, placements) -> columns: a point asks per tensor


def _placement(mesh: Any, placements: Any) -> dict[str, str] | None:
    """The columns of ``placements`` on ``mesh``; what cannot be read raises (``placement`` answers None then)."""
    facts = mesh_facts.of(mesh)
    coord, grid = facts.coord, facts.grid
    if coord is None:
        return None
    names = mesh.mesh_dim_names or tuple(f"dim {i}" for i in range(grid.ndim))
    if any(p.is_partial() for p in placements):
        return {"agree": "", "agree_by": "partial (a pending reduction)", "replica": ""}
    rep = [i for i, p in enumerate(placements) if p.is_replicate()]
    if not rep:
        return {"agree": "", "agree_by": "sharded on " + ", ".join(f"`{names[i]}`" for i in range(grid.ndim)),
                "replica": ""}
    index = tuple(slice(None) if i in rep else coord[i] for i in range(grid.ndim))
    ranks = grid[index].flatten().tolist()
    dims = ", ".join(f"`{names[i]}`" for i in rep)
    return {"agree": ranks_text(ranks) if len(ranks) > 1 else "",
            "agree_by": f"mesh dim {dims}" if len(rep) == 1 else f"mesh dims {dims}",
            "replica": ",".join(str(coord[i]) for i in rep)}


# -- the rows ------------------------------------------------------------------------------------------------
def _cols(ranks: tuple[int, ...], how: str) -> dict[str, str]:
    return {"agree": ranks_text(ranks) if len(ranks) > 1 else "", "agree_by": how, "replica": ""}


OWN = {"agree": "", "agree_by": "", "replica": ""}


def _is_flat(t: Any) -> bool:
    """FSDP1's flat parameter: torch makes it a ``Parameter`` marked ``_is_flat_param`` (``FlatParameter`` is only
    what ``isinstance`` answers to), so its type's name alone misses it."""
    return bool(getattr(t, "_is_flat_param", False)) or type(t).__name__ == "FlatParameter"


def _is_zero_partition(t: Any) -> bool:
    """ZeRO-3's flat partition of a parameter (its ``ds_tensor``: ``ds_numel`` and a ``status``), or a partitioned
    parameter itself (``ds_id`` with a ``ds_tensor``): by the attributes ZeRO sets, not DeepSpeed's classes."""
    held = getattr(t, "__dict__", {})
    if "ds_id" in held:
        return "ds_tensor" in held
    return "ds_numel" in held and "status" in held


def of_tensor(t: Any, owned: Mapping[int, tuple[tuple[int, ...], str]] | None = None) -> dict[str, str]:
    """The columns of one tensor (see the module docstring for the order)."""
    p = placement(t)
    if p is not None:
        return p
    if _is_flat(t):
        return {**OWN, "agree_by": "an FSDP flat parameter's shard"}
    if _is_zero_partition(t):
        return {**OWN, "agree_by": "a ZeRO-3 partition (this rank's shard)"}
    hit = (owned or {}).get(id(t))
    if hit is not None:
        return _cols(*hit)
    hit = _synced_of(t)
    if hit is not None:
        return _cols(*hit)
    grad = getattr(t, "grad", None) if isinstance(t, nn.Parameter) else None
    hit = _synced_of(grad) if isinstance(grad, torch.Tensor) else None
    if hit is not None and hit[1] == "all_reduce":
        return _cols(hit[0], "its gradient is all-reduced")
    return dict(OWN)


def _with_module(objects: Mapping[str, Any], cols: dict[str, dict[str, str]]) -> None:
    """A module synced in part is a replica: a tensor nothing else speaks for, held by a module whose own or whose
    submodules' tensors a collective synced (a Linear whose weight was broadcast and bias forgotten; a model whose
    state dict was broadcast but not its non-persistent buffers), must agree across the same ranks. An expert's
    module, with nothing synced in it, stays its rank's own."""
    if not any(c.get("agree_by") in SYNC_WORDS for c in cols.values()):
        return  # nothing synced: no module speaks for its tensors (the walk, ~1.5 ms a point at 16 layers, skipped)
    for key, obj in objects.items():
        if not isinstance(obj, nn.Module) or type(obj).named_parameters is not nn.Module.named_parameters:
            continue
        mods = list(obj.named_modules(remove_duplicate=False))
        found: dict[str, tuple[str, str]] = {}  # module name -> (a synced tensor's name under it, its agree_by)
        for mod_name, mod in reversed(mods):  # children before parents
            pre = f"{key}.{mod_name}." if mod_name else f"{key}."
            here = next(((pre + n, cols[pre + n]) for n, t in [*mod._parameters.items(), *mod._buffers.items()]
                         if t is not None and cols.get(pre + n, {}).get("agree_by") in SYNC_WORDS), None)
            if here is None:
                here = next((found[f"{mod_name}.{c}" if mod_name else c] for c, _ in mod.named_children()
                             if (f"{mod_name}.{c}" if mod_name else c) in found), None)
            if here is None:
                continue
            found[mod_name] = here
            name, col = here
            rel = name[len(pre):] if name.startswith(pre) else name
            for n, t in [*mod._parameters.items(), *mod._buffers.items()]:
                c = cols.get(pre + n)
                if t is not None and c is not None and c is not OWN_DECLARED and not c["agree"] and not c["agree_by"]:
                    c.update(agree=col["agree"], agree_by=f"its module's `{rel}` {SYNC_WORDS[col['agree_by']]}")


SYNC_WORDS = {"broadcast": "was broadcast", "all_reduce": "was all-reduced",
              "its gradient is all-reduced": "has its gradient all-reduced"}
OWN_DECLARED = {"agree": "", "agree_by": "declared this rank's own (ctx.local)", "replica": ""}


_OWNED: dict[tuple, dict[int, tuple[tuple[int, ...], str]]] = {}  # stamp -> ``_owned``'s walk


def annotate(rows: list[dict[str, Any]], by_name: Mapping[str, Any], every: Mapping[str, Any],
             rank_local: Iterable[str] = (), stamp: tuple | None = None) -> None:
    """Fill the columns of probed rows: ``by_name`` the probed tensors as held (DTensors whole), ``every`` all the
    objects the rank holds (a wrapper not probed still says what its module is). ``stamp``: a key that is the same
    only while every module among ``every`` has the same tree and the same tensors (the probe's cached plans say
    so): the columns are then the last point's (~2 ms a point at 16 layers on an H200, a job's point every step),
    while nothing synced or declared since (``_VERSION``) and every object is a module (the stamp vouches for no
    other). An answer read from a gradient is never reused: a job's next gradient is a new tensor."""
    cols = columns([row["name"] for row in rows], by_name, every, rank_local, stamp)
    for row in rows:
        row.update(cols[row["name"]])


def columns(names: list[str], by_name: Mapping[str, Any], every: Mapping[str, Any], rank_local: Iterable[str] = (),
            stamp: tuple | None = None) -> dict[str, dict[str, str]]:
    """``annotate``'s columns per row name, without the rows: a point finished on the writer thread reads them on
    the job's thread, where the objects are as the point found them."""
    local = set(rank_local)
    key = None
    if stamp is not None and all(isinstance(v, nn.Module) for v in every.values()):
        key = (stamp, _VERSION[0], frozenset(local), tuple(names))
        cols = _COLS.get(key)
        if cols is not None:
            return cols
    cols = _columns(names, by_name, every, local, stamp)
    if key is not None and not any("gradient" in c["agree_by"] for c in cols.values()):
        if len(_COLS) > 8:
            _COLS.clear()
        _COLS[key] = cols
    return cols


_COLS: dict[tuple, dict[str, dict[str, str]]] = {}  # ``annotate``'s key -> its columns


def _columns(names: list[str], by_name: Mapping[str, Any], every: Mapping[str, Any], local: set[str],
             stamp: tuple | None) -> dict[str, dict[str, str]]:
    owned = _OWNED.get(stamp) if stamp is not None else None
    if owned is None:
        owned = _owned(every)
        if stamp is not None:
            if len(_OWNED) > 8:
                _OWNED.clear()
            _OWNED[stamp] = owned
    cols: dict[str, dict[str, str]] = {}
    for name in names:
        if name.split(".", 1)[0] in local:
            cols[name] = OWN_DECLARED
            continue
        t = by_name.get(name)
        cols[name] = of_tensor(t, owned) if t is not None else dict(OWN)
    _with_module({k: v for k, v in every.items() if k not in local}, cols)
    return cols


# -- the data: what the forwards were fed -----------------------------------------------------------------------
def _digest(v: Any, h: Any) -> None:
    if isinstance(v, torch.Tensor):
        t = v.detach()
        t = t.to_local() if hasattr(t, "to_local") and type(t) is not torch.Tensor else t
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.device.type != "meta":
            flat = t.reshape(-1)[: 1 << 20].contiguous().cpu()
            h.update(probe_cpu.host(flat, "uint8").tobytes())  # Tensor.numpy() would pin the job's storage
    elif isinstance(v, (list, tuple)):
        for x in v:
            _digest(x, h)
    elif isinstance(v, Mapping):
        for k in sorted(v, key=str):
            h.update(str(k).encode())
            _digest(v[k], h)
    elif isinstance(v, (int, float, bool, str)) or v is None:
        h.update(repr(v).encode())


_SAMPLE = 1024  # elements of each of a module's own tensors a fed-inputs digest reads (a re-seed changes them all)


def _own_state(module: nn.Module, owned: Mapping[int, tuple[tuple[int, ...], str]]) -> list[torch.Tensor]:
    """The tensors of ``module`` that are its rank's own: plain tensors no wrapper, declaration or collective says
    must agree (an expert's weights), never a shard of a whole (a DTensor, an FSDP flat parameter)."""
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if (type(t) is not torch.Tensor and type(t) is not nn.Parameter) or _is_flat(t):
            continue  # a DTensor or a flat parameter: a shard of something that agrees
        if of_tensor(t, owned)["agree"] == "":
            out.append(t)
    return out


def _digest_state(tensors: list[torch.Tensor], h: Any) -> None:
    """A strided sample of each tensor, in one copy to the host: what the forward computed with, compared across
    ranks beside its inputs."""
    samples = []
    for t in tensors:
        t = t.detach()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.device.type == "meta" or not t.numel():
            continue
        flat = t.reshape(-1)
        samples.append(flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE].float())
    if samples:
        h.update(torch.cat([x.to(samples[0].device) for x in samples]).cpu().numpy().tobytes())


class FedInputs:
    """While a live step runs: a digest of what the outermost forwards of the rank's own modules (the modules the
    context held when the step began, and any module under them called directly: a router) were fed, and of the
    tensors those modules hold that are their rank's own. Equal digests across ranks mean the ranks ran the same
    function on the same data, so what those forwards output is expected to agree; per-rank batches, or a module
    with per-rank weights (an expert-parallel rank's experts), give per-rank outputs. A module's tensors that must
    agree (a DDP replica, a broadcast weight) are left out: their own rule names them where they part, and the
    output stays expected to agree."""

    def __init__(self, objects: Mapping[str, Any]) -> None:
        self.objects = {k: v for k, v in objects.items() if isinstance(v, nn.Module)}
        self.tops = {id(m) for v in self.objects.values() for m in v.modules()}
        self.depth = 0
        self.calls = 0
        import hashlib

        self.hash = hashlib.sha1()
        self._handles: list[Any] = []
        self._owned: dict[int, tuple[tuple[int, ...], str]] | None = None
        self._stated: set[int] = set()  # modules whose own tensors are in the digest already

    def __enter__(self) -> FedInputs:
        if self.tops:
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

            self._handles = [register_module_forward_pre_hook(self._pre),
                             register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.tops:
            if self.depth == 0:
                try:
                    _digest(args, self.hash)
                    if self._owned is None:  # at the first call: the wrappers the step has made by then
                        self._owned = _owned(self.objects)
                    if id(module) not in self._stated:  # once a step: a generation loop calls it per token
                        self._stated.add(id(module))
                        _digest_state(_own_state(module, self._owned), self.hash)
                    self.calls += 1
                except Exception:  # a boundary in the user's forward (a hook): a digest never fails it
                    pass
            self.depth += 1

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.tops:
            self.depth = max(0, self.depth - 1)

    @property
    def digest(self) -> str:
        return self.hash.hexdigest()[:16] if self.calls else ""


def annotate_outputs(rows: list[dict[str, Any]], outputs: Mapping[str, Any], extras: Mapping[str, dict],
                     rank_local: Iterable[str] = (), fed: str = "") -> None:
    """Outputs: declared (``same_on``), else synced by a collective, else this rank's own; ``fed``: the digest of
    what this step's forwards were fed (``FedInputs``), for the client to compare across ranks (``inputs``)."""
    local = set(rank_local)
    for row in rows:
        row["inputs"] = fed
        declared = (extras.get(row["name"]) or {}).get("agree")
        if declared is not None:
            continue  # the extras carry the declaration
        if row["name"].split(".", 1)[0] in local:
            row.update(OWN, agree_by="declared this rank's own (ctx.local)")
            continue
        t = outputs.get(row["name"])
        hit = _synced_of(t) if isinstance(t, torch.Tensor) else None
        row.update(_cols(*hit) if hit is not None else dict(OWN))
