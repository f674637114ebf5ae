"""Domain shift (data.domains): Digit-5 and DomainNet read from the raw per-domain files PFLlib's
generators read, one domain per client (client i: domain i mod D), one input shape for all.

The directories are written here in the formats those generators read
(``dataset/generate_Digit5.py``: ``scipy.io.loadmat`` of ``mnist_data.mat`` (train_32 / test_32
grey, one-hot labels), ``mnistm_with_label.mat`` (N x 32 x 32 x 3, one-hot),
``svhn_*_32x32.mat`` and ``synth_*_32x32.mat`` (X 32 x 32 x 3 x N, y N x 1 with 10 for the digit 0),
``usps_28x28.mat`` (2 x 2 cells of N x 1 x 28 x 28 pictures in 0..1 and labels);
``dataset/generate_DomainNet.py``: ``splits/<domain>_train.txt`` / ``_test.txt`` lines
"<path> <label>" and JPEGs of any size). Every domain's pictures have their own constant grey
level, so a client's pixels say which domain they came from.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image
from scipy.io import savemat

from conftest import REPO, SMOKE, launch, read_metrics, run_program
from htfl_dist.config import DataConfig
from htfl_dist.data import load_client_split, load_dataset, prepare_partition
from htfl_dist.data.sources.digit5 import digit5_folder
from htfl_dist.data.sources.domainnet import domainnet_folder
from htfl_dist.errors import ConfigError

LEVEL = {"mnist": 10, "mnistm": 60, "svhn": 110, "syn": 160, "usps": 127}
"""Each Digit-5 domain's pixel value (USPS stores 0.5, which the reader makes 127 as np.uint8 does)."""
TRAIN_PER_CLASS, TEST_PER_CLASS = 4, 2


def _labels(per_class: int, classes=range(10)) -> np.ndarray:
    return np.repeat(np.asarray(list(classes)), per_class)


def _one_hot(labels: np.ndarray) -> np.ndarray:
    out = np.zeros((labels.size, 10), dtype=np.uint8)
    out[np.arange(labels.size), labels] = 1
    return out


def write_digit5(root: Path, svhn_classes=range(10)) -> Path:
    """Digit-5's seven .mat files, a few pictures per class per domain."""
    root.mkdir(parents=True, exist_ok=True)
    train, test = _labels(TRAIN_PER_CLASS), _labels(TEST_PER_CLASS)
    grey = {name: np.full((y.size, 32, 32), LEVEL["mnist"], dtype=np.uint8)
            for name, y in (("tr", train), ("te", test))}
    savemat(root / "mnist_data.mat", {"train_32": grey["tr"], "test_32": grey["te"],
                                      "label_train": _one_hot(train), "label_test": _one_hot(test)})
    savemat(root / "mnistm_with_label.mat", {
        "train": np.full((train.size, 32, 32, 3), LEVEL["mnistm"], dtype=np.uint8),
        "test": np.full((test.size, 32, 32, 3), LEVEL["mnistm"], dtype=np.uint8),
        "label_train": _one_hot(train), "label_test": _one_hot(test)})
    for domain, stem in (("svhn", "svhn"), ("syn", "synth")):
        classes = svhn_classes if domain == "svhn" else range(10)
        for part, per_class in (("train", TRAIN_PER_CLASS), ("test", TEST_PER_CLASS)):
            y = _labels(per_class, classes)
            y = np.where(y == 0, 10, y) if domain == "svhn" else y  # SVHN writes the digit 0 as 10
            savemat(root / f"{stem}_{part}_32x32.mat", {
                "X": np.full((32, 32, 3, y.size), LEVEL[domain], dtype=np.uint8),
                "y": y.reshape(-1, 1).astype(np.uint8)})
    cells = np.empty((2, 2), dtype=object)
    for row, y in enumerate((train, test)):
        cells[row, 0] = np.full((y.size, 1, 28, 28), 0.5)
        cells[row, 1] = np.where(y == 0, 10, y).reshape(-1, 1).astype(np.float64)
    savemat(root / "usps_28x28.mat", {"dataset": cells})
    return root


