"""The capture's public methods take only the calls they were written for: ``takes``.

Its own module, below ``shard.py`` and the capture's parts (``capture_points``, ``capture_attach``,
``capture_reads``), which each decorate their public methods with it; ``NoCapture`` does too, so a call either
cannot take is refused alike whether the capture is on or off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.job import guest

# How a refused call is said: ``shard.say_once`` (once per process, its memory ``shard._SAID``), which ``shard.py``
# puts here when it is imported; this module cannot import it (``shard.py`` imports the parts that import this).
say_once: Callable[[str], None] = guest.say


def takes(nothing: Any = None) -> Any:
    """A public method of the capture (and of ``NoCapture``): a call it cannot take (an object by position, a
    keyword it does not know) is said once and records nothing, answering ``nothing()``; never a ``TypeError`` in
    the job (``strict=True``: it raises). Only a call that does not bind to the signature is taken for one: a
    ``TypeError`` from inside the method is not."""
    import functools
    import inspect

    def wrap(fn: Any) -> Any:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except TypeError as exc:
                try:
                    sig.bind(self, *args, **kwargs)
                except TypeError:
                    if getattr(self, "strict", False):
                        raise
                    hint = " (objects go by keyword: cap.point(\"step1\", model=model))" if args else ""
                    say_once(f"workbench: rank {self.rank}: cap.{fn.__name__}() cannot take this call: {exc}{hint}; "
                             "it recorded nothing")
                    return nothing() if callable(nothing) else nothing
                raise

        return method

    return wrap
