"""Plugin datasets beyond uint8 pictures (issue 46 item 3): float features with options of their
own (``data.options.*``: checked, spelled out, hashed, in the cache key) and text rows of token ids,
through the partition cache to a client's tensors and a whole run; and the refusals of arrays a
loader gets wrong."""
from __future__ import annotations

import numpy as np
import plugin_datasets
import pytest
import torch

from conftest import SMOKE
from htfl_dist.config import DataConfig
from htfl_dist.data import sources
from htfl_dist.data.cache import load_client_split
from htfl_dist.data.prepare import prepare_partition
from htfl_dist.data.sources import DatasetArrays, check_arrays, registry, spelled_out_dataset_options
from htfl_dist.errors import ConfigError, DataError
from htfl_dist.resolution import resolved_config
from htfl_dist.runtime.simulate import simulate


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    """Both plugin datasets in a scratch copy of the registry, their files under tmp_path/data."""
    monkeypatch.setattr(registry, "_DATASETS", registry._DATASETS.copy())  # undone after the test
    sources.register_dataset(plugin_datasets.FEATURES)
    sources.register_dataset(plugin_datasets.TOKENS)
    root = tmp_path / "data"
    root.mkdir()
    return root


def _data(root, tmp_path, **fields) -> DataConfig:
    return DataConfig(root=str(root), cache_dir=str(tmp_path / "cache"), partition="dirichlet", beta=1.0,
                      min_samples_per_client=5, **fields)


def test_float_features_reach_the_clients_unnormalised_with_the_option_applied(plugins, tmp_path):
    x = plugin_datasets.write_features(str(plugins))
    data = _data(plugins, tmp_path, dataset="plugin_features", options={"columns": 5})
    info = prepare_partition(data, 3, seed=0)
    assert (info.input_kind, info.input_shape, info.in_channels, info.image_size) == ("tabular", (5,), 0, 0)
    split = load_client_split(info.path, 1)
    assert split.train_x.dtype == torch.float32 and split.train_x.shape[1] == 5
    rows = {tuple(row) for row in x[:, :5].tolist()}  # each client row is a source row, as stored
    assert all(tuple(row) in rows for row in split.train_x.tolist())


def test_token_rows_become_text_with_the_vocabulary_the_ids_use(plugins, tmp_path):
    x = plugin_datasets.write_tokens(str(plugins))
    info = prepare_partition(_data(plugins, tmp_path, dataset="plugin_tokens"), 3, seed=0)
    assert (info.input_kind, info.input_shape, info.vocab_size) == ("text", (12,), int(x[:, :-1].max()) + 1)
    split = load_client_split(info.path, 0)
    assert split.train_x.dtype == torch.int64 and split.train_x.shape[1] == 13


def test_options_are_checked_spelled_out_hashed_and_keyed(plugins, tmp_path):
    assert spelled_out_dataset_options("plugin_features", {}) == {"columns": 6}
    with pytest.raises(ConfigError, match=r"^config key 'data.options.columns' must be in \[1, 64\], got 0$"):
        spelled_out_dataset_options("plugin_features", {"columns": 0})
    with pytest.raises(ConfigError, match=r"^unknown config key 'data.options.rows'"):
        spelled_out_dataset_options("plugin_features", {"rows": 3})
    with pytest.raises(ConfigError, match=r"^config key .data.options. is .* but dataset .plugin_tokens. takes no"):
        spelled_out_dataset_options("plugin_tokens", {"columns": 3})
    six = resolved_config(None, ["data.dataset=plugin_features"])
    assert six.data.options == {"columns": 6} and six.experiment()["data"]["options"] == {"columns": 6}
    assert resolved_config(None, ["data.dataset=plugin_features", "data.options.columns=6"]).config_hash() == \
        six.config_hash()  # the default written out is the same experiment
    assert resolved_config(None, ["data.dataset=plugin_features", "data.options.columns=5"]).config_hash() != \
        six.config_hash()
    assert "options" not in resolved_config(None, []).experiment()["data"]  # no options: hash as before
    plugin_datasets.write_features(str(plugins))
    five = prepare_partition(_data(plugins, tmp_path, dataset="plugin_features", options={"columns": 5}), 3, 0)
    four = prepare_partition(_data(plugins, tmp_path, dataset="plugin_features", options={"columns": 4}), 3, 0)
    assert five.path != four.path  # another option, another cache


@pytest.mark.parametrize(("x", "y", "message"), [
    (np.zeros((4, 3), np.float32), np.array([0, 1, 2, 9]), r"labels must lie in 0\.\.3"),
    (np.full((4, 3), np.nan, np.float32), np.arange(4), "NaN or Inf"),
    (np.array([[1, 2, 0], [1, 2, 2]], np.int64), np.arange(2), r"last column is its length, in 1\.\.2"),
    (np.array([[1, 99, 2], [1, 2, 2]], np.int64), np.arange(2), r"token ids must lie in 0\.\.49"),
    (np.zeros((4, 3), np.float64), np.arange(4), "samples are float64"),
    (np.zeros((4, 3), np.float32), np.arange(3), "one per sample"),
])
def test_arrays_a_loader_gets_wrong_are_refused_in_one_line(x, y, message):
    with pytest.raises(DataError, match=f"^dataset 'broken': .*{message}"):
        check_arrays(DatasetArrays(images=x, labels=y, num_classes=4, name="broken"), vocab_cap=50)


@pytest.mark.integration
def test_a_run_on_plugin_features(plugins, tmp_path, cache_dir):
    """The program end to end on the float dataset with its option: tabular models, FedProto."""
    plugin_datasets.write_features(str(plugins), samples=600)
    rows = simulate(SMOKE, ["data.dataset=plugin_features", f"data.root={plugins}", "data.options.columns=8",
                            f"data.cache_dir={cache_dir}", "data.subsample=1.0", "model.group=amazon_mlp_200",
                            "rounds=2", "num_clients=3"], out=tmp_path / "run")
    assert len(rows) == 2 and rows[-1]["test_acc"] > 0.5  # four separated blobs: far above chance (0.25)