def _data(root: Path, tmp_path: Path, domains, **options) -> DataConfig:
    options.setdefault("beta", 1.0)
    options.setdefault("min_samples_per_client", 2)
    return DataConfig(dataset="digit5", root=str(root), domains=list(domains), cache_dir=str(tmp_path / "cache"),
                      **options)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def _client_pixels(path: str, cid: int) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return np.concatenate([f[f"client_{cid}/train_x"][()].ravel(), f[f"client_{cid}/test_x"][()].ravel()])


# ---------------------------------------------------------------- reading and splitting


@pytest.mark.parametrize("partition", ["dirichlet", "pathological", "exdir"])
def test_each_client_holds_its_own_domain_only(tmp_path, partition):
    root = write_digit5(tmp_path / "Digit5")
    domains = ["mnist", "usps", "svhn"]
    info = prepare_partition(_data(root, tmp_path, domains, partition=partition, classes_per_client=5), 6, 0)
    assert (info.num_classes, info.in_channels, info.image_size, info.num_clients) == (10, 3, 32, 6)
    with h5py.File(info.path, "r") as f:
        assert f.attrs["domains"] == "mnist,usps,svhn"
        assert f.attrs["domain_of_client"].tolist() == [0, 1, 2, 0, 1, 2]
    per_domain = {domain: 0 for domain in domains}
    for cid in range(6):
        domain = domains[cid % 3]
        pixels = _client_pixels(info.path, cid)
        assert pixels.size and set(np.unique(pixels).tolist()) == {LEVEL[domain]}, (cid, domain)
        split = load_client_split(info.path, cid)
        assert split.train_x.shape[1:] == split.test_x.shape[1:] == (3, 32, 32)
        assert len(split.test_y) > 0
        assert set(split.train_y.tolist()) | set(split.test_y.tolist()) <= set(range(10))
        per_domain[domain] += len(split.train_y) + len(split.test_y)
    if partition == "dirichlet":  # every sample of every named domain is used
        assert per_domain == {domain: 10 * (TRAIN_PER_CLASS + TEST_PER_CLASS) for domain in domains}


def test_every_domain_reads_as_rgb_32_with_the_digits_0_to_9(tmp_path):
    """digit5 alone pools the five domains (PFLlib's order); SVHN's and USPS's 10 is the digit 0."""
    arrays = load_dataset("digit5", str(write_digit5(tmp_path / "Digit5")))
    per_domain = 10 * (TRAIN_PER_CLASS + TEST_PER_CLASS)
    assert arrays.images.shape == (5 * per_domain, 3, 32, 32) and arrays.images.dtype == np.uint8
    for d, domain in enumerate(["mnistm", "mnist", "syn", "usps", "svhn"]):
        rows = slice(d * per_domain, (d + 1) * per_domain)
        assert set(np.unique(arrays.images[rows]).tolist()) == {LEVEL[domain]}, domain
        assert np.bincount(arrays.labels[rows], minlength=10).tolist() == [TRAIN_PER_CLASS + TEST_PER_CLASS] * 10


def test_pfllib_folder_with_rawdata_is_found(tmp_path):
    """data.root may be PFLlib's Digit5/ folder, whose rawdata/ holds the files."""
    write_digit5(tmp_path / "Digit5" / "rawdata")
    info = prepare_partition(_data(tmp_path / "Digit5", tmp_path, ["syn", "mnistm"]), 2, 0)
    assert set(np.unique(_client_pixels(info.path, 1)).tolist()) == {LEVEL["mnistm"]}


def test_the_cache_key_follows_the_domains(tmp_path):
    root = write_digit5(tmp_path / "Digit5")
    path = {}
    for name, domains in {"a": ["mnist", "usps"], "again": ["mnist", "usps"], "swapped": ["usps", "mnist"],
                          "other": ["mnist", "svhn"]}.items():
        path[name] = prepare_partition(_data(root, tmp_path, domains), 2, 0).path
    assert path["a"] == path["again"]
    assert len({path["a"], path["swapped"], path["other"]}) == 3
    assert os.path.basename(path["a"]).startswith("digit5_mnist_usps-dirichlet-")
    plain = prepare_partition(DataConfig(dataset="digit5", root=str(root), cache_dir=str(tmp_path / "cache"),
                                         beta=1.0, min_samples_per_client=2), 2, 0).path
    assert plain not in path.values()


