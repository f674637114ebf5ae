"""Sensor, text and tabular PFLlib directories: read, cached, and trained on.

The directories are written in the exact on-disk layout of PFLlib's generators (``save_file``:
``train/<id>.npz`` and ``test/<id>.npz`` each ``np.savez_compressed(f, data={'x': ..., 'y': ...})``,
and ``config.json``), with what each generator puts in ``x``:

* generate_HAR.py: float64 ``N x 9 x 1 x 128`` (``format_data_x`` fills ``np.zeros`` windows),
  int32 labels from ``np.loadtxt(..., dtype=np.int32) - 1``;
* generate_AGNews.py: ``np.array([(ids, len(ids)), ...], dtype=object)``, the ids starting with
  the tokenizer's default index (2: ``'<cls>'`` is not among its specials) and padded with 0 to
  ``max_len`` before the length is taken, so every length is ``max_len``;
* generate_AmazonReview.py: float32 ``N x 5000`` word counts (here 50), int64 labels 0/1.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SMOKE, launch, maths_only, read_metrics
from htfl_dist.config import Config, DataConfig
from htfl_dist.data import load_client_split, prepare_partition
from htfl_dist.errors import ConfigError, DataError
from htfl_dist.main import main
from htfl_dist.models import InputSpec
from htfl_dist.runtime.startup import check_inputs

MAX_LEN = 16


def _save_file(directory: Path, clients: list[tuple[np.ndarray, np.ndarray]], num_classes: int) -> None:
    """PFLlib's save_file: three quarters of each client's samples train, the rest test."""
    (directory / "train").mkdir(parents=True)
    (directory / "test").mkdir()
    for cid, (x, y) in enumerate(clients):
        cut = int(len(y) * 0.75)
        for part, rows in (("train", slice(0, cut)), ("test", slice(cut, None))):
            with open(directory / part / f"{cid}.npz", "wb") as handle:
                np.savez_compressed(handle, data={"x": x[rows], "y": y[rows]})
    statistic = [[(int(c), int((y == c).sum())) for c in np.unique(y)] for _, y in clients]
    (directory / "config.json").write_text(json.dumps(
        {"num_clients": len(clients), "num_classes": num_classes, "Size of samples for labels in clients": statistic}))


def write_har(directory: Path, num_clients: int = 4, samples: int = 24) -> list:
    rng = np.random.default_rng(1)
    clients = [(rng.standard_normal((samples, 9, 1, 128)), rng.integers(0, 6, samples).astype(np.int32))
               for _ in range(num_clients)]
    _save_file(directory, clients, 6)
    return clients


def agnews_pairs(rng: np.random.Generator, samples: int, largest_id: int) -> np.ndarray:
    """As generate_AGNews.py: [2] + ids, padded with 0 to MAX_LEN, cut there, length = MAX_LEN."""
    text_list = []
    for _ in range(samples):
        words = rng.integers(4, largest_id + 1, int(rng.integers(2, 2 * MAX_LEN))).tolist()
        tokens = [2, *words]
        tokens.extend(0 for _ in range(MAX_LEN - len(tokens)))
        text_list.append(tokens[:MAX_LEN])
    return np.array([(text, len(text)) for text in text_list], dtype=object)


def write_agnews(directory: Path, num_clients: int = 4, samples: int = 24, largest_id: int = 57) -> list:
    rng = np.random.default_rng(2)
    clients = [(agnews_pairs(rng, samples, largest_id), rng.integers(0, 4, samples)) for _ in range(num_clients)]
    _save_file(directory, clients, 4)
    return clients


def write_amazon(directory: Path, num_clients: int = 4, samples: int = 24) -> list:
    rng = np.random.default_rng(3)
    clients = [(rng.poisson(0.3, (samples, 50)).astype(np.float32), rng.integers(0, 2, samples).astype(np.int64))
               for _ in range(num_clients)]
    _save_file(directory, clients, 2)
    return clients


def _prepare(directory: Path, tmp_path: Path, **options):
    data = DataConfig(partition="pfllib", pfllib_dir=str(directory), allow_pickle=True,
                      cache_dir=str(tmp_path / "cache"), **options)
    return prepare_partition(data, 4, 0)


# ---------------------------------------------------------------- reading


def test_sensor_directory_reads_as_nine_channel_float_windows(tmp_path):
    written = write_har(tmp_path / "HAR")
    info = _prepare(tmp_path / "HAR", tmp_path)
    assert info.inputs() == InputSpec("image", (9, 1, 128))
    assert (info.in_channels, info.image_size) == (0, 0)  # not square pictures
    split = load_client_split(info.path, 2)
    torch.testing.assert_close(split.train_x, torch.from_numpy(written[2][0][:18]).float())
    assert split.test_y.tolist() == written[2][1][18:].tolist()


def test_text_directory_reads_as_token_rows_with_lengths(tmp_path):
    written = write_agnews(tmp_path / "AGNews")
    info = _prepare(tmp_path / "AGNews", tmp_path)
    largest = max(max(max(ids) for ids in x[:, 0]) for x, _ in written)
    assert info.inputs() == InputSpec("text", (MAX_LEN,), vocab_size=largest + 1)
    split = load_client_split(info.path, 1)
    assert split.train_x.dtype == torch.int64 and split.train_x.shape == (18, MAX_LEN + 1)
    first_ids, first_length = written[1][0][0]
    assert split.train_x[0].tolist() == [*first_ids, first_length]
    assert split.train_x[:, -1].tolist() == [MAX_LEN] * 18  # lengths taken after padding
    assert split.train_x[:, 0].tolist() == [2] * 18


def test_vocab_size_widens_but_never_narrows_the_vocabulary(tmp_path):
    write_agnews(tmp_path / "AGNews", largest_id=57)
    assert _prepare(tmp_path / "AGNews", tmp_path, vocab_size=32000).inputs().vocab_size == 32000
    with pytest.raises(ConfigError, match=r"'data\.vocab_size' is 40 but the data holds token id 57; use at least 58"):
        _prepare(tmp_path / "AGNews", tmp_path, vocab_size=40)
    write_amazon(tmp_path / "Amazon")
    with pytest.raises(ConfigError, match="the data is tabular rows of 50 features, not text"):
        _prepare(tmp_path / "Amazon", tmp_path, vocab_size=100)


def test_tabular_directory_reads_as_feature_rows(tmp_path):
    written = write_amazon(tmp_path / "Amazon")
    info = _prepare(tmp_path / "Amazon", tmp_path)
    assert info.inputs() == InputSpec("tabular", (50,))
    split = load_client_split(info.path, 3)
    torch.testing.assert_close(split.test_x, torch.from_numpy(written[3][0][18:]))


def _rewrite(directory: Path, cid: int, x) -> None:
    with open(directory / "train" / f"{cid}.npz", "wb") as handle:
        np.savez_compressed(handle, data={"x": x, "y": np.zeros(len(x), dtype=np.int64)})


@pytest.mark.parametrize("case", ["long_length", "ragged", "three_dims", "text_among_windows"])
def test_malformed_directories_are_one_line_data_errors(tmp_path, case):
    directory = tmp_path / "data"
    if case == "text_among_windows":
        write_har(directory)
        _rewrite(directory, 2, agnews_pairs(np.random.default_rng(0), 4, 20))
        expected = r"2\.npz: x is text padded to 16 but the first client's is float32 9 x 1 x 128"
    else:
        write_agnews(directory)
        bad = {"long_length": np.array([([2, 5, 0], 4)], dtype=object),
               "ragged": np.array([([2, 5, 0], 3), ([2, 5], 2)], dtype=object),
               "three_dims": np.zeros((2, 3, 4), dtype=np.float32)}[case]
        _rewrite(directory, 1, bad)
        expected = {"long_length": r"sequence lengths must lie in 1\.\.3 \(the padded length\), got 4\.\.4",
                    "ragged": "padded to one length",
                    "three_dims": r"x has shape \(2, 3, 4\) \(float32\); supported: N x C x H x W"}[case]
    with pytest.raises(DataError, match=expected) as info:
        _prepare(directory, tmp_path)
    assert "\n" not in str(info.value)


def test_a_generator_algorithm_refuses_data_that_is_not_pictures():
    config = Config()
    config.algorithm, config.model.group, config.num_clients = "fedktl", "HtFE-sen-2", 4
    with pytest.raises(ConfigError, match="fedktl trains clients on images its generator makes, but the data is "
                                          "9 x 1 x 128 arrays"):
        check_inputs(config, InputSpec("image", (9, 1, 128)), uses_generator=True)
    check_inputs(config, InputSpec("image", (9, 1, 128)), uses_generator=False)


# ---------------------------------------------------------------- runs


def _command(directory: Path, group: str, out: Path, cache: Path, *extra: str) -> list[str]:
    """The command of docs/datasets.md, with the run and cache directories under the test's tmp."""
    return ["--config", str(SMOKE), "data.partition=pfllib", f"data.pfllib_dir={directory}",
            "data.allow_pickle=true", "data.subsample=1", "num_clients=4", f"model.group={group}", "rounds=1",
            "--out", str(out), f"data.cache_dir={cache}", *extra]


