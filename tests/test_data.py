"""Data layer: sources, partitioners, splits, the HDF5 cache and the PFLlib reader.

Uses the real Fashion-MNIST from the OS package (``dataset-fashion-mnist``) with
``data.subsample`` to stay fast; PFLlib directories and broken IDX files are synthesised in
``tmp_path``.
"""
from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import time

import h5py
import numpy as np
import pytest
import torch

from htfl_dist.config import DEFAULT_FMNIST_ROOT, DataConfig
from htfl_dist.data import (
    ClientSplit,
    DatasetArrays,
    PartitionInfo,
    load_client_split,
    load_dataset,
    partition_dirichlet,
    partition_pathological,
    prepare_partition,
    read_partition_info,
    split_train_test,
    subsample_indices,
    train_count,
)
from htfl_dist.errors import ConfigError, DataError
from htfl_dist.seeding import numpy_rng

HAVE_FMNIST = os.path.isdir(DEFAULT_FMNIST_ROOT)
needs_fmnist = pytest.mark.skipif(
    not HAVE_FMNIST, reason="apt-get install dataset-fashion-mnist to run this test"
)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.fixture(scope="module")
def fmnist() -> DatasetArrays:
    if not HAVE_FMNIST:
        pytest.skip("apt-get install dataset-fashion-mnist to run this test")
    return load_dataset("fmnist", None)


def _synthetic_labels(per_class: int, num_classes: int) -> np.ndarray:
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(123).permutation(labels).astype(np.int64)


# --------------------------------------------------------------------------- sources


def test_fmnist_loads_train_and_test(fmnist):
    assert fmnist.name == "fmnist" and fmnist.num_classes == 10
    assert fmnist.images.shape == (70000, 1, 28, 28) and fmnist.images.dtype == np.uint8
    assert fmnist.labels.shape == (70000,) and fmnist.labels.dtype == np.int64
    assert np.array_equal(np.bincount(fmnist.labels), np.full(10, 7000))
    assert fmnist.images.max() == 255 and fmnist.images.min() == 0


def _write_idx(path, array: np.ndarray, gz: bool, magic: int | None = None) -> None:
    ndim = array.ndim
    header = (magic if magic is not None else (0x08 << 8) | ndim).to_bytes(4, "big")
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if gz:
        raw = gzip.compress(raw)
        path = str(path) + ".gz"
    with open(path, "wb") as handle:
        handle.write(raw)


def _fake_fmnist(root, gz: bool, n_train=12, n_test=5):
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(os.path.join(root, f"{prefix}-images-idx3-ubyte"),
                   rng.integers(0, 256, (n, 28, 28)), gz)
        _write_idx(os.path.join(root, f"{prefix}-labels-idx1-ubyte"),
                   rng.integers(0, 10, n), gz)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_reader_plain_and_gzip(tmp_path, gz):
    _fake_fmnist(tmp_path, gz)
    data = load_dataset("fmnist", str(tmp_path))
    assert data.images.shape == (17, 1, 28, 28) and data.labels.shape == (17,)


def test_idx_reader_rejects_bad_magic_and_truncation(tmp_path):
    _fake_fmnist(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(good[:-7])  # truncated body
    with pytest.raises(DataError, match="truncated") as exc:
        load_dataset("fmnist", str(tmp_path))
    _one_line(exc)
    images.write_bytes(b"\x00\x00\x08\x01" + good[4:])  # wrong ndim in the magic
    with pytest.raises(DataError, match="magic number"):
        load_dataset("fmnist", str(tmp_path))
    # A truncated gzip stream.
    images.unlink()
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(good)[:-20])
    with pytest.raises(DataError, match="corrupt or truncated") as exc:
        load_dataset("fmnist", str(tmp_path))
    _one_line(exc)