def test_no_domains_leaves_the_experiment_as_it_was():
    from htfl_dist.config import load_config

    plain = load_config(None, [])
    assert "domains" not in plain.experiment()["data"]
    assert load_config(None, ["data.domains=[]"]).config_hash() == plain.config_hash()
    chosen = load_config(None, ["data.dataset=digit5", "data.domains=[mnist,usps]"])
    assert chosen.data.domains == ["mnist", "usps"]
    assert chosen.config_hash() != load_config(None, ["data.dataset=digit5", "data.domains=[usps,mnist]"]).config_hash()


# ---------------------------------------------------------------- DomainNet


def write_domainnet(root: Path, colours: dict[str, tuple[int, int, int]], classes: int = 3) -> Path:
    (root / "splits").mkdir(parents=True)
    sizes = [(40, 30), (70, 70), (64, 64)]
    for domain, colour in colours.items():
        lines = {"train": [], "test": []}
        for label in range(classes):
            folder = root / domain / f"class_{label}"
            folder.mkdir(parents=True)
            for i in range(5):
                rel = f"{domain}/class_{label}/{domain}_{label:03d}_{i:06d}.jpg"
                mode = "L" if i == 4 else "RGB"  # a grey JPEG is read as RGB
                value = colour[0] if mode == "L" else colour
                Image.new(mode, sizes[i % 3], value).save(root / rel, quality=95)
                lines["train" if i < 3 else "test"].append(f"{rel} {label}")
        for part, rows in lines.items():
            (root / "splits" / f"{domain}_{part}.txt").write_text("\n".join(rows) + "\n")
    return root


def test_domainnet_domains_become_rgb_64_per_client(tmp_path):
    colours = {"clipart": (200, 200, 200), "sketch": (40, 40, 40)}
    root = write_domainnet(tmp_path / "DomainNet" / "rawdata", colours)
    data = DataConfig(dataset="domainnet", root=str(tmp_path / "DomainNet"), domains=["sketch", "clipart"],
                      cache_dir=str(tmp_path / "cache"), beta=1.0, min_samples_per_client=2)
    info = prepare_partition(data, 4, 0)
    assert (info.num_classes, info.in_channels, info.image_size) == (3, 3, 64)
    for cid in range(4):
        pixels = _client_pixels(info.path, cid)
        level = colours[["sketch", "clipart"][cid % 2]][0]
        assert np.abs(pixels.astype(int) - level).max() <= 3, cid
    (root / "splits" / "sketch_test.txt").unlink()
    with pytest.raises(ConfigError) as exc:
        prepare_partition(DataConfig(**{**data.__dict__, "domains": ["sketch"]}), 2, 0)
    assert "domainnet domain 'sketch' is missing" in _one_line(exc) and "sketch_test.txt" in _one_line(exc)


# ---------------------------------------------------------------- one-line refusals


def test_a_missing_domain_is_one_line(tmp_path):
    root = write_digit5(tmp_path / "Digit5")
    (root / "usps_28x28.mat").unlink()
    prepare_partition(_data(root, tmp_path, ["mnist", "svhn"]), 2, 0)  # the other domains are not needed
    with pytest.raises(ConfigError) as exc:
        prepare_partition(_data(root, tmp_path, ["mnist", "usps"]), 2, 0)
    assert _one_line(exc) == (
        f"digit5 domain 'usps' is missing: {root} lacks usps_28x28.mat; unzip PFLlib's Digit5.zip (the link in "
        f"its dataset/generate_Digit5.py) into DIR, so that DIR holds the seven .mat files (data.root=DIR), or "
        f"leave 'usps' out of data.domains")


