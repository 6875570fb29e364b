"""Whose tensors a point probes: the user's module inside a stack's wrapper, and the module an optimizer steps.

A wrapper is recognised by what it does, not by its class: it holds the user's module and its forward calls it,
so the module it holds has the wrapper's parameters. DDP and FSDP1 (``.module``), DeepSpeed's engine
(``.module``), Megatron-FSDP's ``MegatronFSDP`` (``.module``), Lightning Fabric's ``_FabricModule``
(``._forward_module``) all read so; so does a third-party library's module with exactly one child holding all its
parameters. A user's own module with one child is never unwrapped (its names are the ones the user knows).

An optimizer's step is probed as the module that owns its parameters, buffers included: a module a point already
probed, a model ``to_empty`` materialised, else (once per optimizer) the topmost live module holding them, found
among the objects the garbage collector tracks. Once found among the known models, it is kept while the optimizer
steps the same parameters and the model is still known: each check walked the model's tree (three walks a step
point, ~1 ms each for a Llama-1B on an H200 host, on the job's thread), and so does asking a module that is no
wrapper what it wraps only when it holds a candidate. ZeRO's optimizers hold flat partitions no module owns: the module
is then the one whose ``optimizer`` (or its ``optimizer``) is this optimizer (DeepSpeed's engine), unwrapped.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterable
from typing import Any

_ATTRS = ("module", "_forward_module")
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> weakref(module) or None
_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (its parameters, known module, owner)
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its wrappers (weak), outermost first


def unwrapped(module: Any) -> Any:
    """What a manual point would name: the module a wrapper holds (through several wrappers), else ``module``.
    The wrappers it went through are remembered (``wrappers``): what they make of the module (a replica across
    their group) still holds when a point probes the module alone."""
    chain = []
    for _ in range(8):
        inner = _held(module)
        if inner is None:
            break
        chain.append(module)
        module = inner
    if chain:
        _WRAPPERS[module] = [weakref.ref(w) for w in chain]
    return module


def wrappers(module: Any) -> list[Any]:
    """The live wrappers ``unwrapped`` last went through to reach ``module``, outermost first."""
    try:
        refs = _WRAPPERS.get(module) or []
    except TypeError:  # not weakly referable: never unwrapped to
        return []
    return [w for w in (r() for r in refs) if w is not None]


def _held(module: Any) -> Any:
    """The module ``module`` wraps, or None."""
    from torch import nn

    if not isinstance(module, nn.Module):
        return None
    held = []  # what could be the wrapped module, found without walking the tree (a step point asks each step)
    for attr in _ATTRS:
        inner = module.__dict__.get(attr)
        inner = module._modules.get(attr) if inner is None else inner
        if isinstance(inner, nn.Module) and inner is not module:
            held.append(inner)
    children = list(module.children())
    one = children[0] if len(children) == 1 and _third_party(type(module)) else None
    if not held and one is None:
        return None
    mine = {id(p) for p in module.parameters()}
    for inner in held:
        if {id(p) for p in inner.parameters()} == mine:
            return inner
    if one is not None and mine and {id(p) for p in one.parameters()} == mine:
        return one
    return None


def _third_party(cls: type) -> bool:
    """A class of an installed library other than torch (a stack's wrapper), never the user's nor torch's."""
    from workbench.rank.ledger import is_library

    file = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    root = cls.__module__.split(".", 1)[0]
    return bool(file) and is_library(file) and root not in ("torch", "workbench")


def owner(optimizer: Any, known: Iterable[Any]) -> Any:
    """The module whose parameters ``optimizer`` steps (unwrapped), or None: the first of ``known`` holding all of
    them, else the one found once among the live modules (a stack that materialised module by module left only
    the inner modules in ``known``)."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    known = list(known)
    hit = _OWNER.get(optimizer)
    if hit is not None and hit[0] == mine:  # the same parameters as when it was found: no walk of the tree
        module, found = hit[1](), hit[2]()
        if found is not None and any(m is module for m in known):
            return found
    for module in known:  # a model a point probed or to_empty met, when it holds every one of them
        if module is not None and mine <= {id(p) for p in module.parameters()}:
            found = unwrapped(module)
            _OWNER[optimizer] = (frozenset(mine), weakref.ref(module), weakref.ref(found))
            return found
    if optimizer in _FOUND:
        ref = _FOUND[optimizer]
        return ref() if ref is not None else None
    found = _search(optimizer, mine)
    _FOUND[optimizer] = weakref.ref(found) if found is not None else None
    return found


def of_loss(loss: Any, known: Iterable[Any]) -> Any:
    """The module a loss was computed by (unwrapped), or None: the leaves its autograd graph accumulates into are
    parameters; the first of ``known`` holding any of them, else the topmost live module holding most of them
    (once: a non-finite loss is looked at once)."""
    mine = _leaves(getattr(loss, "grad_fn", None))
    if not mine:
        return None
    for module in known:
        if module is not None and any(id(p) in mine for p in module.parameters()):
            return unwrapped(module)
    from torch import nn

    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), nn.Module)]
    holders = [m for m in modules if any(id(p) in mine for p in m.parameters(recurse=False))]
    top = _topmost(holders, modules, mine) if holders else None
    return unwrapped(top) if top is not None else None


def _leaves(fn: Any, limit: int = 100_000) -> set[int]:
    """id() of the tensors a graph's ``AccumulateGrad`` nodes write (its parameters), walking at most ``limit``
    nodes."""
    out: set[int] = set()
    todo, seen = [fn], set()
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            out.add(id(variable))
        todo.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return out


def _search(optimizer: Any, mine: set[int]) -> Any:
    """The topmost live module holding most of the optimizer's parameters; else the one driving this optimizer
    (an engine whose ``optimizer`` or ``optimizer.optimizer`` it is), unwrapped."""
    from torch import nn

    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), nn.Module)]  # type(): no __class__ lookup
    holders, drivers = [], []
    for obj in modules:
        opt = obj.__dict__.get("optimizer")
        if opt is optimizer or getattr(opt, "optimizer", None) is optimizer:
            drivers.append(obj)
        elif any(id(p) in mine for p in obj.parameters(recurse=False)):
            holders.append(obj)
    if drivers:
        return unwrapped(drivers[0])
    if not holders:
        return _named_by_params(optimizer)
    top = _topmost(holders, modules, mine)
    return unwrapped(top) if top is not None else None


def _topmost(holders: list[Any], modules: list[Any], mine: set[int]) -> Any:
    """Among the modules that hold any of ``mine`` directly, the live module (theirs or an ancestor) holding the
    most of them: walk up from each holder through the modules that list it as a child."""
    parents: dict[int, Any] = {}
    for obj in modules:
        for child in obj._modules.values():
            if child is not None:
                parents.setdefault(id(child), obj)
    tops: dict[int, Any] = {}
    for m in holders:
        seen = 0
        while id(m) in parents and seen < 64:
            m, seen = parents[id(m)], seen + 1
        tops[id(m)] = m
    return max(tops.values(), key=lambda m: sum(id(p) in mine for p in m.parameters()), default=None)


def _named_by_params(optimizer: Any) -> Any:
    """The model a parameter of the optimizer names in its own attributes (Megatron-FSDP's distributed parameters
    carry ``_megatron_fsdp_model``), unwrapped; None when none does."""
    from torch import nn

    for group in optimizer.param_groups:
        for p in group["params"][:4]:
            for value in getattr(p, "__dict__", {}).values():
                if isinstance(value, nn.Module):
                    return unwrapped(value)
    return None