def test_missing_fmnist_root_message(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as exc:
        load_dataset("fmnist", str(missing))
    text = _one_line(exc)
    assert f"Fashion-MNIST not found at {missing}" in text
    assert "apt-get install dataset-fashion-mnist" in text and "data.root=DIR" in text


def test_fmnist_root_without_files_names_them(tmp_path):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    with pytest.raises(DataError) as exc:
        load_dataset("fmnist", str(tmp_path))
    text = _one_line(exc)
    assert "train-labels-idx1-ubyte" in text and "t10k-images-idx3-ubyte" in text
    assert "train-images-idx3-ubyte(" not in text  # present, so not named as missing


def test_cifar_needs_a_local_root(tmp_path):
    with pytest.raises(DataError, match="needs data.root=DIR") as exc:
        load_dataset("cifar10", None)
    _one_line(exc)
    with pytest.raises(DataError, match="cifar-100-python") as exc:
        load_dataset("cifar100", str(tmp_path))
    _one_line(exc)
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with pytest.raises(DataError, match="lacks data_batch_2") as exc:
        load_dataset("cifar10", str(tmp_path))
    _one_line(exc)


def test_unknown_dataset_is_config_error():
    with pytest.raises(ConfigError):
        load_dataset("mnist-ish", None)


# --------------------------------------------------------------------------- pathological


@pytest.mark.parametrize("num_clients,k", [(20, 2), (7, 3), (3, 10), (4, 1)])
def test_pathological_exact_classes_non_redundant(num_clients, k):
    labels = _synthetic_labels(300, 10)
    parts = partition_pathological(labels, num_clients, k, 10, np.random.default_rng(1))
    assert len(parts) == num_clients
    used_classes = set()
    for i, part in enumerate(parts):
        classes = set(np.unique(labels[part]).tolist())
        assert classes == {(i * k + j) % 10 for j in range(k)}
        used_classes |= classes
    everything = np.concatenate(parts)
    assert everything.size == np.unique(everything).size  # no sample to two clients
    covered = np.flatnonzero(np.isin(labels, sorted(used_classes)))
    assert np.array_equal(np.sort(everything), covered)  # all samples of used classes


def test_pathological_is_unbalanced_and_classes_even():
    labels = _synthetic_labels(500, 10)
    parts = partition_pathological(labels, 20, 2, 10, np.random.default_rng(2))
    sizes = np.array([p.size for p in parts])
    assert sizes.min() >= 2 and len(set(sizes.tolist())) > 10
    per_class_holders = np.zeros(10, int)
    for p in parts:
        per_class_holders[np.unique(labels[p])] += 1
    assert per_class_holders.max() - per_class_holders.min() <= 1
    # The floor share: each holder of a class gets >= n // (10 m) of it.
    for p in parts:
        assert np.bincount(labels[p], minlength=10).max() >= 500 // (10 * 4)


def test_pathological_rejects_too_many_classes():
    with pytest.raises(ConfigError, match="classes_per_client") as exc:
        partition_pathological(_synthetic_labels(10, 10), 5, 11, 10, np.random.default_rng(0))
    _one_line(exc)


def test_pathological_class_smaller_than_its_holders():
    labels = _synthetic_labels(3, 10)
    with pytest.raises(DataError, match="class 0 has 3 samples"):
        partition_pathological(labels, 50, 2, 10, np.random.default_rng(0))


# --------------------------------------------------------------------------- dirichlet


def test_dirichlet_deterministic_by_seed_and_covers_all():
    labels = _synthetic_labels(200, 10)
    a = partition_dirichlet(labels, 20, 0.1, 10, numpy_rng(0, "partition"))
    b = partition_dirichlet(labels, 20, 0.1, 10, numpy_rng(0, "partition"))
    c = partition_dirichlet(labels, 20, 0.1, 10, numpy_rng(1, "partition"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(x.size != y.size or not np.array_equal(x, y) for x, y in zip(a, c))
    everything = np.concatenate(a)
    assert np.array_equal(np.sort(everything), np.arange(labels.size))  # each sample once


@pytest.mark.parametrize("beta,min_samples", [(0.1, 10), (0.05, 25), (1.0, 50)])
def test_dirichlet_min_size(beta, min_samples):
    labels = _synthetic_labels(200, 10)
    parts = partition_dirichlet(labels, 20, beta, 10, np.random.default_rng(5),
                                min_samples=min_samples)
    assert min(p.size for p in parts) >= min_samples


def test_dirichlet_small_beta_is_non_iid():
    labels = _synthetic_labels(500, 10)
    parts = partition_dirichlet(labels, 10, 0.1, 10, np.random.default_rng(3))
    dominant = [np.bincount(labels[p], minlength=10).max() / p.size for p in parts]
    assert np.mean(dominant) > 0.4


def test_dirichlet_impossible_request_fails_fast():
    labels = _synthetic_labels(20, 10)  # 200 samples
    start = time.perf_counter()
    with pytest.raises(DataError) as exc:
        partition_dirichlet(labels, 500, 0.1, 10, np.random.default_rng(0))
    assert time.perf_counter() - start < 1.0
    text = _one_line(exc)
    assert "Dirichlet partition (beta=0.1) cannot give 500 clients at least 10 samples" in text
    assert "lower num_clients or data.min_samples_per_client" in text


def test_dirichlet_gives_up_after_max_tries():
    labels = _synthetic_labels(50, 10)  # 500 samples, 50 clients x 10 is barely feasible
    start = time.perf_counter()
    with pytest.raises(DataError) as exc:
        partition_dirichlet(labels, 50, 0.01, 10, np.random.default_rng(0))
    assert time.perf_counter() - start < 5.0
    assert _one_line(exc) == (
        "Dirichlet partition (beta=0.01) left a client with fewer than 10 samples after 1000 "
        "tries; raise data.beta, lower num_clients or data.min_samples_per_client"
    )
    with pytest.raises(DataError, match="after 7 tries"):
        partition_dirichlet(labels, 50, 0.01, 10, np.random.default_rng(0), max_tries=7)


@pytest.mark.parametrize("beta", [0.0, -1.0])
def test_dirichlet_rejects_non_positive_beta(beta):
    with pytest.raises(ConfigError, match="data.beta"):
        partition_dirichlet(_synthetic_labels(10, 10), 2, beta, 10, np.random.default_rng(0))


# --------------------------------------------------------------------------- split, subsample


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 10, 99, 100, 1001])
def test_split_sizes(n):
    indices = np.arange(1000, 1000 + n)
    train, test = split_train_test(indices, 0.75, np.random.default_rng(n))
    # Documented rounding: train = floor(0.75 n), clamped to [1, n-1] when n >= 2.
    expected = {0: 0, 1: 1, 2: 1, 3: 2, 4: 3, 5: 3, 7: 5, 10: 7, 99: 74, 100: 75, 1001: 750}[n]
    assert train.size == expected == train_count(n, 0.75)
    assert test.size == n - expected
    assert np.array_equal(np.sort(np.concatenate([train, test])), indices)


def test_split_shuffles():
    train, _ = split_train_test(np.arange(1000), 0.75, np.random.default_rng(0))
    assert not np.array_equal(train, np.arange(750))


def test_subsample_is_stratified():
    labels = np.repeat(np.arange(4), [100, 200, 40, 7])
    picked = subsample_indices(labels, 0.1, np.random.default_rng(0))
    assert np.array_equal(np.bincount(labels[picked], minlength=4), [10, 20, 4, 1])
    assert picked.size == np.unique(picked).size
    assert np.array_equal(subsample_indices(labels, 1.0, np.random.default_rng(0)),
                          np.arange(labels.size))


# --------------------------------------------------------------------------- cache


def _cfg(tmp_path, **overrides) -> DataConfig:
    base = dict(cache_dir=str(tmp_path / "cache"), subsample=0.05)
    base.update(overrides)
    return DataConfig(**base)


def _read_all(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visit(lambda name: out.__setitem__(name, f[name][()]) if isinstance(f[name], h5py.Dataset) else None)
        attrs = dict(f.attrs)
    return out, attrs


@needs_fmnist
def test_prepare_partition_builds_once_and_is_deterministic(tmp_path):
    cfg = _cfg(tmp_path)
    info = prepare_partition(cfg, 10, seed=3)
    assert isinstance(info, PartitionInfo)
    name = os.path.basename(info.path)
    assert name.startswith("fmnist-dirichlet-") and name.endswith(".h5")
    assert (info.num_classes, info.in_channels, info.image_size, info.num_clients) == (10, 1, 28, 10)
    assert info.class_counts.shape == (10, 10)
    first_stat = os.stat(info.path)
    contents, attrs = _read_all(info.path)

    again = prepare_partition(cfg, 10, seed=3)  # reused, not rewritten
    assert again.path == info.path
    assert os.stat(info.path).st_ino == first_stat.st_ino
    assert os.stat(info.path).st_mtime_ns == first_stat.st_mtime_ns

    os.remove(info.path)  # rebuilt from scratch: same content
    rebuilt = prepare_partition(cfg, 10, seed=3)
    assert rebuilt.path == info.path
    contents2, attrs2 = _read_all(rebuilt.path)
    assert contents.keys() == contents2.keys()
    assert all(np.array_equal(contents[k], contents2[k]) for k in contents)
    assert attrs == attrs2
    assert attrs["dataset"] == "fmnist" and attrs["num_clients"] == 10
    assert sorted(os.listdir(tmp_path / "cache")) == [name]  # no temp files left

    # 5 % of 70000, stratified, split 75/25 per client; every client meets the minimum.
    total = sum(contents[f"client_{c}/train_y"].size + contents[f"client_{c}/test_y"].size
                for c in range(10))
    assert total == 3500
    for c in range(10):
        n_train = contents[f"client_{c}/train_y"].size
        n_test = contents[f"client_{c}/test_y"].size
        assert n_train + n_test >= 10 and n_train == train_count(n_train + n_test, 0.75)
        assert np.array_equal(np.bincount(contents[f"client_{c}/train_y"], minlength=10),
                              info.class_counts[c])
    assert np.array_equal(read_partition_info(info.path).class_counts, info.class_counts)


@needs_fmnist
def test_cache_key_covers_split_inputs(tmp_path):
    base = prepare_partition(_cfg(tmp_path), 6, seed=0).path
    assert prepare_partition(_cfg(tmp_path), 6, seed=1).path != base
    assert prepare_partition(_cfg(tmp_path), 5, seed=0).path != base
    assert prepare_partition(_cfg(tmp_path, beta=0.5), 6, seed=0).path != base
    assert prepare_partition(_cfg(tmp_path, train_ratio=0.8), 6, seed=0).path != base
    assert prepare_partition(_cfg(tmp_path, subsample=0.04), 6, seed=0).path != base
    # A knob that does not change the split does not change the file.
    assert prepare_partition(_cfg(tmp_path, classes_per_client=3), 6, seed=0).path == base


@needs_fmnist
def test_pathological_cache_and_client_split(tmp_path):
    cfg = _cfg(tmp_path, partition="pathological", classes_per_client=2)
    info = prepare_partition(cfg, 8, seed=0)
    assert os.path.basename(info.path).startswith("fmnist-pathological-")
    assert ((info.class_counts > 0).sum(axis=1) == 2).all()
    split = load_client_split(info.path, 5)
    assert isinstance(split, ClientSplit) and split.client_id == 5
    assert split.train_x.dtype == torch.float32 and split.test_x.dtype == torch.float32
    assert split.train_y.dtype == torch.int64 and split.test_y.dtype == torch.int64
    assert split.train_x.shape[1:] == (1, 28, 28) and split.test_x.shape[1:] == (1, 28, 28)
    assert split.train_x.shape[0] == split.train_y.shape[0] == info.class_counts[5].sum()
    assert split.train_x.min() >= -1.0 and split.train_x.max() <= 1.0
    assert split.train_x.min() < -0.99 and split.train_x.max() > 0.5
    assert set(torch.unique(split.train_y).tolist()) == {(5 * 2) % 10, (5 * 2 + 1) % 10}
    # Normalisation as PFLlib: x / 255, then (x - 0.5) / 0.5.
    with h5py.File(info.path, "r") as f:
        raw = f["client_5/train_x"][()]
    assert raw.dtype == np.uint8
    expected = (torch.from_numpy(raw).float() / 255.0 - 0.5) / 0.5
    assert torch.equal(split.train_x, expected)
    with pytest.raises(DataError, match="not 8"):
        load_client_split(info.path, 8)


@needs_fmnist
def test_pathological_too_many_classes_via_prepare(tmp_path):
    with pytest.raises(ConfigError, match="only 10 classes"):
        prepare_partition(_cfg(tmp_path, partition="pathological", classes_per_client=11), 4, 0)


def _build_in_child(cfg, queue):
    try:
        queue.put(prepare_partition(cfg, 4, seed=9).path)
    except BaseException as exc:  # pragma: no cover - reported by the parent
        queue.put(repr(exc))


@needs_fmnist
def test_concurrent_builders_and_corrupt_cache(tmp_path):
    cfg = _cfg(tmp_path, subsample=0.02)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=_build_in_child, args=(cfg, queue)) for _ in range(3)]
    for child in children:
        child.start()
    results = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert len(set(results)) == 1 and results[0].endswith(".h5"), results
    path = results[0]
    assert os.listdir(tmp_path / "cache") == [os.path.basename(path)]
    assert prepare_partition(cfg, 4, seed=9).path == path
    reference, _ = _read_all(path)
    with open(path, "wb") as handle:  # damaged by hand: rebuilt, not trusted
        handle.write(b"not hdf5")
    assert prepare_partition(cfg, 4, seed=9).path == path
    rebuilt, _ = _read_all(path)
    assert all(np.array_equal(reference[k], rebuilt[k]) for k in reference)


