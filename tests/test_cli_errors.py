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
    (["runtime.timeout_s=.inf"], ["runtime.timeout_s", "finite"]),
    (["train.lr=.nan"], ["train.lr", "finite"]),
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


def test_torchrun_failure_summary_shows_our_line(tmp_path):
    """torchrun prints its own ChildFailedError summary after our line; the per-rank error file
    we write makes that summary name the reason instead of pointing at a docs page."""
    result = launch("torchrun", 2, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), "rounds=abc"],
                    timeout=120)
    assert result.returncode != 0
    root_cause = result.stderr.split("Root Cause", 1)[-1]
    assert "traceback : htfl_dist: error: config key 'rounds' must be an integer" in root_cause, result.stderr
    assert "To enable traceback see" not in result.stderr


def test_more_client_ranks_than_clients(tmp_path):
    result = launch("mpirun", 4, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), "num_clients=2"],
                    timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.count("3 client ranks but there are only 2 logical clients") == 1


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 3\ndata: [unclosed\n")
    _assert_one_line(launch("single", 1, ["--config", str(bad)], timeout=60), "not valid YAML", "line")


def test_truncated_dataset_file(tmp_path):
    import shutil

    from htfl_dist.config import DEFAULT_FMNIST_ROOT

    root = tmp_path / "fmnist"
    shutil.copytree(DEFAULT_FMNIST_ROOT, root)
    victim = root / "t10k-labels-idx1-ubyte.gz"
    victim.write_bytes(victim.read_bytes()[:200])
    _assert_one_line(_single(tmp_path, f"data.root={root}", f"data.cache_dir={tmp_path / 'cache'}"),
                     "t10k-labels-idx1-ubyte")


def test_feature_width_mismatch_is_refused():
    import torch

    from htfl_dist.errors import HtflError
    from htfl_dist.models import build_model
    from htfl_dist.runtime.loop import _check_feature_width

    model = build_model("htcnn1", num_classes=10, feature_dim=256, in_channels=1, image_size=28)
    with pytest.raises(HtflError, match=r"client 3's htcnn1 gives features of shape \(256,\).*model.feature_dim=512"):
        _check_feature_width(model, "htcnn1", 3, torch.zeros(2, 1, 28, 28), 512)


@pytest.mark.parametrize("content,needles", [
    (b"", ["is empty", "algorithm: NAME"]),
    (b"# only a comment\n", ["is empty"]),
    (b"rounds: 2\n\xff\xfe: 1\n", ["not UTF-8", "0xff", "offset 10"]),
])
def test_empty_or_undecodable_config_file(tmp_path, content, needles):
    """An empty file would otherwise run the whole default experiment."""
    config = tmp_path / "c.yaml"
    config.write_bytes(content)
    _assert_one_line(launch("single", 1, ["--config", str(config), "--out", str(tmp_path / "run")], timeout=60),
                     *needles)


def test_config_key_written_as_an_option_says_how_to_write_it(tmp_path):
    result = launch("single", 1, ["--config", str(SMOKE), "--rounds", "3"], timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("write rounds=VALUE")
