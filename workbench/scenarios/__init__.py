"""The incident catalogue: scenario id -> module holding a ``SCENARIO``.

Modules load on first use, so ``workbench list`` stays cheap and a broken scenario file
cannot stop the others from loading. A catalogue module's top level is only its declaration
(names, fixes, parameters): torch and the rank helpers are imported inside the steps, which run
on the ranks, so the client resolves a scenario without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from workbench.errors import UnknownName, WorkbenchError
from workbench.scenario import Scenario

CATALOGUE: dict[str, str] = {
    "eval-loop-uneven-batches": "workbench.scenarios.eval_loop_uneven_batches",
    "fsdp1-rotary-meta-init": "workbench.scenarios.fsdp1_rotary_meta_init",
    "fsdp2-nonpersistent-buffer-sync": "workbench.scenarios.fsdp2_nonpersistent_buffer_sync",
    "hsdp-replicas-diverge-at-init": "workbench.scenarios.hsdp_replicas_diverge_at_init",
    "router-bias-bf16": "workbench.scenarios.router_bias_bf16",
    "stale-conversion-cache": "workbench.scenarios.stale_conversion_cache",
    "to-empty-clobbers-buffers": "workbench.scenarios.to_empty_clobbers_buffers",
    "weight-sync-order-desync": "workbench.scenarios.weight_sync_order_desync",
    "weight-sync-rank0-metadata": "workbench.scenarios.weight_sync_rank0_metadata",
}


def names() -> list[str]:
    return sorted(CATALOGUE)


def get(name: str) -> Scenario:
    if name not in CATALOGUE:
        raise UnknownName("scenario", name, names())
    return importlib.import_module(CATALOGUE[name]).SCENARIO


def resolve(spec: str | Scenario) -> Scenario:
    """A Scenario, a catalogue id, or ``path/to/file.py:object``."""
    if isinstance(spec, Scenario):
        return spec
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        return load_file(spec)
    return get(spec)


def load_file(spec: str) -> Scenario:
    path_s, _, attr = spec.partition(":")
    path = Path(path_s)
    if not path.is_file():
        raise WorkbenchError(f"scenario file {path_s!r} does not exist")
    mod_name = f"workbench_user_{path.stem}"
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(mod_name, None)
        raise WorkbenchError(f"scenario file {path_s}: syntax error at line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:  # a boundary: the user's file runs its own code, which raises anything; one line
        sys.modules.pop(mod_name, None)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise WorkbenchError(f"scenario file {path_s} raised at import: {type(exc).__name__}: {first}") from None
    # The engines cannot import this file by name: ship its functions by value.
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    attr = attr or "SCENARIO"  # `file.py:` means the module's SCENARIO, like a catalogue module
    obj = getattr(module, attr, None)
    if obj is not None and not isinstance(obj, Scenario):
        raise WorkbenchError(f"{attr!r} in {path_s} is of type {type(obj).__name__}, not a Scenario "
                             "(make it with workbench.Scenario(...))")
    if not isinstance(obj, Scenario):
        found = [k for k, v in vars(module).items() if isinstance(v, Scenario)]
        raise WorkbenchError(f"{path_s} has no Scenario named {attr!r}; it has: {', '.join(found) or 'none'}")
    return obj
