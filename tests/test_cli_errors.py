"""Bad input is normal input: one line on stderr, a non-zero exit, no traceback."""
from __future__ import annotations

import pytest

from conftest import SMOKE, launch


def _single(tmp_path, *overrides):
    return launch("single", 1, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), *overrides], timeout=120)


def _assert_one_line(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("overrides,needles", [
    (["algorithm=fedfoo"], ["unknown algorithm 'fedfoo'", "fedproto", "local"]),
    (["model.group=HtFE7"], ["unknown model group 'HtFE7'", "HtCNN8"]),
    (["data.beta=0"], ["data.beta", "> 0"]),
    (["data.beta=-1"], ["data.beta"]),
    (["data.partition=pathological", "data.classes_per_client=11"], ["classes_per_client", "10"]),
    (["data.root=/nonexistent/fmnist"], ["/nonexistent/fmnist", "apt-get install dataset-fashion-mnist"]),
    (["data.partiton=dirichlet"], ["unknown config key 'data.partiton'", "did you mean 'data.partition'"]),
    (["on_bad_upload=ignore"], ["on_bad_upload", "skip, fail"]),
    (["rounds=abc"], ["'rounds'", "integer"]),
    (["algo.client_reg=foo"], ["algo.client_reg", "paper"]),
    (["data.dataset=cifar10", "data.root=/nonexistent"], ["/nonexistent"]),
])
def test_bad_config_values(tmp_path, overrides, needles):
    _assert_one_line(_single(tmp_path, *overrides), *needles)


def test_data_root_without_expected_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_one_line(_single(tmp_path, f"data.root={empty}", f"data.cache_dir={tmp_path}"),
                     str(empty), "train-images-idx3-ubyte")


def test_missing_config_file(tmp_path):
    result = launch("single", 1, ["--config", str(tmp_path / "nope.yaml")], timeout=60)
    _assert_one_line(result, "nope.yaml")


def test_more_client_ranks_than_clients(tmp_path):
    result = launch("mpirun", 4, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), "num_clients=2"],
                    timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.count("3 client ranks but there are only 2 logical clients") == 1
