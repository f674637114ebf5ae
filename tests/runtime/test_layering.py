"""The package's layering, read from the source: no circle between its sub-packages (imports inside
functions count: they are circles put off until run time), nothing imports the command-line module,
the config layer imports nothing of the package but its errors, and the plugin API (``htfl_dist.api``)
is the top layer: nothing in the package imports it. And a run starts without an optional extra it
does not use."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import REPO, SMOKE

PACKAGE = REPO / "htfl_dist"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every htfl_dist module ``path`` imports, anywhere in the file (relative imports resolved)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return {name for name in found if name == "htfl_dist" or name.startswith("htfl_dist.")}


def _unit(module: str) -> str:
    """The sub-package (or top-level module) a module belongs to: htfl_dist.runtime.loop → runtime."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "htfl_dist"


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], set[str]]]:
    edges: dict[str, set[str]] = defaultdict(set)
    witnesses: dict[tuple[str, str], set[str]] = defaultdict(set)
    known = {_module_name(path) for path in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        source = _module_name(path)
        for target in _imports(path):
            while target not in known and "." in target:  # `from pkg import name` names no module
                target = target.rpartition(".")[0]
            if target == "htfl_dist" or _unit(target) == _unit(source):
                continue
            edges[_unit(source)].add(_unit(target))
            witnesses[(_unit(source), _unit(target))].add(source)
    return edges, witnesses


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_no_circle_between_the_sub_packages():
    edges, witnesses = _graph()
    circles = _circles(edges)
    described = [{f"{a} -> {b}": sorted(witnesses[(a, b)]) for a in c for b in c if (a, b) in witnesses}
                 for c in circles]
    assert circles == [], described


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a made-up graph with a circle through three nodes."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_nothing_imports_the_command_line_module():
    importers = sorted(_module_name(path) for path in PACKAGE.rglob("*.py")
                       if path.name != "main.py" and "htfl_dist.main" in _imports(path))
    assert importers == []


def test_the_config_layer_imports_only_itself_and_the_errors():
    edges, witnesses = _graph()
    assert edges["config"] <= {"errors"}, {b: sorted(witnesses[("config", b)]) for b in edges["config"]}
    assert edges["errors"] == set()


def test_nothing_imports_the_plugin_api():
    """``htfl_dist.api`` re-exports for plugins; a module of the package importing it would tie the
    engine to its own public surface (and a circle through it would be one import away)."""
    importers = sorted(_module_name(path) for path in PACKAGE.rglob("*.py")
                       if path.name != "api.py" and any(name == "htfl_dist.api" or name.startswith("htfl_dist.api.")
                                                        for name in _imports(path)))
    assert importers == []


WITHOUT_CRYPTOGRAPHY = (
    "import runpy, sys\n"
    "sys.modules['cryptography'] = None  # every import of it fails, as where it is not installed\n"
    "sys.argv = ['htfl_dist.main', *sys.argv[1:]]\n"
    "runpy.run_module('htfl_dist.main', run_name='__main__')\n")


def _run_without_cryptography(tmp_path: Path, cache_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_CRYPTOGRAPHY, "--config", str(SMOKE), "--out",
                           str(tmp_path / "run"), f"data.cache_dir={cache_dir}", "rounds=1", "data.subsample=0.05",
                           *overrides], capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.launch
def test_a_run_starts_without_the_privacy_extra_and_secure_aggregation_says_what_it_lacks(tmp_path, cache_dir):
    """``cryptography`` is the privacy extra's: a GPU machine's image lacked it and every run of
    the GPU suite ended in a traceback at start-up, since the session imported the secure
    aggregation's module whether or not the run asked for it. The process, not this one, shows
    it: here the package is long imported."""
    plain = _run_without_cryptography(tmp_path / "plain", cache_dir)
    assert plain.returncode == 0, plain.stderr
    assert "done: best test_acc" in plain.stdout
    secure = _run_without_cryptography(tmp_path / "secure", cache_dir, "privacy.secure_aggregation=true")
    assert secure.returncode == 2, secure.stderr
    lines = [line for line in secure.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, secure.stderr
    assert lines[0].startswith("htfl_dist: error: privacy.secure_aggregation ")
    assert "'cryptography' (X25519, ChaCha20-Poly1305), which is not installed" in lines[0]
    assert "pip install 'htfl_dist[privacy]'" in lines[0]
