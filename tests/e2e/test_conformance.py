"""Conformance of every registered algorithm to the interface contracts, through the checks a
plugin runs on its own algorithm too (``htfl_dist.testing``), so a new algorithm gets this
coverage without writing it, and without an edit here:

- its registration: capability flags as the classes say, hints that name what exists;
- what it sends matches what it declares (the wire encoder refuses anything else), bounded;
- model parameters travel only for algorithms registered as sharing them (their papers do);
- server state and client modules round-trip through ``torch.load(weights_only=True)``;
- the floats a client uploads are the paper's count, and 2 rounds in one process send that
  count plus at most the wire's framing;
- a round whose uploads were all screened out keeps the knowledge;
- 2 rounds in one process equal 2 rounds on 3 ranks (torchrun over Gloo), for every algorithm
  whose registration does not say where else that is checked (``ConformanceHints``: the settings
  each algorithm's checks add to the smoke config live on its registration too).
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import REPO, SMOKE, _env
from htfl_dist import testing
from htfl_dist.algorithms import algorithm_names, get_algorithm
from htfl_dist.algorithms.registry import ConformanceHints
from htfl_dist.config import load_config

ALGORITHMS = algorithm_names()


def _hints(algorithm: str) -> ConformanceHints:
    return get_algorithm(algorithm).conformance


LAUNCHED = [algorithm for algorithm in ALGORITHMS if _hints(algorithm).launched]
"""The algorithms this file launches on 3 ranks: one per way messages travel (per-class logits;
a shared model part with a setup upload and a server-trained generator; a separate shared model
averaged on the server; guiding vectors from quiz-set gradients). The others name the one that
stands for them, or the test file of their own that launches them and checks more."""


def test_every_paper_algorithm_is_registered():
    expected = {"fedproto", "fedtgp", "local", "feddistill", "lgfedavg", "fedgh", "fedgen", "fml", "fedkd", "fedoc",
                "fedsa", "fedktl", "fedl2g", "fedmrl", "protonorm", "fedorgp", "fedpcl", "fedhkd", "fednh", "fpl",
                "fedpac", "heterofl", "fedrolex", "fedgmkd"}
    assert expected <= set(ALGORITHMS)


def test_the_checks_small_run_is_the_smoke_config():
    """A plugin has no configs/: the checks' run without a config file is the smoke config written
    as overrides, so a plugin's checks run what ours do."""
    written_out = load_config(None, [*testing.SMALL_RUN, "algorithm=fedproto", "rounds=3"])
    assert dataclasses.asdict(written_out) == dataclasses.asdict(load_config(SMOKE))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_registration(algorithm):
    """The kit's check, and in this repository: the test file named for the algorithm's launches
    launches it (by name, or as the smoke config's algorithm)."""
    testing.check_registration(algorithm)
    hints = _hints(algorithm)
    if hints.ranks_checked_in:
        path = re.match(r"tests/\S+\.py", hints.ranks_checked_in)
        assert path, f"{algorithm}: ranks_checked_in names no test file: {hints.ranks_checked_in!r}"
        text = (REPO / path.group()).read_text()
        named = algorithm in text.lower() or ("SMOKE" in text and load_config(SMOKE).algorithm == algorithm)
        assert "@pytest.mark.launch" in text and named, f"{algorithm}: {path.group()} launches no run of it"
    if hints.ranks_covered_by:
        assert _hints(hints.ranks_covered_by).launched or _hints(hints.ranks_covered_by).ranks_checked_in


@pytest.fixture(scope="module", params=ALGORITHMS)
def played(request, tmp_path_factory, cache_dir):
    """Round 1 of the algorithm driven by hand in one process (``testing.play_one_round``),
    shared by the one-round checks of that algorithm."""
    algorithm = request.param
    return testing.play_one_round(algorithm, tmp_path_factory.mktemp(algorithm), config_file=SMOKE,
                                  overrides=[f"data.cache_dir={cache_dir}"])


def test_payloads_match_and_are_bounded_by_their_declaration(played):
    testing.check_declared_payloads(played)


def test_model_parameters_travel_only_where_the_paper_shares_them(played):
    testing.check_parameters_travel_as_registered(played)


def test_state_round_trips_through_weights_only_load(played):
    testing.check_state_round_trip(played)


def test_a_sums_only_server_updates_alike_from_the_sum(played):
    testing.check_sums_reproduce_update(played)


def test_bytes_sent_are_the_papers_count_and_the_framing(played, single_run):
    """Against the session's shared one-process run of the algorithm (``single_run``): the same
    run the algorithm's own tests and the launch below compare with."""
    _, rows = single_run(*testing.run_overrides(played.algorithm))
    testing.check_bytes_against_theory(played, rows)


@pytest.mark.launch
@pytest.mark.parametrize("algorithm", LAUNCHED)
def test_two_rounds_in_one_process_equal_two_rounds_on_three_ranks(algorithm, tmp_path, cache_dir, single_run):
    _, single = single_run(*testing.run_overrides(algorithm))  # played once, shared with the algorithm's own tests
    spread = testing.launch_run(algorithm, tmp_path / "torchrun", config_file=SMOKE,
                                overrides=[f"data.cache_dir={cache_dir}"], env=_env())
    testing.check_world_size_invariance(single, spread, name=algorithm)
