"""The conformance kit (``htfl_dist.testing``) on an algorithm registered from outside the package
(tests/plugin_fedper.py, a FedPer), run as a plugin's own suite runs it: one parametrised test
over ``conformance_cases``; then broken variants of that algorithm, each refused by the check
that is there for it, and the launch command the kit builds for a plugin."""
from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest

from conftest import REPO, _env
from htfl_dist import conformance_runs, testing
from htfl_dist.algorithms import register_algorithm, registry
from htfl_dist.algorithms.registry import ConformanceHints

PLUGIN = "plugin_fedper"


def _register_broken_variants(plugin) -> None:
    """Variants of the plugin's algorithm that break one contract each."""

    class Miscounts(plugin.FedPerClient):
        def theory_upload_floats(self, client):
            return super().theory_upload_floats(client) + 1

    class Unbounded(plugin.FedPerClient):
        @classmethod
        def upload_fields(cls, context):
            return tuple(dataclasses.replace(field, max_rows=None) for field in super().upload_fields(context))

    class Forgetful(plugin.FedPerServer):
        def load_state_dict(self, state):
            pass

    def register(name, client=plugin.FedPerClient, server=plugin.FedPerServer, shares_parameters=True,
                 hints=None):
        register_algorithm(name, server=server, client=client, options=plugin.FedPerOptions, summary="broken",
                           shares_parameters=shares_parameters,
                           conformance=hints or ConformanceHints(overrides=("model.group=cnn",)))

    register("miscounts", client=Miscounts)
    register("unbounded", client=Unbounded)
    register("undeclared_sharing", shares_parameters=False)
    register("forgetful", server=Forgetful)
    register("covered_by_itself", hints=ConformanceHints(ranks_covered_by="covered_by_itself"))
    register("covered_by_a_cover", hints=ConformanceHints(ranks_covered_by="covered_by_itself"))
    register("covered_by_nothing", hints=ConformanceHints(ranks_covered_by="nothing"))
    register("bad_override", hints=ConformanceHints(overrides=("model.groop=cnn",)))


