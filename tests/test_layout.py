"""The package's import rules, read from the source with ``ast`` (lazy imports count).

Layers, bottom up: the public face and declarations (``workbench``, ``errors``,
``scenario``), ``rank`` (the instrumentation inside a rank), ``lab`` (what scenarios are built
from: models, FSDP helpers, the weight-sync roles), ``scenarios``, ``analysis``, ``viz``,
``postmortem``, ``job``, ``live``, ``teach``, ``cli``. A module may import its own layer or lower ones;
``rank`` only itself and the declarations (never ``lab``); ``lab`` only itself, ``rank`` and the
declarations; ``job`` no ``lab``; nothing imports ``teach`` (``workbench/__init__``
reaches it lazily, by name); no import cycle anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "workbench"
LAYERS = ["", "rank", "lab", "scenarios", "analysis", "viz", "postmortem", "job", "live", "teach", "cli"]
BASE = {"workbench", "workbench.errors", "workbench.scenario"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every workbench module ``module`` imports, at top level or inside a function."""
    tree = ast.parse(MODULES[module].read_text())
    is_pkg = MODULES[module].name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == "workbench":
                hit = _resolve(t)
                if hit and hit != module:
                    out.add(hit)
    return out


def layer(module: str) -> int:
    if module in BASE:
        return 0
    return LAYERS.index(module.split(".")[1])


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        assert layer(m) >= 0, m


def test_rank_imports_only_rank_and_declarations():
    bad = [(m, t) for m, ts in GRAPH.items() if m.startswith("workbench.rank")
           for t in ts if not (t.startswith("workbench.rank") or t in BASE - {"workbench"})]
    assert not bad, f"rank/ reaches outside rank/: {bad}"


def test_rank_imports_nothing_from_the_lab():
    """The instrumentation stands alone: a user's own job (``job/``) loads ``rank/`` without the lab."""
    bad = [(m, t) for m, ts in GRAPH.items() if m.startswith("workbench.rank")
           for t in ts if t.startswith("workbench.lab")]
    assert not bad, f"rank/ imports the lab: {bad}"


def test_lab_imports_only_lab_rank_and_declarations():
    bad = [(m, t) for m, ts in GRAPH.items() if m.startswith("workbench.lab")
           for t in ts if not (t.startswith(("workbench.lab", "workbench.rank")) or t in BASE - {"workbench"})]
    assert not bad, f"lab/ reaches outside lab/ and rank/: {bad}"


def test_job_imports_rank_not_the_lab():
    """The capture inside the user's training process needs the instrumentation, never the tiny models."""
    bad = [(m, t) for m, ts in GRAPH.items() if m.startswith("workbench.job") for t in ts
           if t.startswith("workbench.lab")]
    assert not bad, f"job/ imports the lab: {bad}"
    assert any(t.startswith("workbench.rank") for m, ts in GRAPH.items() if m.startswith("workbench.job") for t in ts)


def test_imports_only_go_down_the_layers():
    bad = [(m, t) for m, ts in GRAPH.items() for t in ts if layer(t) > layer(m)]
    assert not bad, f"imports that go up a layer: {bad}"


def test_postmortem_never_imports_live_and_engines_never_import_sessions():
    assert not any(t.startswith("workbench.live") for m, ts in GRAPH.items()
                   if m.startswith("workbench.postmortem") for t in ts)
    assert "workbench.live.session" not in GRAPH["workbench.live.engines"]


def test_job_never_imports_live_and_postmortem_never_imports_job():
    """The capture runs inside the user's training process: rank-side code and the shard format
    (``rank.shard_format``, which the reader imports too), never the engines; the reader of shards is
    postmortem's own, and the capture's writer does not import it."""
    assert not [(m, t) for m, ts in GRAPH.items() if m.startswith("workbench.job") for t in ts
                if t.startswith("workbench.live")]
    assert not [(m, t) for m, ts in GRAPH.items() if m.startswith("workbench.postmortem") for t in ts
                if t.startswith("workbench.job")]
    assert "workbench.rank.shard_format" in GRAPH["workbench.job.shard"]
    assert "workbench.rank.shard_format" in GRAPH["workbench.postmortem.shards"]
    assert "workbench.postmortem.shards" not in GRAPH["workbench.job.shard"]


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                return [*stack[stack.index(t):], t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_nothing_imports_teach():
    bad = [(m, t) for m, ts in GRAPH.items() if not m.startswith("workbench.teach")
           for t in ts if t.startswith("workbench.teach")]
    assert not bad, f"teach/ is the top of the client: {bad}"


@pytest.mark.parametrize("folder", [
    "rank", "lab", "live", "analysis", "postmortem", "viz", "scenarios", "teach", "job"])
def test_each_folder_says_what_lives_there(folder):
    doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 15, f"workbench/{folder}/__init__.py needs a docstring"


def test_the_checker_sees_lazy_imports_and_cycles():
    """The rules above would pass vacuously if the walker missed function-level imports."""
    assert "workbench.postmortem.bundle" in GRAPH["workbench.live.session"]
    assert "workbench.live.engine_fork" in GRAPH["workbench.live.engines"]  # imported inside _start
    assert "workbench.lab.weightsync.model" in GRAPH["workbench.lab.weightsync.vllm_role"]  # inside functions
    GRAPH["workbench.errors"].add("workbench.live.session")
    try:
        assert _cycle() is not None
    finally:
        GRAPH["workbench.errors"].discard("workbench.live.session")