def test_a_domain_with_another_label_set_is_one_line(tmp_path):
    root = write_digit5(tmp_path / "Digit5", svhn_classes=range(1, 10))  # no digit 0
    with pytest.raises(ConfigError) as exc:
        prepare_partition(_data(root, tmp_path, ["mnist", "svhn"]), 2, 0)
    assert _one_line(exc) == ("digit5 domain 'svhn' holds labels 1..9 but 'mnist' holds 0..9; the domains must "
                              "share one label set (fix the data, or leave 'svhn' out of data.domains)")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"domains": ["mnist", "emnist"]}, "config key 'data.domains' names 'emnist', not a domain of digit5; its "
                                       "domains: mnistm, mnist, syn, usps, svhn"),
    ({"domains": ["mnist", "mnist"]}, "config key 'data.domains' names 'mnist' twice; name each domain once"),
    ({"domains": ["mnist", "usps", "svhn"]}, "config key 'num_clients' is 2 but data.domains names 3 domains; "
                                             "client i gets domain i mod 3, so use at least 3 clients"),
    ({"dataset": "fmnist"}, "config key 'data.domains' is set but data.dataset 'fmnist' has no domains; datasets "
                            "with domains: digit5, domainnet (docs/datasets.md, \"Domain shift\")"),
    ({"partition": "pfllib", "pfllib_dir": "x"}, "config key 'data.domains' splits a dataset's domains here, but "
                                                 "data.partition=pfllib reads a finished split; leave data.domains "
                                                 "empty or pick dirichlet, pathological or exdir"),
])
def test_bad_domain_settings_are_one_line(tmp_path, overrides, message):
    data = _data(tmp_path / "nowhere", tmp_path, ["mnist", "usps"])
    with pytest.raises(ConfigError) as exc:
        prepare_partition(DataConfig(**{**data.__dict__, **overrides}), 2, 0)
    assert _one_line(exc) == message


def _command(root: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO / "configs" / "digit5_htcnn8_fedproto_domains.yaml"), f"data.root={root}",
            "num_clients=5", "rounds=1", "checkpoint_every=0", "runtime.threads=1", "data.beta=1.0",
            "data.min_samples_per_client=2", "train.batch_size=4", "--out", str(tmp_path / "run"),
            f"data.cache_dir={tmp_path / 'cache'}", *extra]


def test_the_cli_stops_a_missing_domain_with_exit_2(tmp_path):
    root = write_digit5(tmp_path / "Digit5")
    (root / "synth_test_32x32.mat").unlink()
    done = run_program(_command(root, tmp_path))
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "digit5 domain 'syn' is missing" in last and "synth_test_32x32.mat" in last


# ---------------------------------------------------------------- a whole run


@pytest.mark.launch
def test_the_shipped_domains_config_runs_on_generated_data(tmp_path):
    """python -m htfl_dist.main --config configs/digit5_htcnn8_fedproto_domains.yaml data.root=DIR ..."""
    root = write_digit5(tmp_path / "Digit5")
    done = launch("single", 1, _command(root, tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "data: domain usps:" in done.stdout + done.stderr
    rows = read_metrics(tmp_path / "run")
    assert [row["round"] for row in rows] == [1]
    assert 0.0 <= rows[0]["test_acc"] <= 1.0 and np.isfinite(rows[0]["train_loss"])


@pytest.mark.integration
def test_smoke_with_two_domains_runs(tmp_path):
    root = write_digit5(tmp_path / "Digit5")
    done = run_program(["--config", str(SMOKE), "data.dataset=digit5", "data.domains=[svhn,usps]",
                        f"data.root={root}", "data.subsample=1", "num_clients=2", "rounds=1",
                        "data.min_samples_per_client=2", "--out", str(tmp_path / "run"),
                        f"data.cache_dir={tmp_path / 'cache'}"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.isfinite(read_metrics(tmp_path / "run")[0]["train_loss"])


@pytest.mark.parametrize("folder_of, holds", [(digit5_folder, "Digit-5's .mat files"),
                                              (domainnet_folder, "DomainNet's domain folders and splits/")])
def test_a_suite_without_its_directory_is_one_line(tmp_path, folder_of, holds):
    from htfl_dist.errors import DataError

    with pytest.raises(DataError, match=r"needs data\.root=DIR, a directory holding " + re.escape(holds)):
        folder_of(None)
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(DataError, match=f"{re.escape(str(afile))} is not a directory"):
        folder_of(str(afile))
    assert folder_of(str(tmp_path)) == str(tmp_path)
