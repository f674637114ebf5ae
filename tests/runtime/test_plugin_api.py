"""The declared plugin API (``htfl_dist.api``): every name it lists resolves, importing it loads no
more than the algorithms do (the conformance kit comes on first use), and the plugins written as
users write them (the example plugin, bench's pfl workload) and the plugin docs import from it
alone; the engine's own test plugins use only names it lists."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import htfl_dist.api as api
from tests.conftest import REPO

PLUGINS = [*sorted((REPO / "examples" / "htfl_example_plugin").rglob("*.py")), REPO / "bench" / "pfl_workload.py"]
DOCS = [REPO / "docs" / "plugins.md", REPO / "docs" / "adding-an-algorithm.md"]
TEST_PLUGINS = [REPO / "tests" / "plugin_fedper.py", REPO / "tests" / "fedper_parts.py"]


def _engine_imports(source: str, where: str) -> list[tuple[str, list[str]]]:
    """(module, names) for each import of htfl_dist in ``source``, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "htfl_dist"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "htfl_dist":
            found.append((node.module or "", [alias.name for alias in node.names]))
    return found


def test_every_listed_name_resolves_once():
    assert len(api.__all__) == len(set(api.__all__))
    missing = [name for name in api.__all__ if getattr(api, name, None) is None]
    assert missing == []
    assert set(api.KIT) <= set(api.__all__)


def test_an_unlisted_name_is_an_attribute_error():
    try:
        api.Federation  # noqa: B018  (the runtime is not part of the API)
    except AttributeError as exc:
        assert "Federation" in str(exc)
    else:
        raise AssertionError("htfl_dist.api.Federation resolved")


def test_importing_it_loads_neither_the_runtime_nor_the_kit():
    probe = ("import json, sys; import htfl_dist.algorithms; before = set(sys.modules); import htfl_dist.api; "
             "print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith('htfl_dist'))))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    added = json.loads(result.stdout.splitlines()[-1])
    assert [m for m in added if m.split(".")[1] in {"runtime", "testing", "privacy", "main", "study", "metrics"}] == []


def test_the_plugins_import_only_the_api():
    read = {path: _engine_imports(path.read_text(), str(path)) for path in PLUGINS}
    assert all(read[path] for path in PLUGINS if path.name != "__init__.py")  # the check reads imports
    for path, imports in read.items():
        others = [module for module, _ in imports if module != "htfl_dist.api"]
        assert others == [], f"{path.relative_to(REPO)} imports {others}"
        unlisted = [name for _, names in imports for name in names if name not in api.__all__]
        assert unlisted == [], f"{path.relative_to(REPO)} imports {unlisted}, not in htfl_dist.api.__all__"


def test_the_engine_test_plugins_use_only_listed_names():
    for path in TEST_PLUGINS:
        names = [name for _, names in _engine_imports(path.read_text(), str(path)) for name in names]
        assert names and [name for name in names if name not in api.__all__] == [], path.name


def test_the_plugin_docs_import_only_the_api():
    fence = re.compile(r"^ *```python\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
    for path in DOCS:
        lines = [line.strip() for block in fence.findall(path.read_text()) for line in block.splitlines()]
        imports = [line for line in lines if re.match(r"(from|import) htfl_dist\b", line)]
        assert imports, f"{path.name}: no import of htfl_dist in its python fences"
        assert [line for line in imports if not line.startswith("from htfl_dist.api import")] == [], path.name
