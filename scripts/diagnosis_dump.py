"""Every diagnosis the workbench can be checked against, dumped as text: a refactor of the diagnosis proves
itself byte-identical by dumping before and after and comparing the two files.

    python scripts/diagnosis_dump.py OUT.jsonl [bundles] [synthetic] [tests]   (all three by default)
    python scripts/diagnosis_dump.py --compare BEFORE.jsonl AFTER.jsonl        (exit 1 when a diagnosis moved)

One JSON line per diagnosis, in a fixed order:
- each recorded bundle under fixtures/ (``*.wbundle``, ``*.bundle``): every run's own diagnosis, then for each
  run other than the bug path ``diagnose_comparison(bug, run)``, then the report's "What happened" lines;
- synthetic records at 8 and 64 ranks (``workbench.analysis.synthetic``, the views' scale benchmark's shape);
- every record the engine-free diagnosis tests build (``TESTS``), as the test diagnoses it: ``diagnosis.diagnose``
  and ``diagnosis.diagnose_comparison`` are wrapped while pytest runs those files, and each outermost call is
  dumped under the test's id (a test that starts engines is left out); and every record their builders make
  (``BUILDERS``: most rule tests ask only which rule fired), diagnosed whole as it is built.

A diagnosis is dumped whole: mechanism, sentence, step, ranks, tensor, call, evidence, parted, the fix's own
(``Diagnosis.to_dict()``) and the figure's grid. (No captured job directories are under fixtures/ today; the
job captures the tests build need torchrun, so they are not here.)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_diagnosis.py", "tests/test_diagnosis_rules.py", "tests/test_collectives.py"]
ENGINES = {"cluster", "another_cpu", "healthy"}  # fixtures that start engines: their tests are left out
BUILDERS = {"test_diagnosis.py": "record", "test_diagnosis_rules.py": "rec"}  # each file's record builder


def whole(d: Any) -> dict[str, Any]:
    out = d.to_dict()
    out["grid"] = d.grid.to_csv(index=False) if d.grid is not None else None
    return out


def line(source: str, what: str, d: Any) -> str:
    return json.dumps({"source": source, "what": what, **whole(d)}, sort_keys=True, default=str)


def bundles() -> list[str]:
    from workbench.analysis import diagnosis
    from workbench.postmortem import bundle, report

    lines = []
    paths = sorted([*ROOT.glob("fixtures/**/*.wbundle"), *ROOT.glob("fixtures/**/*.bundle")])
    for path in paths:
        name = str(path.relative_to(ROOT))
        b = bundle.load(path)
        runs = list(b)
        bug = next((r for r in runs if not r.manifest.get("fix")), runs[0])
        for r in runs:
            lines.append(line(name, f"diagnose {r.label}", diagnosis.diagnose(r)))
        for r in runs:
            if r is not bug:
                lines.append(line(name, f"compare {r.label}", diagnosis.diagnose_comparison(bug, r)))
        page = report._Page()
        report._what_happened(page, runs)
        said = [p for p in page.parts if p.startswith("<p class='diagnosis'>")]
        lines.append(json.dumps({"source": name, "what": "report", "lines": said}, sort_keys=True))
    return lines


def synthetic() -> list[str]:
    import pandas as pd

    from workbench.analysis import diagnosis
    from workbench.analysis.frames import EVENT_COLUMNS, OUTPUT_COLUMNS, table
    from workbench.analysis.synthetic import incident_step
    from workbench.postmortem.record import RunRecord

    lines = []
    names = ["load", "cast", "wrap_fsdp1", "forward"]
    for n in (8, 64):
        hist = pd.concat([incident_step(n, 12, step=s, index=i) for i, s in enumerate(names)], ignore_index=True)
        events, outputs = table([], EVENT_COLUMNS), table([], OUTPUT_COLUMNS)
        for df in (events, outputs):
            df.insert(0, "step_index", pd.Series(dtype="int64"))
            df.insert(0, "step", pd.Series(dtype="object"))
        manifest = {"scenario": "synthetic", "fix": None, "steps_run": names, "ranks": n, "backend": "gloo",
                    "params": {}, "elapsed": []}
        lines.append(line("synthetic", f"{n} ranks", diagnosis.diagnose(RunRecord(manifest, hist, outputs, events))))
    return lines


def from_tests() -> list[str]:
    import pytest

    from workbench.analysis import diagnosis

    lines: list[str] = []
    state = {"node": None, "depth": 0, "n": 0, "built": 0}

    def wrap(name: str):
        fn = getattr(diagnosis, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            state["depth"] += 1
            try:
                d = fn(*a, **kw)
            finally:
                state["depth"] -= 1
            if state["depth"] == 0:
                state["n"] += 1
                lines.append(line(str(state["node"]), f"{name} #{state['n']}", d))
            return d
        return wrapped

    def built(make: Any) -> Any:
        def wrapped(*a: Any, **kw: Any) -> Any:
            r = make(*a, **kw)
            state["built"] += 1
            try:
                # a copy: the test's own record stays unread, as the test left it (a test may count the reads)
                said = line(str(state["node"]), f"built #{state['built']}", originals["diagnose"](copy.copy(r)))
            except Exception as exc:  # a record the test builds to see it refused
                said = json.dumps({"source": str(state["node"]), "what": f"built #{state['built']}",
                                   "raised": f"{type(exc).__name__}: {exc}"})
            lines.append(said)
            return r
        return wrapped

    class Plugin:
        def pytest_collection_modifyitems(self, config: Any, items: list) -> None:
            keep = [i for i in items if not ENGINES & set(getattr(i, "fixturenames", ()))]
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep
            for mod in {i.module for i in keep}:
                name = BUILDERS.get(Path(mod.__file__).name)
                if name and not getattr(getattr(mod, name), "_dumped", False):
                    setattr(mod, name, built(getattr(mod, name)))
                    getattr(mod, name)._dumped = True

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item: Any, nextitem: Any):
            state["node"], state["n"], state["built"] = item.nodeid, 0, 0
            yield

    originals = {n: getattr(diagnosis, n) for n in ("diagnose", "diagnose_comparison")}
    for n in originals:
        setattr(diagnosis, n, wrap(n))
    try:
        rc = pytest.main(["-q", "-p", "no:cacheprovider", *[str(ROOT / t) for t in TESTS]], plugins=[Plugin()])
    finally:
        for n, fn in originals.items():
            setattr(diagnosis, n, fn)
    print(f"tests: pytest exit {rc}, {len(lines)} diagnoses", file=sys.stderr)
    return lines


def compare(before: Path, after: Path) -> int:
    """Each diagnosis in both dumps must be byte-identical; one only in ``after`` is a new test's (listed)."""
    def read(p: Path) -> dict[tuple[str, str], str]:
        return {(d["source"], d["what"]): ln for ln in p.read_text().splitlines() for d in [json.loads(ln)]}

    a, b = read(before), read(after)
    moved = [k for k in a if k in b and a[k] != b[k]]
    gone = [k for k in a if k not in b]
    for k in moved + gone:
        print(("moved" if k in b else "gone"), *k)
    for k in b:
        if k not in a:
            print("new", *k)
    same = len(a) - len(moved) - len(gone)
    print(f"{same} of {len(a)} diagnoses byte-identical, {len(moved)} moved, {len(gone)} gone, "
          f"{sum(k not in a for k in b)} new")
    return 1 if moved or gone else 0


def main() -> None:
    if sys.argv[1] == "--compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    out, parts = Path(sys.argv[1]), sys.argv[2:] or ["bundles", "synthetic", "tests"]
    lines = [x for part, make in (("bundles", bundles), ("synthetic", synthetic), ("tests", from_tests))
             if part in parts for x in make()]
    out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} lines -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
