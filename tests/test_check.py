"""``make check`` is honest: every module of ``workbench/`` has a test in it, and that test reaches the module.

The check set is ``CHECK`` in ``tests/conftest.py`` (a module's file -> one test's node id) plus
``CHECK_END_TO_END``; conftest marks those tests ``check`` and ``make check`` runs ``-m check``. What counts
as "a test for a module" is read from the test's source with ``ast``, never taken on the map's word:

- the test *names* the module: it imports it (in its file, bound to a name it uses, or inside itself), uses an
  attribute of a name bound to it, writes its dotted name (``"workbench.cli"`` for a subprocess) or, for a
  scenario, its catalogue name (``"fsdp1-rotary-meta-init"``); what the test's own fixtures and the helpers
  of its file that it calls name counts as its own;
- or a module it names imports the module (one hop in the import graph of ``tests/test_layout.py``; not from
  the package root or the CLI, which import nearly everything).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from conftest import CHECK, CHECK_END_TO_END, CHECK_IDS
from test_layout import GRAPH, MODULES, _resolve

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NO_HOP = {"workbench", "workbench.cli"}  # they import nearly every module: a hop from them proves nothing
SCENARIOS = {m.rsplit(".", 1)[1].replace("_", "-"): m for m in MODULES if m.startswith("workbench.scenarios.")}


def _module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """(bound name, dotted target) for each name an absolute import binds."""
    if isinstance(node, ast.Import):
        return [(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0]) for a in node.names]
    if node.level or not node.module:
        return []
    return [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names]


@cache
def _file(path: Path) -> tuple[dict[str, str], dict[str, ast.FunctionDef], dict[str, ast.expr]]:
    """A file's top-level import bindings (name -> dotted target), functions and assigned values."""
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}
    funcs: dict[str, ast.FunctionDef] = {}
    values: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update(_targets(node))
        elif isinstance(node, ast.FunctionDef):
            funcs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    values[t.id] = node.value
    return bound, funcs, values


def _exported(module: str, name: str) -> str | None:
    """The module a package hands out as ``name``: its own import of it, or its lazy table (``workbench._LAZY``)."""
    bound, _, values = _file(MODULES[module])
    if name in bound:
        return _resolve(bound[name])
    lazy = values.get("_LAZY")
    if isinstance(lazy, ast.Dict):
        for k, v in zip(lazy.keys, lazy.values):
            if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Tuple):
                return _resolve(v.elts[0].value)
    return None


def _attribute(target: str, chain: list[str]) -> str | None:
    """The module ``target.a.b`` is or comes from (``target``: what an import bound), re-exports followed."""
    module = _resolve(target)
    for part in [p for p in target[len(module or ""):].split(".") if p] + chain:
        if module is None or MODULES[module].name != "__init__.py":
            break
        module = f"{module}.{part}" if f"{module}.{part}" in MODULES else _exported(module, part) or module
    return module


def _path_parts(node: ast.AST) -> list[str] | None:
    """``ROOT / "workbench" / "job" / "site"``'s string parts, left to right."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _path_parts(node.left), _path_parts(node.right)
        return None if right is None else [*(left or []), *right]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("/")
    return [] if isinstance(node, (ast.Name, ast.Attribute, ast.Call)) else None


def _strings(node: ast.AST) -> set[str]:
    """The modules a string or path expression names: a dotted name in it (``-m workbench.cli``, code run in a
    subprocess), a scenario's catalogue name, or a folder or file of the package."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out |= {SCENARIOS[sub.value]} if sub.value in SCENARIOS else {
                _resolve(name) for name in re.findall(r"\bworkbench(?:\.\w+)+", sub.value)} - {None}
        parts = _path_parts(sub) if isinstance(sub, ast.BinOp) else None
        if parts and "workbench" in parts[:-1]:
            rel = "/".join(parts[parts.index("workbench"):]).removesuffix(".py")
            out |= {m for m, p in MODULES.items()
                    if (f := str(p.relative_to(ROOT)).removesuffix(".py")) == rel or f.startswith(rel + "/")}
    return out


