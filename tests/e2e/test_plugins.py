"""Plugins from outside the package, as a user brings them: the example package in
examples/htfl_example_plugin (an algorithm, an architecture, a model group and a dataset) named by
``--import``, by the config's ``plugins`` key and by its installed entry point, on one process,
three torchrun ranks and a two-cell study; and every way a plugin can be wrong, one line each.

The plugins run in launched processes only: importing one into the test process would leave its
names in the registries that the registry-wide tests read."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import BIN, REPO, _env, launch, maths_only, read_metrics

EXAMPLE = REPO / "examples" / "htfl_example_plugin"
CONFIG = EXAMPLE / "example.yaml"
pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """The example dataset's file, drawn by the plugin in a process of its own."""
    root = tmp_path_factory.mktemp("shapes")
    subprocess.run([sys.executable, "-c", f"import htfl_example_plugin as p; p.write_shapes4({str(root)!r}, 600)"],
                   env=_env((str(EXAMPLE),)), check=True, timeout=120)
    return root


def _data(shapes, tmp_path) -> list[str]:
    return [f"data.root={shapes}", f"data.cache_dir={tmp_path / 'cache'}"]


def test_a_plugin_runs_on_one_process_and_three_torchrun_ranks_alike(shapes, tmp_path):
    """``--import`` on three ranks and the ``plugins`` key on one process: the plugin's algorithm,
    model group and dataset resolve on every rank, the metrics are equal, summary.json names it."""
    single = launch("single", 1, ["--config", str(CONFIG), "--out", str(tmp_path / "one"), *_data(shapes, tmp_path),
                                  "rounds=2", "plugins=[htfl_example_plugin]"], pythonpath=(str(EXAMPLE),))
    assert single.returncode == 0, single.stderr
    ranks = launch("torchrun", 3, ["--config", str(CONFIG), "--out", str(tmp_path / "three"), "--import",
                                   "htfl_example_plugin", *_data(shapes, tmp_path), "rounds=2"],
                   pythonpath=(str(EXAMPLE),), timeout=600)
    assert ranks.returncode == 0, ranks.stderr
    one, three = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "three")
    assert len(one) == 2 and maths_only(one) == maths_only(three)
    assert one[-1]["test_acc"] > 0.5  # four shapes are learnt in two rounds
    summary = json.loads((tmp_path / "three" / "summary.json").read_text())
    assert summary["versions"]["plugins"] == {"htfl_example_plugin": "not installed as a package"}


def test_a_study_passes_its_import_to_its_cells(shapes, tmp_path):
    command = [sys.executable, "-m", "htfl_dist.study", str(EXAMPLE / "study.yaml"), "--out", str(tmp_path / "study"),
               "--import", "htfl_example_plugin", "--jobs", "2", "--set", *_data(shapes, tmp_path), "rounds=1"]
    result = subprocess.run(command, cwd=REPO, env=_env((str(EXAMPLE),)), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "study" / "table.md").read_text()
    assert "| sample_weighted | 1 |" in table and "| uniform | 1 |" in table


