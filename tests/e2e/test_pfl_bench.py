"""bench/pfl_side_by_side.py at tiny sizes, on the sides that need no pfl: the bare PyTorch loop
and ours in one process (``python -m htfl_dist.main`` with the bench's plugin) take the same SGD
steps, and ours' FedAvg after round 1 is the bare loop's average of the same clients' trained
weights. pfl is never installed for the suite: its side must skip with the setup hint, not fail.
Under ``--lockstep`` the same two sides run at once, a round at a time, and their rounds are paired."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, _env

pytestmark = pytest.mark.launch


def test_bare_loop_and_ours_take_the_same_steps_to_the_same_average(tmp_path):
    env = _env()
    env["HTFL_PFL_VENV"] = str(tmp_path / "no-pfl-venv")  # as in CI, where bench/pfl_setup.sh never ran
    out = tmp_path / "result.json"
    # 6 clients, 3 a round, 25 samples in batches of 10: 3 steps a client (10, 10, 5), 9 a round
    command = [sys.executable, str(REPO / "bench" / "pfl_side_by_side.py"), "--sides", "pfl,bare,ours",
               "--clients", "6", "--per-round", "3", "--samples", "25", "--rounds", "1", "--warmup", "0",
               "--work", str(tmp_path / "work"), "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pfl venv not found: run bench/pfl_setup.sh" in result.stdout
    report = json.loads(out.read_text())
    sides = report["sides"]
    assert sides["pfl"] == {"skipped": "pfl venv not found: run bench/pfl_setup.sh"}
    rounds = report["workload"]["rounds_played"]
    assert rounds == 2  # 1 timed + the untimed last round
    for side in ("bare", "ours"):
        assert sides[side]["returncode"] == 0
        assert sides[side]["steps_total"] == 9 * rounds, side  # counted inside the processes
        assert len(sides[side]["round_seconds"]) == rounds, side  # a time for every round, the timed one first
        assert sides[side]["s_per_round"] > 0 and sides[side]["peak_rss_bytes"] > 0
    assert sides["bare"]["round_steps"] == [9, 9]
    check = report["check"]
    assert check["steps_equal"] and check["ok"]
    assert check["max_abs_diff"] <= 1e-5


def test_lockstep_times_every_round_of_each_side_and_pairs_them(tmp_path):
    env = _env()
    env["HTFL_PFL_VENV"] = str(tmp_path / "no-pfl-venv")
    out = tmp_path / "result.json"
    command = [sys.executable, str(REPO / "bench" / "pfl_side_by_side.py"), "--lockstep", "--sides", "pfl,bare,ours",
               "--clients", "6", "--per-round", "3", "--samples", "25", "--rounds", "2", "--warmup", "0",
               "--work", str(tmp_path / "work"), "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    sides = report["sides"]
    assert report["workload"]["lockstep"] and sides["pfl"] == {"skipped": "pfl venv not found: run bench/pfl_setup.sh"}
    for side in ("bare", "ours"):
        assert sides[side]["returncode"] == 0
        assert len(sides[side]["go_to_done_s"]) == 3 and len(sides[side]["own_round_seconds"]) == 3, side
        assert sides[side]["timed_rounds"] == sides[side]["go_to_done_s"][:2], side  # the driver's clock is timed
        assert sides[side]["steps_total"] == 9 * 3 and sides[side]["startup_s"] > 0, side
    ratio = report["paired_ratios"]["ours/bare"]
    assert len(ratio["per_round"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    assert list(report["paired_ratios"]) == ["ours/bare"]  # no pairs with the skipped side
    assert report["check"]["ok"]


@pytest.mark.parametrize("argv, said", [
    (["--per-round", "7", "--clients", "6"], "--per-round must be 1..--clients (6), not 7"),
    (["--sides", "bare,nope"], "--sides: unknown nope"),
    (["--lockstep", "--sides", "bare,ours2"],
     "--lockstep runs the sides pfl, pfl2, bare, ours, ours2h only, not ours2"),
])
def test_bad_options_are_one_line_and_status_2(tmp_path, argv, said):
    command = [sys.executable, str(REPO / "bench" / "pfl_side_by_side.py"), "--work", str(tmp_path), *argv]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith(f"pfl_side_by_side: error: {said}")
    assert len(result.stderr.strip().splitlines()) == 1