def test_missing_dataset_via_prepare(tmp_path):
    cfg = DataConfig(root=str(tmp_path / "none"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="Fashion-MNIST not found"):
        prepare_partition(cfg, 4, 0)


# --------------------------------------------------------------------------- PFLlib


def _fake_pfllib(directory, num_clients=3, num_classes=4, shape=(1, 8, 8)):
    rng = np.random.default_rng(0)
    (directory / "train").mkdir(parents=True)
    (directory / "test").mkdir()
    written = {}
    for cid in range(num_clients):
        for part, n in (("train", 6 + cid), ("test", 2 + cid)):
            x = ((rng.random((n, *shape)) - 0.5) / 0.5).astype(np.float32)
            y = rng.integers(0, num_classes, n).astype(np.int64)
            np.savez_compressed(directory / part / f"{cid}.npz", data={"x": x, "y": y})
            written[(cid, part)] = (x, y)
    config = {"num_clients": num_clients, "num_classes": num_classes, "non_iid": True,
              "balance": False, "partition": "dir", "alpha": 0.1, "batch_size": 10}
    (directory / "config.json").write_text(json.dumps(config))
    return written


def test_pfllib_reader(tmp_path):
    source = tmp_path / "Cifar10"
    written = _fake_pfllib(source)
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), allow_pickle=True,
                     cache_dir=str(tmp_path / "cache"))
    info = prepare_partition(cfg, 3, seed=0)
    assert os.path.basename(info.path).startswith("Cifar10-pfllib-")
    assert (info.num_classes, info.in_channels, info.image_size, info.num_clients) == (4, 1, 8, 3)
    for cid in range(3):
        split = load_client_split(info.path, cid)
        x, y = written[(cid, "train")]
        assert split.train_x.dtype == torch.float32
        assert torch.equal(split.train_x, torch.from_numpy(x))  # already normalised: as is
        assert torch.equal(split.train_y, torch.from_numpy(y))
        tx, ty = written[(cid, "test")]
        assert torch.equal(split.test_x, torch.from_numpy(tx))
        assert torch.equal(split.test_y, torch.from_numpy(ty))
        assert np.array_equal(info.class_counts[cid], np.bincount(y, minlength=4))
    assert prepare_partition(cfg, 3, seed=5).path == info.path  # seed does not matter


def test_pfllib_needs_allow_pickle(tmp_path):
    source = tmp_path / "fmnist_pfl"
    _fake_pfllib(source)
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as exc:
        prepare_partition(cfg, 3, seed=0)
    text = _one_line(exc)
    assert "PFLlib .npz files hold pickled Python objects" in text
    assert f"set data.allow_pickle=true if you trust {source}" in text
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


def test_pfllib_num_clients_mismatch_and_missing_files(tmp_path):
    source = tmp_path / "pfl"
    _fake_pfllib(source)
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), allow_pickle=True,
                     cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="set num_clients=3") as exc:
        prepare_partition(cfg, 4, seed=0)
    _one_line(exc)
    os.remove(source / "test" / "1.npz")
    with pytest.raises(DataError, match=r"lacks test/1\.npz"):
        prepare_partition(cfg, 3, seed=0)
    with pytest.raises(DataError, match="does not exist"):
        prepare_partition(DataConfig(partition="pfllib", pfllib_dir=str(tmp_path / "x"),
                                     allow_pickle=True, cache_dir=str(tmp_path / "c")), 3, 0)
