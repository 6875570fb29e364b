"""The doc test: every fenced code block of README.md and docs/*.md runs here, so the pages cannot
drift from the code.

- ```python blocks run, a page's blocks in order in one namespace (later blocks use earlier
  objects), in a temporary directory. ``wb.start(ranks=2)`` in a page hands back the suite's shared
  2-rank gloo cluster (conftest's ``cluster``), and ``cluster.stop()`` there leaves it up for the next
  page: engines cost 7-10 s to start on 2 cores.
- ```bash / ```console blocks run line by line (``#`` comments dropped) with the venv's ``workbench``
  first on PATH, in the same directory (``fixtures/`` is linked into it), after the page's python
  blocks above them. ``<!-- doc: exits N: why -->`` right before a block says the status it ends with.
- ```text blocks are not code. One right after a shell block that runs is that block's output, and must be
  it, line for line; in any other, every folder or ``.py`` file it names must exist.
- A block that cannot run here carries ``<!-- doc: not run: why -->`` on the line right before it.
  It is still checked: a python block compiles, and every ``wb.``/``workbench.`` name it uses resolves;
  a shell block's ``workbench`` subcommands and ``--flags`` exist in the CLI's parser, and its ``make``
  targets in the Makefile.

Also: every ``wb.``/``workbench.`` name in a page's prose resolves; every ``cluster.``, ``s.`` (session) and
``frame.`` attribute a page names, in code or prose, exists;
every repository path a page names in backticks exists, every relative link and image
resolves, and the README stays one screen (under 150 lines, one image under 200 KB).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "README.md"]
LANGS = {"python", "bash", "console", "text"}
SHELL = {"bash", "console"}
NOT_RUN = re.compile(r"<!--\s*doc:\s*not run:\s*(.+?)\s*-->")
EXITS = re.compile(r"<!--\s*doc:\s*exits\s+(\d+):\s*(.+?)\s*-->")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # why, when the page says it cannot run here
    exits: int = 0
    end: int = 0  # 1-based line of the closing fence

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang})"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            j = i + 1
            while j < len(lines) and lines[j].rstrip() != "```":
                j += 1
            assert j < len(lines), f"{page.name}:{i + 1}: a code block that never closes"
            before = lines[i - 1] if i else ""
            skip, exits = NOT_RUN.search(before), EXITS.search(before)
            out.append(Block(page, i + 1, lang, "\n".join(lines[i + 1:j]) + "\n",
                             skip.group(1) if skip else None, int(exits.group(1)) if exits else 0, j + 1))
            i = j + 1
        else:
            i += 1
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def test_every_block_says_what_it_is():
    assert len(PAGES) > 5 and len(ALL) > 15
    for b in ALL:
        assert b.lang in LANGS, f"{b}: name the block's language (one of {sorted(LANGS)})"
        if b.not_run is not None:
            assert len(b.not_run) > 10 and b.lang != "text", f"{b}: say why it cannot run"


# -- names: the package's attributes, the CLI's subcommands and flags, make's targets ---------------------
def _aliases(code: str) -> dict[str, str]:
    """The names a block binds to workbench modules (``import workbench as wb``, ``import workbench.job as wj``)."""
    out = {"wb": "workbench", "workbench": "workbench"}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "workbench":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "workbench"
    return out


def _resolve(dotted: str) -> None:
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:k + 1]))  # a submodule not imported yet


def _python_names(code: str) -> set[str]:
    """Every dotted workbench name a block uses: attribute chains on its aliases, and the modules it imports."""
    aliases, names = _aliases(code), set()
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in aliases:
                names.add(".".join([aliases[cur.id], *reversed(chain)]))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names |= {m for m in mods if m.split(".")[0] == "workbench"}
    # keep the longest chains only: resolving wb.viz.comparison resolves wb.viz
    return {n for n in names if not any(o.startswith(n + ".") for o in names)}


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=str)
def test_python_block_compiles_and_its_names_exist(block):
    compile(block.code, str(block), "exec")
    for name in _python_names(block.code):
        try:
            _resolve(name)
        except (AttributeError, ImportError) as e:
            pytest.fail(f"{block}: `{name}` does not exist ({e})")


def _cli() -> dict[str, set[str]]:
    from workbench.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def _commands(code: str) -> list[list[str]]:
    """The block's commands, one per line (a line ending in `\\` goes on; `#` comments and `[...]` synopsis
    brackets dropped, so `[--ranks N]` reads as `--ranks N`)."""
    out, cur = [], ""
    for line in code.splitlines():
        line = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if line.startswith("$ "):
            line = line[2:]
        cur += " " + line.rstrip("\\")
        if line.endswith("\\"):
            continue
        if cur.strip():
            out.append(cur.replace("[", " ").replace("]", " ").replace("|", " ").split())
        cur = ""
    return out


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in SHELL], ids=str)
def test_shell_block_names_real_subcommands_flags_and_targets(block):
    cli = _cli()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    commands = _commands(block.code)
    # a synopsis line continues the one above it when it starts with a flag
    for words in commands:
        if words[0] == "workbench":
            assert words[1] in cli, f"{block}: `workbench {words[1]}` is no subcommand ({sorted(cli)})"
            for w in words[2:]:
                if w == "--":  # what follows is another program's command line (`workbench job DIR -- torchrun ...`)
                    break
                flag = w.split("=")[0]
                if flag.startswith("-"):
                    assert flag in cli[words[1]], f"{block}: `workbench {words[1]}` has no {flag}"
        elif words[0] == "make":
            assert words[1] in targets, f"{block}: no make target {words[1]}"
        elif words[0].startswith("-"):
            for w in words:
                flag = w.split("=")[0]
                if flag.startswith("-"):
                    assert any(flag in flags for flags in cli.values()), f"{block}: no subcommand has {flag}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_workbench_name_in_a_pages_prose_exists(page):
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    name = re.compile(r"(?<![\w/.])(wb|workbench)((?:\.\w+)+)")
    named = {"workbench" + m.group(2) for span in re.findall(r"`([^`]+)`", prose) for m in name.finditer(span)}
    for name in sorted(named):
        try:
            _resolve(name)
        except (AttributeError, ImportError) as e:
            pytest.fail(f"{page.name}: `{name}` does not exist ({e})")


# -- the objects the pages talk about: cluster, s (a session), frame --------------------------------------
OBJECTS = {"cluster": ("workbench.live.connect", "JobCluster"), "s": ("workbench.live.session", "Session"),
           "frame": ("workbench.analysis.frames", "Frame")}


def _members(var: str) -> set[str]:
    """What ``var`` has: the class's attributes (``JobCluster`` is the widest cluster), what its methods assign
    to ``self.`` and what the package assigns to a variable of that name (``frame.released = ...``)."""
    import inspect

    module, name = OBJECTS[var]
    cls = getattr(importlib.import_module(module), name)
    out = set(dir(cls))
    for k in inspect.getmro(cls):
        if k.__module__.startswith("workbench"):
            out |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=", inspect.getsource(k)))
    for path in (ROOT / "workbench").rglob("*.py"):
        out |= set(re.findall(rf"(?<![\w.]){var}\.(\w+)\s*=(?!=)", path.read_text()))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cluster_session_and_frame_attribute_a_page_names_exists(page):
    members = {var: _members(var) for var in OBJECTS}
    named = re.findall(r"(?<![\w.])(cluster|s|frame)\.(\w+)", page.read_text())
    missing = sorted({f"{var}.{attr}" for var, attr in named if attr not in members[var]})
    assert not missing, f"{page.name} names attributes that do not exist: {missing}"


# -- paths, links, the README's size ---------------------------------------------------------------------
REPO_DIRS = ("workbench/", "tests/", "scripts/", "benchmarks/", "fixtures/", "notebooks/", "examples/", "docs/")
BACKTICKED = re.compile(r"`([^`\s]+)`")


def _repo_path(token: str) -> Path | None:
    """The file or folder a backticked token names, when it names one in the repository."""
    token = token.rstrip(".,;:")
    if token.startswith(REPO_DIRS) and not any(c in token for c in "<>*{"):
        return ROOT / token
    if re.fullmatch(r"workbench(\.[a-z_]+)+", token):  # a module: workbench.rank.phases
        base = ROOT / token.replace(".", "/")
        return base if base.is_dir() else base.with_suffix(".py")
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_link_a_page_names_exists(page):
    text = page.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    missing = sorted({t for t in BACKTICKED.findall(prose) if (p := _repo_path(t)) and not p.exists()})
    assert not missing, f"{page.name} names paths that do not exist: {missing}"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#")):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name}: the link {target} leads nowhere"
        anchor = target.partition("#")[2]
        if anchor and path.suffix == ".md":
            heads = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in heads, f"{page.name}: {target}: no heading #{anchor} in {path.name}"
    for b in blocks(page):
        if b.lang == "text" and not any(_is_output(page, s, b) for s in blocks(page) if s.lang in SHELL):
            for name in re.findall(r"(?<![\w.])([a-z_]+/|[a-z_]+\.py)(?=\s|$)", b.code):
                top = ROOT / b.code.split()[0].rstrip("/")  # a tree under one folder: its names are inside it
                found = (ROOT / name).exists() or any(top.rglob(name.rstrip("/")))
                assert found, f"{b}: {name} does not exist"


def test_the_readme_is_one_screen_with_one_picture():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 150
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(images) == 1 and (ROOT / images[0]).stat().st_size < 200_000
    # the set-up commands .ci/run and the Makefile stand behind
    assert "make demo" in text and "make test    # the whole test suite: what CI runs (.ci/run)" in text
    assert "make check   # a few minutes, for every change" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()


# -- running the pages -------------------------------------------------------------------------------------
class Shared:
    """The suite's cluster as a page sees it: ``stop()`` leaves it up for the next page."""

    def __init__(self, cluster):
        object.__setattr__(self, "_cluster", cluster)

    def __getattr__(self, name):
        return getattr(self._cluster, name)

    def __setattr__(self, name, value):
        setattr(self._cluster, name, value)

    def __repr__(self):
        return repr(self._cluster)

    def stop(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


RUN = [p for p in PAGES if any(b.not_run is None and b.lang != "text" for b in blocks(p))]


@pytest.mark.parametrize("page", RUN, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs(page, cluster, tmp_path, monkeypatch):
    from conftest import ready

    import workbench

    def start(ranks=2, **kwargs):
        assert ranks == 2, "a page's examples run on the suite's 2-rank cluster"
        return Shared(ready(cluster))

    monkeypatch.setattr(workbench, "start", start)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    namespace = {"__name__": "__doc_page__"}  # not importable: cloudpickle ships the page's functions by value
    shown = None  # the last shell block that ran, and what it printed
    for b in blocks(page):
        if b.lang == "text":
            if shown and _is_output(page, shown[0], b):
                printed, expected = shown[1].rstrip().splitlines(), b.code.rstrip().splitlines()
                assert printed == expected, f"{b}: not what {shown[0]} prints"
            continue
        shown = None
        if b.not_run is not None:
            continue
        if b.lang == "python":
            exec(compile(b.code, str(b), "exec"), namespace)
            continue
        printed = ""
        for words in _commands(b.code):
            line = shlex.join(words)
            out = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == b.exits, f"{b}: `{line}` exited {out.returncode}\n{out.stdout[-1500:]}" \
                                              f"\n{out.stderr[-1500:]}"
            printed += out.stdout
        shown = (b, printed)


def _is_output(page: Path, shell: Block, text: Block) -> bool:
    """Whether ``text`` follows ``shell`` with nothing but blank lines between: the output it shows."""
    between = page.read_text().splitlines()[shell.end:text.line - 1]
    return not any(line.strip() for line in between)