WRITERS = {"sensor": write_har, "text": write_agnews, "tabular": write_amazon}


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "group", "extra"), [
    ("sensor", "HtFE-sen-2", ()),
    ("sensor", "HtFE-sen-8", ()),
    ("text", "HtFE-txt-2", ()),
    ("text", "HtFE-txt-6", ("model.feature_dim=32",)),  # the transformer's heads divide K
    ("tabular", "MLPs", ()),
])
def test_each_new_group_trains_one_round(tmp_path, kind, group, extra):
    WRITERS[kind](tmp_path / kind)
    assert main(_command(tmp_path / kind, group, tmp_path / "run", tmp_path / "cache", *extra)) == 0
    rows = read_metrics(tmp_path / "run")
    assert [row["round"] for row in rows] == [1]
    assert 0.0 <= rows[0]["test_acc"] <= 1.0 and np.isfinite(rows[0]["train_loss"])


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["lgfedavg", "fedgh", "fedgen", "fml", "fedkd"])
def test_model_sharing_algorithms_build_their_shared_parts_from_the_data(tmp_path, algorithm):
    """The shared head, shared model or mentee is built for the data's inputs (token rows here),
    not for square pictures."""
    write_agnews(tmp_path / "AGNews")
    assert main(_command(tmp_path / "AGNews", "HtFE-txt-2", tmp_path / "run", tmp_path / "cache",
                         f"algorithm={algorithm}")) == 0
    assert np.isfinite(read_metrics(tmp_path / "run")[0]["train_loss"])