@pytest.fixture(scope="module")
def plugin():
    """plugin_fedper imported into a scratch copy of the registry (the real one never holds it),
    with its broken variants beside it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())
        sys.modules.pop(PLUGIN, None)
        module = importlib.import_module(PLUGIN)
        _register_broken_variants(module)
        yield module
        sys.modules.pop(PLUGIN, None)


@pytest.mark.parametrize("case", testing.conformance_cases([PLUGIN], launch=False,
                                                          run_marks=[pytest.mark.integration]))
def test_a_plugins_algorithm_passes_the_kit(case, plugin, tmp_path, cache_dir):
    case(tmp_path, overrides=[f"data.cache_dir={cache_dir}"])


def test_the_plugins_flag_is_derived_and_its_hints_kept(plugin):
    entry = registry.get_algorithm(PLUGIN)
    assert entry.evaluation_installs_knowledge is True  # the block installs the download; the plugin never said so
    assert entry.batched_clients is False
    assert entry.conformance == ConformanceHints(overrides=("model.group=cnn",))
    cases = testing.conformance_cases([PLUGIN], launch_marks=[pytest.mark.launch], run_marks=[pytest.mark.integration])
    assert [param.id for param in cases] == [f"{PLUGIN}-{check}" for check in testing.CHECKS]
    assert {param.id: [mark.name for mark in param.marks] for param in cases if param.marks} == {
        f"{PLUGIN}-bytes_against_theory": ["integration"], f"{PLUGIN}-three_ranks": ["integration", "launch"]}
    covered = testing.conformance_cases(["lgfedavg"])  # its launch is FedGen's
    assert [param.id for param in covered] == [f"lgfedavg-{check}" for check in testing.CHECKS[:-1]]


@pytest.mark.parametrize(("algorithm", "check", "message"), [
    ("miscounts", lambda played: testing.check_bytes_against_theory(played, []),
     r"^miscounts: client 0 uploads \d+ bytes of floats; the paper's count \(theory_upload_floats\) is \d+ bytes$"),
    ("unbounded", testing.check_declared_payloads, r"^unbounded: upload fields without max_rows: \['feature_"),
    ("undeclared_sharing", testing.check_parameters_travel_as_registered,
     "^undeclared_sharing sends more than class knowledge"),
    ("forgetful", testing.check_state_round_trip, "^forgetful: a server loaded from the state sends another download"),
], ids=["bytes", "payloads", "parameters", "state"])
def test_each_check_refuses_the_variant_it_is_for(plugin, algorithm, check, message, tmp_path, cache_dir):
    played = testing.play_one_round(algorithm, tmp_path, overrides=[f"data.cache_dir={cache_dir}"])
    with pytest.raises(testing.ConformanceError, match=message):
        check(played)


def test_the_bytes_check_refuses_rows_off_the_theory(plugin, tmp_path, cache_dir):
    played = testing.play_one_round(PLUGIN, tmp_path, overrides=[f"data.cache_dir={cache_dir}"])
    theory = 4 * sum(played.theory_floats.values())
    framing = played.session.config.num_clients * testing.framing_bytes(played.session.upload_spec)
    testing.check_bytes_against_theory(played, [{"round": 1, "bytes_up": theory + framing, "bytes_theory_up": theory}])
    for measured in (theory - 1, theory + framing + 1):
        with pytest.raises(testing.ConformanceError, match=f"round 1 sent {measured} bytes"):
            testing.check_bytes_against_theory(played, [{"round": 1, "bytes_up": measured, "bytes_theory_up": theory}])


@pytest.mark.parametrize(("algorithm", "message"), [
    ("covered_by_itself", "^covered_by_itself: ranks_covered_by names the algorithm itself$"),
    ("covered_by_a_cover", "^covered_by_a_cover: ranks_covered_by='covered_by_itself', whose own launch is covered by "
                           "'covered_by_itself': name that one$"),
    ("covered_by_nothing", "^covered_by_nothing: ranks_covered_by='nothing' names no registered algorithm$"),
    ("bad_override", r"^bad_override: the checks' run with its conformance overrides \['model\.groop=cnn'\] does not "
                     r"load: .*model\.groop"),
])
def test_the_registration_check_refuses_hints_that_name_nothing(plugin, algorithm, message):
    with pytest.raises(testing.ConformanceError, match=message):
        testing.check_registration(algorithm)


def test_one_process_and_three_ranks_must_agree_but_for_times_and_headers():
    single = [{"round": 1, "test_acc": 0.5, "seconds": 1.0, "bytes_up": 100, "bytes_down": 50, "bytes_theory_up": 80}]
    spread = [{"round": 1, "test_acc": 0.5, "seconds": 9.0, "bytes_up": 116, "bytes_down": 70, "bytes_theory_up": 80}]
    testing.check_world_size_invariance(single, spread, name="x")
    with pytest.raises(testing.ConformanceError, match=r"^x: round 1: test_acc is 0\.5 in one process, 0\.25 on 3"):
        testing.check_world_size_invariance(single, [{**spread[0], "test_acc": 0.25}], name="x")
    with pytest.raises(testing.ConformanceError, match="bytes_up is 100 in one process and 117 on 3 ranks"):
        testing.check_world_size_invariance(single, [{**spread[0], "bytes_up": 117}], name="x")
    with pytest.raises(testing.ConformanceError, match=r"^x: 1 rows in one process, 2 on 3 ranks$"):
        testing.check_world_size_invariance(single, spread * 2, name="x")


def test_the_launch_imports_the_plugin_on_every_rank(plugin, monkeypatch, tmp_path):
    """The command ``launch_run`` starts, without starting it."""
    seen = {}

    def fake_run(command, **kwargs):
        seen.update(command=command, env=kwargs["env"])
        return subprocess.CompletedProcess(command, 2, "", "stopped here")

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(conformance_runs.subprocess, "run", fake_run)
    with pytest.raises(testing.ConformanceError, match=f"^{PLUGIN} on 3 torchrun ranks exited with 2:\nstopped here$"):
        testing.launch_run(PLUGIN, tmp_path / "out", imports=[PLUGIN])
    command, env = seen["command"], seen["env"]
    assert command[1:5] == ["--standalone", "--nproc_per_node=3", "-m", "htfl_dist.main"]
    assert command[5:9] == ["--out", str(tmp_path / "out"), "--import", PLUGIN]
    assert command[9:] == [*testing.SMALL_RUN, f"algorithm={PLUGIN}", "rounds=2",
                           "model.group=cnn", "runtime.backend=gloo", "runtime.device=cpu"]
    assert env["OMP_NUM_THREADS"] == "1" and "RANK" not in env
    assert str(REPO / "tests") in env["PYTHONPATH"].split(os.pathsep)  # where this process found the plugin


@pytest.mark.launch
def test_a_plugins_algorithm_on_three_ranks_equals_one_process(plugin, tmp_path, cache_dir):
    """The kit's one launching case, on the plugin: its ranks import it with --import."""
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    testing.ConformanceCase(PLUGIN, "three_ranks")(tmp_path, overrides=[f"data.cache_dir={cache_dir}"],
                                                   imports=[PLUGIN], env=env)
