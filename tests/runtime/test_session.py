"""One start for every driver, and the round loop as a spine that calls observers at fixed points.

A check planted in ``session.START_CHECKS`` must stop every driver (the program, ``--check``,
``simulate``, a study's validation, the conformance kit) with its line: that is what "one start"
means, tested by the property rather than by reading imports. The observer tests play real rounds
with a recording observer beside the built-in ones and compare the calls with the order
docs/architecture.md promises, worked out by hand for a 2-round run.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SMOKE, read_metrics
from htfl_dist import main, testing
from htfl_dist.errors import ConfigError
from htfl_dist.runtime import bootstrap, resumption, session
from htfl_dist.runtime.loop import Federation, start
from htfl_dist.runtime.observers import RoundObserver, default_observers
from htfl_dist.runtime.session import RunContext, Session, checked_config
from htfl_dist.runtime.simulate import simulate
from htfl_dist.runtime.transport import LocalTransport
from htfl_dist.study.plan import expand, validate

PLANTED = "planted start check: this driver ran the one start"


@pytest.fixture
def planted_check(monkeypatch):
    """A start check that refuses every config, appended to the one list."""
    def refuse(config, world_size):
        raise ConfigError(PLANTED)

    monkeypatch.setattr(session, "START_CHECKS", (*session.START_CHECKS, refuse))


def test_the_program_and_its_check_run_the_start_checks(planted_check, tmp_path, cache_dir):
    for argv in (["--check"], []):
        with pytest.raises(ConfigError, match=PLANTED):
            main.run([*argv, "--config", str(SMOKE), "--out", str(tmp_path / "run"), f"data.cache_dir={cache_dir}"])
    assert not (tmp_path / "run").exists(), "refused before the run directory was taken"


def test_simulate_and_the_kit_run_the_start_checks(planted_check, tmp_path, cache_dir):
    with pytest.raises(ConfigError, match=PLANTED):
        simulate(SMOKE, [f"data.cache_dir={cache_dir}"], out=tmp_path / "simulated")
    with pytest.raises(ConfigError, match=PLANTED):
        testing.play_one_round("fedproto", tmp_path / "kit", config_file=SMOKE,
                               overrides=[f"data.cache_dir={cache_dir}"])


@pytest.mark.integration
def test_simulate_runs_with_the_programs_deterministic_kernels(monkeypatch, tmp_path, cache_dir):
    # the in-process GPU tests compare recorded and side-by-side steps with one at a time bit for
    # bit: only the deterministic kernels a launched rank sets up make that comparison hold
    calls = []
    monkeypatch.setattr(bootstrap, "make_deterministic", lambda: calls.append("deterministic"))
    simulate(SMOKE, [f"data.cache_dir={cache_dir}", "rounds=1"], out=tmp_path / "simulated")
    assert calls == ["deterministic"]


def test_a_study_validates_its_cells_with_the_start_checks(planted_check):
    study = expand(Path(__file__).parents[2] / "studies" / "prototype_methods_fmnist.yaml")
    with pytest.raises(ConfigError, match=f"cell .*{PLANTED}"):
        validate(study)


def test_the_kit_refuses_what_the_program_refuses(tmp_path, cache_dir):
    """A private run with unseen clients is refused at the start (they would train without
    privacy); the kit's round used to build it and play on."""
    overrides = [f"data.cache_dir={cache_dir}", "privacy.enabled=true", "privacy.noise=seeded", "eval.new_clients=1"]
    with pytest.raises(ConfigError, match=r"eval\.new_clients"):
        checked_config(str(SMOKE), overrides)
    with pytest.raises(ConfigError, match=r"eval\.new_clients"):
        testing.play_one_round("fedproto", tmp_path, config_file=SMOKE, overrides=overrides)


def test_the_kit_trains_with_the_rounds_learning_rate(tmp_path, cache_dir):
    """The kit's round goes through the loop's train phase, so a learning-rate schedule applies
    (the kit used to call ``train`` directly, and a scheduled algorithm refused to train there):
    each checked client's optimiser was given round 0's rate, lr·γ⁰."""
    from htfl_dist.algorithms.optimizers import ROUND_ATTRIBUTE

    played = testing.play_one_round("fedproto", tmp_path, config_file=SMOKE, overrides=[
        f"data.cache_dir={cache_dir}", "train.lr=0.02", "train.lr_schedule=step", "train.lr_step_rounds=1",
        "train.lr_decay=0.1"])
    for client_id in testing.CHECKED_CLIENTS:
        optimizer = played.session.clients.peek(client_id).optimizer
        assert getattr(optimizer, ROUND_ATTRIBUTE) == 0
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02)


