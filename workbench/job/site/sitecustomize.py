"""The site hook ``workbench job`` puts on a job's ``PYTHONPATH`` (``workbench/job/hooks.py`` says what follows).

Python imports the first ``sitecustomize`` on its path at start-up. This one reads ``WORKBENCH_CAPTURE``: only
where it names a directory does it import the workbench (``hooks.arm()``: the capture starts once the rank
imports torch); absent, ``0`` or a word, nothing but ``os`` and ``sys`` is touched. Then it runs the
``sitecustomize`` this one shadows, if the path holds another. Nothing here may end the process: a failure is
one line on stderr and the job runs without capture.
"""

import os
import sys


def _arm() -> None:
    value = os.environ.get("WORKBENCH_CAPTURE", "").strip()
    if value.lower() in ("", "0", "off", "false", "no", "1", "on", "true", "yes"):
        return
    home = os.environ.get("WORKBENCH_CAPTURE_HOME")  # where workbench lives, for a job whose python lacks it
    if home and home not in sys.path:
        sys.path.append(home)
    try:
        from workbench.job import hooks

        hooks.arm()
    except Exception as exc:  # the site hook may never end the job's process: one line, no capture
        sys.stderr.write(f"workbench: capture off in this process: {type(exc).__name__}: {exc}\n")


def _chain() -> None:
    """The next ``sitecustomize`` on the path (the one this file shadows), run as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_arm()
_chain()  # what it raises, Python's site reports as it would have without this file
