"""Bad input through a real launch: the few cases only a process shows (argparse in a fresh
interpreter, torchrun's failure summary, mpirun's world). The catalogue of every bad input, run
in-process, is tests/e2e/test_bad_inputs.py."""
from __future__ import annotations

import pytest

from conftest import SMOKE, launch, run_program


def _assert_one_line(result, *needles) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_config_key_written_as_an_option_says_how_to_write_it(tmp_path):
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path / "run"), "--rounds", "3"])
    assert result.returncode == 2
    line = _assert_one_line(result, "htfl_dist: error: unrecognized arguments: --rounds")
    assert line.endswith("write rounds=VALUE (python -m htfl_dist.main --help lists the options)"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.launch
def test_alias_bomb_config_is_refused_at_once(tmp_path):
    """Nine levels of ten aliases: before, building the error line's repr ran out of memory."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    config = tmp_path / "bomb.yaml"
    config.write_text("\n".join(lines) + "\ndata:\n  root: *a8\n")
    result = launch("single", 1, ["--config", str(config), "--out", str(tmp_path / "run")], timeout=60)
    assert result.returncode == 2
    _assert_one_line(result, "bomb.yaml", "aliases expand to more than")


@pytest.mark.launch
def test_torchrun_failure_summary_shows_our_line(tmp_path):
    """torchrun prints its own ChildFailedError summary after our line; the per-rank error file
    we write makes that summary name the reason instead of pointing at a docs page."""
    result = launch("torchrun", 2, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), "rounds=abc"],
                    timeout=120)
    assert result.returncode != 0
    root_cause = result.stderr.split("Root Cause", 1)[-1]
    assert "traceback : htfl_dist: error: config key 'rounds' must be an integer" in root_cause, result.stderr
    assert "To enable traceback see" not in result.stderr


@pytest.mark.launch
def test_more_client_ranks_than_clients(tmp_path):
    result = launch("mpirun", 4, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), "num_clients=2"],
                    timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.count("3 client ranks but there are only 2 logical clients") == 1


def test_feature_width_mismatch_is_refused():
    import torch

    from htfl_dist.errors import HtflError
    from htfl_dist.models import build_model
    from htfl_dist.runtime.startup import check_feature_width

    model = build_model("htcnn1", num_classes=10, feature_dim=256, in_channels=1, image_size=28)
    with pytest.raises(HtflError, match=r"client 3's htcnn1 gives features of shape \(256,\).*model.feature_dim=512"):
        check_feature_width(model, "htcnn1", 3, torch.zeros(2, 1, 28, 28), 512)