def test_an_installed_plugin_registers_itself_by_its_entry_point(shapes, tmp_path):
    """pip-installed (into a directory of its own, so this venv stays as it was), the package is
    found through the htfl_dist.plugins entry-point group: no --import, no plugins key."""
    site, source = tmp_path / "site", tmp_path / "source"  # built from a copy: setuptools writes beside it
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    install = subprocess.run([str(BIN / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(source)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    result = launch("single", 1, ["--config", str(CONFIG), "--out", str(tmp_path / "run"), *_data(shapes, tmp_path),
                                  "rounds=1"], pythonpath=(str(site),))
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["versions"]["plugins"] == {"htfl_example_plugin": "0.1.0"}


BROKEN = {
    "missing": None,
    "raises": "raise RuntimeError('the plugin needs a licence file')\n",
    "clashes": "from htfl_dist.algorithms import register_algorithm, get_algorithm\n"
               "entry = get_algorithm('fedproto')\n"
               "register_algorithm('fedproto', server=entry.server, client=entry.client, options=entry.options,\n"
               "                   summary='a second fedproto')\n",
}


@pytest.mark.parametrize("kind, message", [
    ("missing", "plugin no_such_plugin (--import or plugins) cannot be imported: no module named 'no_such_plugin'"),
    ("raises", "plugin raises_plugin (--import or plugins) failed to import: RuntimeError: the plugin needs a licence"),
    ("clashes", "plugin clashes_plugin (--import or plugins) failed to import: ValueError: algorithm 'fedproto'"),
])
def test_a_broken_plugin_is_one_line_naming_it(tmp_path, kind, message):
    module = "no_such_plugin" if kind == "missing" else f"{kind}_plugin"
    if BROKEN[kind] is not None:
        (tmp_path / f"{module}.py").write_text(BROKEN[kind])
    result = launch("single", 1, ["--out", str(tmp_path / "run"), "--import", module, "rounds=1"],
                    pythonpath=(str(tmp_path),))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_an_unregistered_name_says_how_a_plugin_adds_one(tmp_path):
    for key in ("algorithm=example_fedper", "data.dataset=shapes4", "model.group=example_tiny"):
        result = launch("single", 1, ["--out", str(tmp_path / "run"), key, "rounds=1"])
        assert result.returncode == 2 and "--import MODULE" in result.stderr, (key, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    with_plugin = launch("single", 1, ["--out", str(tmp_path / "run"), "--import", "htfl_example_plugin",
                                       "algorithm=example_fedpar", "rounds=1"], pythonpath=(str(EXAMPLE),))
    assert with_plugin.returncode == 2  # a plugin that registered other names: which plugins were loaded
    assert with_plugin.stderr.strip().endswith("; plugins loaded: htfl_example_plugin"), with_plugin.stderr


MIXED_CASE = ("from fedper_parts import FedPerClient, FedPerOptions, FedPerServer\n"
              "from htfl_dist.algorithms import register_algorithm\n"
              "register_algorithm('MyFedPer', server=FedPerServer, client=FedPerClient, options=FedPerOptions,\n"
              "                   summary='FedPer under a mixed-case name', shares_parameters=True)\n")


def test_a_mixed_case_name_starts_under_either_spelling_and_clashes_under_any(tmp_path):
    """Issue 46: an algorithm registered as "MyFedPer" was listed and refused under both
    spellings. Now a start finds it under either; a second plugin registering "myfedper" is one
    line naming both plugins; an unknown name lists it as registered."""
    (tmp_path / "mixed_case_plugin.py").write_text(MIXED_CASE)
    (tmp_path / "second_plugin.py").write_text("import mixed_case_plugin\n" + MIXED_CASE.replace("'MyFedPer'",
                                                                                               "'myfedper'"))
    path = (str(tmp_path), str(REPO / "tests"))  # fedper_parts: the FedPer a plugin writes
    for spelling in ("MyFedPer", "myfedper"):
        result = launch("single", 1, ["--check", "--out", str(tmp_path / spelling), "--import", "mixed_case_plugin",
                                      f"algorithm={spelling}", "model.group=cnn", "rounds=1"], pythonpath=path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"check: {spelling}, "), result.stdout
    clash = launch("single", 1, ["--check", "--out", str(tmp_path / "clash"), "--import", "second_plugin"],
                   pythonpath=path)
    assert clash.returncode == 2 and len(clash.stderr.strip().splitlines()) == 1, clash.stderr
    assert ("ValueError: algorithm 'myfedper' is already registered (as 'MyFedPer') by mixed_case_plugin, line 3; "
            "second_plugin, line 4 registers it again") in clash.stderr, clash.stderr
    unknown = launch("single", 1, ["--check", "--out", str(tmp_path / "unknown"), "--import", "mixed_case_plugin",
                                   "algorithm=MyFedPar"], pythonpath=path)
    assert unknown.returncode == 2 and "registered: feddistill, " in unknown.stderr, unknown.stderr
    assert ", MyFedPer, " in unknown.stderr and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
