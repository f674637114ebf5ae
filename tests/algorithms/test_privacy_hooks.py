"""Privacy reaches the algorithms only through the client (``ClientState.private``): no module of
``htfl_dist.algorithms`` imports ``htfl_dist.privacy``, not even inside a function; the batch
primitives both training loops walk live in a leaf; a run without privacy needs no Opacus.

The import scans read the source with ``ast``, so an import inside a function counts as much as
one at the top; the Opacus check starts a process in which Opacus cannot be imported."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SMOKE, _env, maths_only, read_metrics

ALGORITHMS = REPO / "htfl_dist" / "algorithms"


def imported_modules(path: Path, root: Path = REPO, *, skip_type_checking: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` (a file under ``root``), at any depth
    (functions, classes, branches): ``from a import b`` counts as both ``a`` and ``a.b`` (b may
    be a module); relative imports are resolved. ``skip_type_checking`` leaves out
    ``if TYPE_CHECKING:`` blocks, which never run."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).parent.parts)
    skipped: set[int] = set()
    if skip_type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def _names(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_algorithm_module_imports_the_privacy_package_anywhere():
    """The algorithms call ``client.private``, which ``privacy.startup.attach_ledger`` installs:
    naming ``htfl_dist.privacy`` from below would close the cycle privacy → algorithms → privacy
    (DP-SGD walks the algorithms' batches)."""
    files = sorted(ALGORITHMS.rglob("*.py"))
    assert len(files) > 20  # the scan reads the package, blocks included
    offending = [f"{path.relative_to(REPO)}:{line}: {module}" for path in files
                 for line, module in imported_modules(path) if _names(module, "htfl_dist.privacy")]
    assert offending == []


def test_the_scan_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The scan itself finds what the test above relies on it to find."""
    source = tmp_path / "htfl_dist" / "algorithms" / "sample.py"
    source.parent.mkdir(parents=True)
    source.write_text("from htfl_dist import privacy\n\n\ndef f():\n"
                      "    from htfl_dist.privacy.dpsgd import train_privately\n"
                      "    from ..privacy import startup\n"
                      "    import htfl_dist.privacy.noise\n")
    modules = {module for _, module in imported_modules(source, tmp_path)}
    assert {"htfl_dist.privacy", "htfl_dist.privacy.dpsgd", "htfl_dist.privacy.startup",
            "htfl_dist.privacy.noise"} <= modules


def test_the_batch_primitives_are_a_leaf():
    """``algorithms/batches.py`` imports nothing of htfl_dist when it runs (its one type import is
    for annotations only), so DP-SGD walks the plain loop's batches without importing it."""
    path = ALGORITHMS / "batches.py"
    assert [module for _, module in imported_modules(path, skip_type_checking=True)
            if _names(module, "htfl_dist")] == []
    training = {module for _, module in imported_modules(ALGORITHMS / "training.py")}
    dpsgd = {module for _, module in imported_modules(REPO / "htfl_dist" / "privacy" / "dpsgd.py")}
    assert "htfl_dist.algorithms.batches" in training and "htfl_dist.algorithms.batches" in dpsgd
    assert not any(_names(module, "htfl_dist.algorithms.training") for module in dpsgd)


NO_OPACUS = """
import json, sys
sys.modules["opacus"] = None  # any import of Opacus raises ImportError, as where it is not installed
from pathlib import Path
import htfl_dist.algorithms
loaded = sorted(name for name in sys.modules if name.startswith("htfl_dist.privacy"))
assert loaded == [], loaded
from htfl_dist.errors import ConfigError
from htfl_dist.runtime.simulate import simulate
config, cache, out = sys.argv[1:4]
simulate(config, [f"data.cache_dir={cache}", "rounds=1"], out=Path(out))
assert "htfl_dist.privacy.dpsgd" not in sys.modules and "htfl_dist.privacy.trainer" not in sys.modules
try:
    simulate(config, [f"data.cache_dir={cache}", "rounds=1", "privacy.enabled=true"], out=Path(out + "-private"))
except ConfigError as error:
    print(json.dumps(str(error)))
else:
    raise AssertionError("a private run started without Opacus")
"""


@pytest.mark.launch
def test_a_run_without_privacy_needs_no_opacus(tmp_path, cache_dir, single_run):
    """Where Opacus cannot be imported: ``import htfl_dist.algorithms`` loads nothing of
    ``htfl_dist.privacy``, a plain smoke round runs (and gives the metrics it gives with Opacus
    installed), and a private one is refused at start-up with the install hint."""
    out = tmp_path / "plain"
    result = subprocess.run([sys.executable, "-c", NO_OPACUS, str(SMOKE), str(cache_dir), str(out)], cwd=REPO,
                            env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == '"privacy.enabled needs Opacus: pip install -e .[privacy]"'
    _, reference = single_run("rounds=1")
    assert maths_only(read_metrics(out)) == maths_only(reference)