def _dotted(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _named_by(path: Path, func: str, seen: set[str] | None = None) -> set[str]:
    """The workbench modules test (or helper, or fixture) ``func`` of ``path`` names, its callees' included."""
    bound, funcs, values = _file(path)
    seen = set() if seen is None else seen
    seen.add(func)
    fn = funcs[func]
    out: set[str] = _strings(fn)
    used = {a.arg for a in fn.args.args}  # its fixtures, where the file defines them
    for node in ast.walk(fn):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {_resolve(t) for _, t in _targets(node) if t.startswith("workbench")} - {None}
        elif isinstance(node, (ast.Attribute, ast.Name)) and (chain := _dotted(node)):
            used.add(chain[0])
            if chain[0] in bound and bound[chain[0]].startswith("workbench"):
                out |= {_attribute(bound[chain[0]], chain[1:])} - {None}
    for name in used - seen:
        seen.add(name)
        if name in funcs:
            out |= _named_by(path, name, seen)
        elif name in values:
            out |= _strings(values[name])
    return out


def reached_by(node_id: str) -> set[str]:
    """Every module the test ``node_id`` names, every module those import (one hop, not from NO_HOP), and the
    packages above them (importing a module runs its packages' ``__init__``)."""
    file, _, name = node_id.partition("::")
    named = _named_by(ROOT / file, name.split("[", 1)[0])
    reached = named | {t for m in named - NO_HOP for t in GRAPH[m]}
    return reached | {".".join(m.split(".")[:k]) for m in reached for k in range(1, m.count(".") + 1)}


def test_every_module_of_the_package_has_a_test_in_the_check_set():
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "workbench").rglob("*.py")}
    assert not files - set(CHECK), f"modules with no test in make check's set: {sorted(files - set(CHECK))}"
    assert not set(CHECK) - files, f"CHECK names files that are not modules: {sorted(set(CHECK) - files)}"


@pytest.mark.parametrize("path", sorted(CHECK))
def test_each_modules_check_test_reaches_it(path):
    assert _module_of(path) in reached_by(CHECK[path]), f"{CHECK[path]} neither names {path} nor imports it"


def test_every_test_in_the_check_set_exists():
    for node_id in CHECK_IDS:
        file, _, name = node_id.partition("::")
        assert (ROOT / file).is_file() and name.split("[", 1)[0] in _file(ROOT / file)[1], node_id


def _words(path: Path, func: str, seen: set[str] | None = None) -> set[str]:
    """Every string test ``func`` of ``path`` writes, its fixtures', helpers' and module constants' included."""
    _, funcs, values = _file(path)
    seen = set() if seen is None else seen
    seen.add(func)
    out = {n.value for n in ast.walk(funcs[func]) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    for name in {n.id for n in ast.walk(funcs[func]) if isinstance(n, ast.Name)} | {
            a.arg for a in funcs[func].args.args}:
        if name in seen:
            continue
        seen.add(name)
        if name in funcs:
            out |= _words(path, name, seen)
        elif name in values:
            out |= {n.value for n in ast.walk(values[name]) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return out


def test_the_end_to_end_path_is_the_headline_a_job_capture_and_a_report():
    """The headline run by the CLI with a report; a torchrun job run under ``workbench job``, then reported."""
    said = [_words(ROOT / t.split("::")[0], t.split("::")[1]) for t in CHECK_END_TO_END]
    assert any({"run", "fsdp1-rotary-meta-init", "--report"} <= words for words in said), said
    assert any({"job", "torch.distributed.run", "report"} <= words for words in said), said
    assert all("workbench.cli" in reached_by(t) for t in CHECK_END_TO_END)


def test_the_reader_sees_what_a_test_names_and_nothing_it_does_not():
    """The rules above would pass vacuously if every test reached every module."""
    named = "tests/test_collectives.py::test_the_library_line_is_the_innermost_module_that_issued_the_call"
    assert "workbench.rank.ledger_fr" in reached_by(named)  # it imports ledger_fr and calls into it
    assert "workbench.rank.ledger_fr" not in reached_by("tests/test_collectives.py::test_ledger_table_is_parquet_safe")
    assert reached_by("tests/test_layout.py::test_no_import_cycle") == set()  # it reads the graph, imports none