def test_text_into_a_cnn_group_is_one_line_exit_2(tmp_path, capsys):
    write_agnews(tmp_path / "AGNews")
    assert main(_command(tmp_path / "AGNews", "HtFE-img-8", tmp_path / "run", tmp_path / "cache")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == ("htfl_dist: error: model group 'HtFE-img-8': member cnn takes square images (C x S x S), "
                         "but the data is text (token ids padded to 16, vocabulary 58); choose a group for this "
                         "data (see docs/datasets.md)")


@pytest.mark.launch
def test_text_run_gives_the_same_metrics_on_three_ranks(tmp_path):
    write_agnews(tmp_path / "AGNews")
    runs = {}
    for launcher, ranks in (("single", 1), ("torchrun", 3)):
        out = tmp_path / launcher
        result = launch(launcher, ranks, _command(tmp_path / "AGNews", "HtFE-txt-2", out, tmp_path / "cache",
                                                  "rounds=2"))
        assert result.returncode == 0, result.stdout + result.stderr
        runs[launcher] = maths_only(read_metrics(out))
    assert len(runs["single"]) == 2
    assert runs["single"] == runs["torchrun"]


# ---------------------------------------------------------------- token ids bounded by the vocabulary


def _with_token(directory: Path, cid: int, token: int) -> None:
    """Client ``cid``'s train file as a damaged one would hold it: one id of its first row is ``token``."""
    with np.load(directory / "train" / f"{cid}.npz", allow_pickle=True) as archive:
        payload = archive["data"].item()
    ids, length = payload["x"][0]
    payload["x"][0] = ([*ids[:3], token, *ids[4:]], length)
    with open(directory / "train" / f"{cid}.npz", "wb") as handle:
        np.savez_compressed(handle, data=payload)


@pytest.mark.parametrize(("token", "options", "expected"), [
    pytest.param(10**12, {}, "token id 1000000000000 in x is outside the vocabulary of 1000000 (the most accepted "
                             "while data.vocab_size is unset)", id="beyond-the-cap"),
    pytest.param(5000, {"vocab_size": 5000}, "token id 5000 in x is outside the vocabulary of 5000 (data.vocab_size)",
                 id="beyond-data.vocab_size"),
    pytest.param(-1, {}, "token id -1 in x is outside the vocabulary of 1000000", id="negative"),
    pytest.param(10**20, {}, "text pairs must hold integer token ids", id="beyond-int64"),
])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_file(tmp_path, token, options, expected):
    """One wild id sizes every text model's embedding (ids x feature_dim floats): 10**12 asked for
    2 PB at model build. It is refused while the directory is read, naming the file, and no cache
    is left behind."""
    write_agnews(tmp_path / "AGNews")
    _with_token(tmp_path / "AGNews", 3, token)
    with pytest.raises(DataError) as info:
        _prepare(tmp_path / "AGNews", tmp_path, **options)
    assert str(info.value).startswith(f"{tmp_path / 'AGNews' / 'train' / '3.npz'}: ")
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert not list((tmp_path / "cache").glob("*.h5"))


def test_a_cache_converted_before_the_cap_is_refused_not_embedded(tmp_path, monkeypatch):
    """A cache converted by a version without the cap keeps its vocabulary; reused, it is one line."""
    import htfl_dist.data.prepare as prepare

    write_agnews(tmp_path / "AGNews", largest_id=57)
    _prepare(tmp_path / "AGNews", tmp_path)
    monkeypatch.setattr(prepare, "MAX_VOCAB_SIZE", 40)
    with pytest.raises(DataError, match=r"holds token id 57, outside the vocabulary of 40 \(the most accepted while "
                                        r"data\.vocab_size is unset\); delete it"):
        _prepare(tmp_path / "AGNews", tmp_path)