class Recorder(RoundObserver):
    """Every hook call, in order, with the round it was called in; keeps one number as state."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.state = {"rounds_seen": 0}
        self.loaded: list[dict[str, Any]] = []

    def round_started(self, outcome, knowledge) -> None:
        self.calls.append(("round_started", outcome.round_index))
        self.state["rounds_seen"] += 1

    def arrivals(self, outcome, gathered):
        self.calls.append(("arrivals", outcome.round_index))
        return gathered

    def aggregated(self, outcome, kept) -> None:
        self.calls.append(("aggregated", outcome.round_index))

    def evaluated(self, outcome, knowledge) -> dict[int, list[float]]:
        self.calls.append(("evaluated", outcome.round_index))
        return {}

    def epsilon_rows(self, client_ids: Collection[int]) -> dict[int, list[float]]:
        self.calls.append(("epsilon_rows", -1))
        return {}

    def stop_requested(self) -> bool:
        self.calls.append(("stop_requested", -1))
        return False

    def converged(self, outcome, rows) -> bool:
        self.calls.append(("converged", outcome.round_index))
        return False

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded.append(dict(state))


def _federation(out: Path, cache_dir: Path, recorder: Recorder, *overrides: str, resume: bool = False) -> Federation:
    config = checked_config(str(SMOKE), [f"data.cache_dir={cache_dir}", "rounds=2", *overrides])
    built = Session(RunContext(config, LocalTransport(), torch.device("cpu"), out, out if resume else None))
    return Federation(built, [*default_observers(built), recorder])


@pytest.mark.integration
def test_observers_are_called_at_the_spines_points_in_order(tmp_path, cache_dir):
    recorder = Recorder()
    _federation(tmp_path, cache_dir, recorder, "eval_every=2").run()
    per_round = ["round_started", "arrivals", "aggregated"]
    expected = [*[(hook, 0) for hook in per_round], ("epsilon_rows", -1), ("stop_requested", -1), ("converged", 0),
                *[(hook, 1) for hook in per_round], ("evaluated", 1), ("epsilon_rows", -1), ("stop_requested", -1),
                ("converged", 1)]
    assert recorder.calls == expected
    assert [row["round"] for row in read_metrics(tmp_path)] == [2]


@pytest.mark.integration
def test_an_observers_state_is_checkpointed_and_restored_by_name(tmp_path, cache_dir):
    first = Recorder()
    _federation(tmp_path, cache_dir, first, "checkpoint_every=1", "rounds=1").run()
    resumed = Recorder()
    federation = _federation(tmp_path, cache_dir, resumed, "checkpoint_every=1", resume=True)
    assert federation.restore() == 1
    assert resumed.loaded == [{"rounds_seen": 1}]


def test_a_checkpoint_from_before_named_observer_states_gives_the_clock_its_state():
    """Checkpoints written before observers kept their state by name hold the simulated clock's
    state at the top level: it goes to the participation observer, the others get none."""
    clock, recorder = Recorder(), Recorder()
    clock.name = "participation"
    resumption.restore_observers([clock, recorder], {"clock_s": 12.5, "held_uploads": {}})
    assert clock.loaded == [{"clock_s": 12.5, "held_uploads": {}}] and recorder.loaded == [{}]
    resumption.restore_observers([clock, recorder], {"participation": {"clock_s": 3.0}, "recorder": {"n": 1}})
    assert clock.loaded[-1] == {"clock_s": 3.0} and recorder.loaded[-1] == {"n": 1}


@pytest.mark.integration
def test_the_start_builds_the_session_the_loop_plays(tmp_path, cache_dir):
    config = checked_config(str(SMOKE), [f"data.cache_dir={cache_dir}", "rounds=1"])
    federation = start(RunContext(config, LocalTransport(), torch.device("cpu"), tmp_path))
    assert federation.session.clients is not None and federation.session.server is not None
    summary = federation.run()
    assert summary is not None and json.loads((tmp_path / "summary.json").read_text())["rounds"] == 1
