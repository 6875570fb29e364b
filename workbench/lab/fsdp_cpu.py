"""The one place the workbench bends FSDP1: ``sync_module_states`` on CPU modules.

FSDP1 refuses ``sync_module_states=True`` when module states are on the CPU, through
the private check ``_check_module_states_for_sync_module_states``; the broadcast behind
it works on gloo. Bypassing only that check lets the headline incident run on CPU ranks,
with FSDP's own broadcast code path untouched. On GPUs the check passes and nothing is
bypassed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_CHECK = "_check_module_states_for_sync_module_states"


@contextlib.contextmanager
def allow_cpu_sync_module_states(device_type: str) -> Iterator[None]:
    if device_type != "cpu":
        yield
        return
    import torch.distributed.fsdp._init_utils as _init_utils  # here, not at import: scenario declarations import this

    original = getattr(_init_utils, _CHECK)
    setattr(_init_utils, _CHECK, lambda module_states: None)
    try:
        yield
    finally:
        setattr(_init_utils, _CHECK, original)
