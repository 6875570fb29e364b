"""A rank-side function named by its module and attribute, imported where it runs.

The client ships functions to the engines by reference, but pickling a function by
reference needs the function object, and so the module that defines it: for the rank
layer that is torch (seconds of import) in a client that only sends the call. ``RankFn``
carries the two names instead; the engine imports the module on the first call (it
has usually imported it already) and calls the function.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankFn:
    """``module:name`` as a callable; picklable without importing ``module`` on the client."""

    module: str
    name: str

    @property
    def __name__(self) -> str:  # what ipyparallel and error lines call the function
        return self.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)
