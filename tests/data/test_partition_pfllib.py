"""data.partition_rules=pfllib: PFLlib's partition and train/test split, sample for sample.

The oracle numbers in fixtures/pfllib_partition_seed1.json come from PFLlib's own
``separate_data`` + ``split_data`` (seed 1), run once outside this repository; the fixture says
how. The hand-computed examples below pin each rule (guard, class assignment, shares, split) so
that changing one fails a test even where the oracle data would not notice.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from htfl_dist.config import DEFAULT_FMNIST_ROOT, DataConfig, load_config
from htfl_dist.data.cache_keys import partition_key, pfllib_guard
from htfl_dist.data.datasets import fmnist_files, parse_idx
from htfl_dist.data.partition_pfllib import (
    PFLLIB_EXDIR_MIN_SAMPLES,
    balance_refusal,
    partition_dirichlet_pfllib,
    partition_exdir_pfllib,
    partition_pathological_pfllib,
    pfllib_client_splits,
    pfllib_exdir_holders,
    pfllib_exdir_min_holders,
    pfllib_least_samples,
    pfllib_pathological_holders,
    pfllib_shares,
    split_train_test_pfllib,
)
from htfl_dist.data.prepare import _build_indices, prepare_partition
from htfl_dist.errors import ConfigError, DataError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "pfllib_partition_seed1.json").read_text())
PARTITIONS = ("dirichlet", "pathological")
needs_fmnist = pytest.mark.skipif(
    not os.path.isdir(DEFAULT_FMNIST_ROOT), reason="apt-get install dataset-fashion-mnist to run this test"
)

SMOKE_CONFIG = REPO / "configs" / "smoke.yaml"


def _digest(positions: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(positions, dtype=np.int64).tobytes()).hexdigest()[:16]


def _fmnist_labels() -> np.ndarray:
    files = fmnist_files(DEFAULT_FMNIST_ROOT)
    return np.concatenate([parse_idx(files[1], 1), parse_idx(files[3], 1)]).astype(np.int64)


def _assert_equals_oracle(labels: np.ndarray, splits: list, expected: dict, num_classes: int) -> None:
    counts = [np.bincount(labels[np.concatenate([tr, te])], minlength=num_classes).tolist() for tr, te in splits]
    assert counts == expected["class_counts"]
    assert [tr.size for tr, _ in splits] == expected["train_sizes"]
    assert [te.size for _, te in splits] == expected["test_sizes"]
    # the very samples, in PFLlib's order
    assert [_digest(tr) for tr, _ in splits] == expected["train_digest"]
    assert [_digest(te) for _, te in splits] == expected["test_digest"]


# --------------------------------------------------------------------------- the oracle


@needs_fmnist
@pytest.mark.parametrize("partition", PARTITIONS)
def test_fmnist_seed1_equals_pfllib_client_by_client(partition):
    labels = _fmnist_labels()
    case = FIXTURE["fmnist"]
    assert _digest(labels) == case["labels_digest"]  # the labels PFLlib was given
    data = DataConfig(partition=partition, partition_rules="pfllib")  # beta 0.1, k 2, ratio 0.75
    splits = _build_indices(data, labels, 10, case["num_clients"], seed=1, batch_size=10)
    _assert_equals_oracle(labels, splits, case[partition], 10)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_small_labels_equal_pfllib_index_for_index(partition):
    case = FIXTURE["small"]
    labels = np.array(case["labels"], dtype=np.int64)
    guard = pfllib_least_samples(labels.size, case["num_clients"], 10, 0.75)
    assert guard == 11  # int(min(40, 90 / 4 / 2))
    splits = pfllib_client_splits(labels, case["num_clients"], case["num_classes"], partition=partition,
                                  seed=1, least_samples=guard, train_ratio=0.75)
    assert [tr.tolist() for tr, _ in splits] == case[partition]["train"]
    assert [te.tolist() for _, te in splits] == case[partition]["test"]
    _assert_equals_oracle(labels, splits, case[partition], case["num_classes"])


@pytest.mark.parametrize("partition", PARTITIONS)
def test_the_stream_ends_where_pfllibs_does(partition):
    """No draw more or less than PFLlib: the next draw after the last split is PFLlib's."""
    case = FIXTURE["small"]
    labels = np.array(case["labels"], dtype=np.int64)
    rng = np.random.RandomState(1)
    if partition == "dirichlet":
        parts = partition_dirichlet_pfllib(labels, 4, 0.1, 3, 11, rng)
    else:
        parts = partition_pathological_pfllib(labels, 4, 2, 3, 11, rng)
    for part in parts:
        split_train_test_pfllib(part, 0.75, rng)
    assert int(rng.randint(0, 2**31 - 1)) == case[partition]["next_draw"]


# --------------------------------------------------------------------------- the guard


def test_guard_is_pfllibs_least_samples():
    assert pfllib_least_samples(70000, 20, 10, 0.75) == 40  # 10 / 0.25
    assert pfllib_least_samples(600, 20, 10, 0.75) == 15  # capped at N / clients / 2
    assert pfllib_least_samples(6, 2, 10, 0.75) == 1  # int(1.5)
    assert pfllib_least_samples(70000, 20, 32, 0.75) == 128
    assert pfllib_least_samples(70000, 20, 3, 0.7) == 9  # int(3 / 0.30000000000000004) = int(9.99...)


def test_guard_comes_from_the_batch_size_unless_set():
    """40 labels over 2 clients; one draw allowed. Seed 0's draw gives sizes [2, 38], seed 2's
    [11, 29]. The guard is int(min(batch / (1 - train_ratio), 40 / 2 / 2))."""
    labels = np.array([0, 1] * 20)

    def sizes(seed: int, batch_size: int, **options) -> list[int]:
        data = DataConfig(partition="dirichlet", partition_rules="pfllib", max_partition_tries=1, **options)
        splits = _build_indices(data, labels, 2, 2, seed=seed, batch_size=batch_size)
        return sorted(tr.size + te.size for tr, te in splits)

    assert sizes(2, 10) == [11, 29]  # guard int(min(40, 10)) = 10
    assert sizes(0, 1, train_ratio=0.5) == [2, 38]  # guard int(min(2, 10)) = 2
    with pytest.raises(DataError, match=r"fewer than 10 samples after 1 tries"):
        sizes(0, 10)
    with pytest.raises(DataError, match=r"fewer than 12 samples after 1 tries"):
        sizes(2, 10, min_samples_per_client=12)  # a set value replaces PFLlib's guard
    assert sizes(0, 10, min_samples_per_client=2) == [2, 38]


# --------------------------------------------------------------------------- pathological


def test_each_class_goes_to_the_first_clients_with_a_free_slot():
    holders = pfllib_pathological_holders(20, 2, 10)  # block ceil(20 / 10 * 2) = 4
    assert holders[:4] == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert holders[9] == [16, 17, 18, 19]
    # 3 clients, 2 classes, 1 slot each: block ceil(1.5) = 2
    assert pfllib_pathological_holders(3, 1, 2) == [[0, 1], [2]]
    # 3 clients, 5 classes, 1 slot each: block ceil(0.6) = 1; classes 3 and 4 held by nobody
    assert pfllib_pathological_holders(3, 1, 5) == [[0], [1], [2], [], []]
    # 5 clients, 3 classes, 2 slots: block ceil(10 / 3) = 4; the last class gets who is left
    assert pfllib_pathological_holders(5, 2, 3) == [[0, 1, 2, 3], [0, 1, 2, 3], [4]]


def test_block_size_is_pfllibs_float_expression():
    """(36 / 28) * 21 evaluates to 27.000000000000004: PFLlib's ceil gives 28 holders, not 27."""
    assert len(pfllib_pathological_holders(36, 21, 28)[0]) == 28


class _ScriptedRandint:
    """Stands in for RandomState.randint: records its arguments, returns scripted draws."""

    def __init__(self, *draws: list[int]):
        self.draws, self.calls = list(draws), []

    def randint(self, low, high, size):
        self.calls.append((low, high, size))
        return np.array(self.draws.pop(0), dtype=np.int64)


def test_share_bounds_and_the_last_holder_takes_the_rest():
    # n = 13 over 3 holders: n/m = 4.33; low = int(max(0.433, guard 7 / 2 classes)) = 3, high = 4
    rng = _ScriptedRandint([3, 3])
    assert pfllib_shares(13, 3, 7, 2, rng) == [3, 3, 7]
    assert rng.calls == [(3, 4, 2)]
    # n = 100 over 2: low = int(max(100 / 2 / 10, 4 / 2)) = 5, high = 50
    rng = _ScriptedRandint([5])
    assert pfllib_shares(100, 2, 4, 2, rng) == [5, 95]
    assert rng.calls == [(5, 50, 1)]
    # one holder takes everything without a draw
    rng = _ScriptedRandint()
    assert pfllib_shares(9, 1, 40, 2, rng) == [9] and rng.calls == []


def test_pathological_takes_each_class_in_order_without_shuffling():
    """24 labels, 2 classes, 4 clients, 1 class each: clients 0, 1 share class 0 and 2, 3 class 1.
    Guard int(min(40, 24 / 4 / 2)) = 3; class size 12 over 2: draw from [int(max(0.6, 1.5)), 6)."""
    labels = np.array([0, 1] * 12)
    guard = pfllib_least_samples(labels.size, 4, 10, 0.75)
    rng = _ScriptedRandint([2], [5])
    parts = partition_pathological_pfllib(labels, 4, 1, 2, guard, rng)
    assert rng.calls == [(1, 6, 1), (1, 6, 1)]
    evens, odds = list(range(0, 24, 2)), list(range(1, 24, 2))
    assert [p.tolist() for p in parts] == [evens[:2], evens[2:], odds[:5], odds[5:]]


def test_six_labels_over_two_classes_end_to_end():
    """2 clients, 1 class each: a single holder per class, so the partition draws nothing and
    the stream's first draws are the splits: 3 samples -> floor(2.25) = 2 train, 1 test."""
    labels = np.array([1, 0, 1, 0, 0, 1])
    splits = pfllib_client_splits(labels, 2, 2, partition="pathological", classes_per_client=1,
                                  seed=5, least_samples=1, train_ratio=0.75)
    rng = np.random.RandomState(5)
    for (train, test), part in zip(splits, ([1, 3, 4], [0, 2, 5]), strict=True):
        order = rng.permutation(3)
        assert test.tolist() == [part[order[0]]]
        assert train.tolist() == [part[order[1]], part[order[2]]]


def test_partition_and_splits_draw_from_one_stream():
    """PFLlib seeds once: the splits continue the stream the partition drew from (2 holders per
    class, so the partition draws first)."""
    labels = np.array([0, 1] * 12)
    splits = pfllib_client_splits(labels, 4, 2, partition="pathological", classes_per_client=1,
                                  seed=3, least_samples=8, train_ratio=0.75)
    rng = np.random.RandomState(3)
    parts = partition_pathological_pfllib(labels, 4, 1, 2, 8, rng)  # shares from [4, 6)
    for (train, test), part in zip(splits, parts, strict=True):
        expected_train, expected_test = split_train_test_pfllib(part, 0.75, rng)
        assert train.tolist() == expected_train.tolist() and test.tolist() == expected_test.tolist()


def test_a_share_rule_that_cannot_draw_names_the_keys():
    labels = np.array([0] * 6 + [1] * 6)
    # class size 6 over 4 holders: high = int(1.5) = 1, low = int(max(0.15, 8 / 2)) = 4
    with pytest.raises(DataError, match=r"class 0 has 6 samples for 4 clients.*data.min_samples_per_client"):
        partition_pathological_pfllib(labels, 4, 2, 2, 8, np.random.RandomState(0))


# --------------------------------------------------------------------------- Dirichlet


class _ScriptedDirichlet:
    """Stands in for RandomState: shuffle leaves the order, dirichlet returns scripted draws."""

    def __init__(self, *draws: list[float]):
        self.draws, self.calls = list(draws), 0

    def shuffle(self, array):
        pass

    def dirichlet(self, alpha):
        self.calls += 1
        return np.array(self.draws.pop(0))


def test_dirichlet_full_clients_get_no_share_and_the_guard_redraws():
    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1])  # 2 clients: cap N / clients = 4
    # class 0: cut int(0.75 * 4) = 3 -> [3, 1]; class 1 likewise -> sizes [6, 2]
    rng = _ScriptedDirichlet([0.75, 0.25], [0.9, 0.1])
    parts = partition_dirichlet_pfllib(labels, 2, 0.1, 2, 2, rng)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 4, 5, 6], [3, 7]] and rng.calls == 2
    # guard 3: that draw is refused and the whole split drawn again
    rng = _ScriptedDirichlet([0.75, 0.25], [0.9, 0.1], [0.5, 0.5], [0.5, 0.5])
    parts = partition_dirichlet_pfllib(labels, 2, 0.1, 2, 3, rng)
    assert [p.tolist() for p in parts] == [[0, 1, 4, 5], [2, 3, 6, 7]] and rng.calls == 4
    # a client at the cap (4 < 4 is false) gets nothing of the next class, whatever its draw
    rng = _ScriptedDirichlet([1.0, 0.0], [0.9, 0.1])
    parts = partition_dirichlet_pfllib(labels, 2, 0.1, 2, 0, rng)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_dirichlet_keeps_pfllibs_order_class_by_class():
    """A client's indices are its pieces in class order, each in shuffled order (here: reversed)."""

    class Reversing(_ScriptedDirichlet):
        def shuffle(self, array):
            array[:] = array[::-1].copy()

    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    parts = partition_dirichlet_pfllib(labels, 2, 0.1, 2, 2, Reversing([0.75, 0.25], [0.9, 0.1]))
    assert [p.tolist() for p in parts] == [[3, 2, 1, 7, 6, 5], [0, 4]]


def test_dirichlet_draws_for_an_empty_class_too():
    """PFLlib shuffles and draws for every class, empty or not; skipping one would shift the stream."""
    labels = np.array([0, 0, 2, 2])
    rng = _ScriptedDirichlet([0.5, 0.5], [0.5, 0.5], [0.5, 0.5])
    partition_dirichlet_pfllib(labels, 2, 0.1, 3, 0, rng)
    assert rng.calls == 3


def test_dirichlet_that_cannot_meet_the_guard_names_the_keys():
    labels = np.zeros(10, dtype=np.int64)
    with pytest.raises(DataError, match=r"cannot give 4 clients at least 3 samples.*data.min_samples_per_client"):
        partition_dirichlet_pfllib(labels, 4, 0.1, 1, 3, np.random.RandomState(0))


# --------------------------------------------------------------------------- balanced pathological, exdir
#
# The literals below are PFLlib's own output (dataset/utils/dataset_utils.py @ d832e76f6a23b833038949ec1e4fdefe63a4d350,
# numpy 2.4.6, scikit-learn 1.9.1): separate_data(niid=True, partition='exdir' | 'pat', class_per_client=2, alpha
# as named) + split_data after np.random.seed(1), random.seed(1), with the sample positions as the data array;
# next_draw is np.random.randint(0, 2**31 - 1) drawn after split_data; a digest is
# sha256(int64 positions of all clients, concatenated in order)[:16]. Written by a throw-away script outside this
# repository (a copy of PFLlib's dataset/utils with scikit-learn on PYTHONPATH):
#   PYTHONPATH=<sklearn dir>:<PFLlib>/dataset:. python fixture.py
# The same run compared htfl_dist's split with PFLlib's on FMNIST (20 clients; exdir alpha 0.1, 100, 0.5 and 1 with
# C = 2, 2, 3, 5; pat balanced C = 2, 3) and on 242 random label vectors: identical sample for sample.

EXDIR_SMALL = {  # FIXTURE["small"]["labels"] (90 labels, 3 classes), 4 clients, alpha 0.1, C = 2, guard 10
    "train": [[45, 19, 27, 13, 23, 37, 33, 65, 51],
              [54, 60, 4, 26, 42, 71, 52, 89, 38, 1, 87, 59, 47, 35, 49, 61, 55, 24, 30, 62, 67],
              [9, 18, 68, 2, 28, 86, 10, 5, 8, 75, 85, 17, 84, 58, 12],
              [70, 39, 40, 0, 78, 22, 82, 81, 43, 69, 50, 14, 25, 56, 36, 16, 29, 77, 48, 53, 6]],
    "test": [[11, 34, 66], [7, 63, 57, 73, 21, 79, 72], [32, 76, 41, 88, 31, 64], [3, 80, 44, 15, 46, 20, 83, 74]],
    "next_draw": 1083906737,
}
BALANCED_PAT_SMALL = {  # the same labels, 4 clients, C = 2, balance=True
    "train": [[24, 13, 6, 15, 16, 3, 4, 0, 38, 35, 20, 19, 1, 23, 14],
              [59, 54, 27, 42, 52, 40, 60, 55, 47, 39, 25, 44, 36, 57, 49],
              [53, 61, 67, 50, 89, 87, 82, 51, 79, 69, 72, 74, 56, 77, 78, 81, 63],
              [76, 41, 84, 34, 75, 32, 8, 2, 86, 17, 12, 10, 88, 9, 31, 85, 28, 18]],
    "test": [[21, 22, 11, 30, 26, 7], [33, 29, 37, 45, 48, 43], [70, 62, 71, 73, 83, 80], [64, 66, 5, 65, 58, 46, 68]],
    "next_draw": 2117674829,
}
FMNIST_CASES = {  # the FMNIST labels of test_fmnist_seed1_equals_pfllib_client_by_client, 20 clients
    "exdir alpha 0.1": (dict(partition="exdir", beta=0.1), {
        "train_sizes": [4699, 4197, 426, 3535, 5398, 2044, 5145, 4993, 3970, 4616, 141, 1052, 247, 3811, 5250, 30,
                        172, 1279, 117, 1370],
        "test_sizes": [1567, 1399, 143, 1179, 1800, 682, 1716, 1665, 1324, 1539, 47, 351, 83, 1271, 1750, 11, 58, 427,
                       39, 457],
        "train_digest": "038c9e64ef49b565", "test_digest": "8bcc9a5dcfebf3e0"}),
    "exdir alpha 100": (dict(partition="exdir", beta=100.0), {  # PFLlib's comment: "100 for exdir"
        "train_sizes": [2506, 2870, 2682, 2107, 3038, 2876, 3505, 1722, 2313, 2189, 2069, 2660, 3158, 3762, 2757, 1618,
                        3222, 2691, 2355, 2394],
        "test_sizes": [836, 957, 894, 703, 1013, 959, 1169, 574, 772, 730, 690, 887, 1053, 1254, 919, 540, 1074, 898,
                       785, 799],
        "train_digest": "f8ffda686fa6d07d", "test_digest": "5b74261cfdbee3ab"}),
    "pat balanced": (dict(partition="pathological", balance=True), {  # 4 holders x 1750 per class
        "train_sizes": [2625] * 20, "test_sizes": [875] * 20,
        "train_digest": "fae57b0d6d835186", "test_digest": "a3d2d82ebdd8aaae"}),
}


def _digest_all(arrays: list) -> str:
    return _digest(np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]))


@needs_fmnist
@pytest.mark.parametrize("case", FMNIST_CASES)
def test_fmnist_seed1_exdir_and_balanced_equal_pfllib(case):
    options, expected = FMNIST_CASES[case]
    labels = _fmnist_labels()
    assert _digest(labels) == FIXTURE["fmnist"]["labels_digest"]
    splits = _build_indices(DataConfig(partition_rules="pfllib", **options), labels, 10, 20, seed=1, batch_size=10)
    assert [tr.size for tr, _ in splits] == expected["train_sizes"]
    assert [te.size for _, te in splits] == expected["test_sizes"]
    assert _digest_all([tr for tr, _ in splits]) == expected["train_digest"]
    assert _digest_all([te for _, te in splits]) == expected["test_digest"]


@pytest.mark.parametrize("partition, expected", [("exdir", EXDIR_SMALL), ("pathological", BALANCED_PAT_SMALL)])
def test_small_labels_exdir_and_balanced_equal_pfllib_index_for_index(partition, expected):
    labels = np.array(FIXTURE["small"]["labels"], dtype=np.int64)
    data = DataConfig(partition=partition, partition_rules="pfllib", balance=partition == "pathological")
    splits = _build_indices(data, labels, 3, 4, seed=1, batch_size=10)
    assert [tr.tolist() for tr, _ in splits] == expected["train"]
    assert [te.tolist() for _, te in splits] == expected["test"]
    # no draw more or less than PFLlib: the next draw after the last split is PFLlib's
    rng = np.random.RandomState(1)
    if partition == "exdir":
        parts = partition_exdir_pfllib(labels, 4, 0.1, 2, 3, PFLLIB_EXDIR_MIN_SAMPLES, rng)
    else:
        parts = partition_pathological_pfllib(labels, 4, 2, 3, 11, rng, balance=True)
    for part in parts:
        split_train_test_pfllib(part, 0.75, rng)
    assert int(rng.randint(0, 2**31 - 1)) == expected["next_draw"]


def test_balanced_shares_are_equal_and_draw_nothing():
    rng = _ScriptedRandint()  # any draw would fail: it has none to give
    assert pfllib_shares(13, 3, 7, 2, rng, balance=True) == [4, 4, 5]  # int(13 / 3) = 4, the last the rest
    assert pfllib_shares(10, 4, 40, 2, rng, balance=True) == [2, 2, 2, 4]  # int(2.5) = 2
    assert pfllib_shares(6, 4, 8, 2, rng, balance=True) == [1, 1, 1, 3]  # where the unbalanced rule cannot draw
    assert pfllib_shares(9, 1, 40, 2, rng, balance=True) == [9]
    labels = np.array([0, 1] * 12)  # 4 clients, 1 class each: 2 holders of 12 samples per class
    parts = partition_pathological_pfllib(labels, 4, 1, 2, 3, rng, balance=True)
    assert rng.calls == []
    evens, odds = list(range(0, 24, 2)), list(range(1, 24, 2))
    assert [p.tolist() for p in parts] == [evens[:6], evens[6:], odds[:6], odds[6:]]


class _ScriptedExdir(_ScriptedDirichlet):
    """Stands in for RandomState in exdir: scripted class choices and Dirichlet draws, shuffle keeps the order."""

    def __init__(self, choices: list[list[int]], *draws: list[float]):
        super().__init__(*draws)
        self.choices = list(choices)
        self.choice_calls: list[tuple] = []

    def choice(self, a, size, replace=True):
        self.choice_calls.append((a, size, replace))
        return np.array(self.choices.pop(0))


def test_exdir_holders_need_half_the_mean_and_redraw():
    assert pfllib_exdir_min_holders(20, 2, 10) == 2  # 2 * 20 // 10 // 2
    assert pfllib_exdir_min_holders(100, 3, 10) == 15
    assert pfllib_exdir_min_holders(5, 2, 10) == 1  # 10 // 10 // 2 = 0, at least 1
    # 4 clients pick 1 of 2 classes: need 1 holder per class; the first assignment leaves class 1 to
    # nobody and is drawn again, whole
    rng = _ScriptedExdir([[0], [0], [0], [0], [1], [0], [0], [1]])
    assert pfllib_exdir_holders(4, 1, 2, rng, 10) == [[1, 2], [0, 3]]
    assert rng.choice_calls == [(2, 1, False)] * 8  # choice(C, k, replace=False), client by client
    with pytest.raises(DataError, match=r"after 1 tries some class still had fewer than 1 of 4 clients"):
        pfllib_exdir_holders(4, 1, 2, _ScriptedExdir([[0]] * 4), 1)
    # the slots cannot cover every class: PFLlib would loop forever; refused before any draw
    with pytest.raises(ConfigError, match=r"3 clients with data.classes_per_client=1 cannot cover all 4 classes"):
        pfllib_exdir_holders(3, 1, 4, _ScriptedExdir([]), 10)


def test_exdir_shares_go_to_open_holders_and_the_remainder_to_the_last_holder():
    """Clients 0, 1 hold class 0, client 2 class 1 (4 samples each). Class 0's draw [0.1, 0.3, 0.6] keeps
    [0.1, 0.3, 0] (client 2 does not hold it): cut points int(cumsum([0.25, 0.7499999999999999]) * 4) =
    [1, 3]; the last is not 4, so the one sample truncation leaves over goes to the last holder (client 1),
    not to client 2 as plain cutting would. Class 1 goes to client 2 alone whatever the draw."""
    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    rng = _ScriptedExdir([[0], [0], [1]], [0.1, 0.3, 0.6], [0.5, 0.4, 0.1])
    parts = partition_exdir_pfllib(labels, 3, 0.1, 1, 2, 0, rng)
    assert [p.tolist() for p in parts] == [[0], [1, 2, 3], [4, 5, 6, 7]]


def test_exdir_a_class_whose_holders_are_all_full_goes_to_its_last_holder():
    """Holders: class 0 clients 0-2, class 1 client 2, class 2 clients 0, 1. N = 9, so a client is full at
    3. Class 0's draw [0.5, 0.5, 0] fills clients 0 and 1; class 2 then has no open holder: PFLlib divides
    by zero and its remainder rule sends the whole class to the last holder (client 1), where the dir rule
    falls back to the raw draw."""
    labels = np.array([0, 0, 0, 0, 0, 0, 1, 2, 2])
    rng = _ScriptedExdir([[0, 2], [0, 2], [1, 0]], [0.5, 0.5, 0.0], [0.2, 0.2, 0.6], [0.9, 0.05, 0.05])
    parts = partition_exdir_pfllib(labels, 3, 0.1, 2, 3, 0, rng)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5, 7, 8], [6]]


def test_exdir_guard_redraws_the_second_level_only_and_shuffles_each_client_last():
    """Both clients hold both classes (cap N / 2 = 4), guard 3. Shuffles reverse. Try 1: class 0 [3, 2, 1, 0]
    cut at int(0.9 * 4) = 3, class 1 [7, 6, 5, 4] likewise: sizes [6, 2], refused. Try 2 (the class choices
    are kept): draws [0.5, 0.5] give [3, 2 | 1, 0] and [7, 6 | 5, 4]. Last, each client's indices are
    shuffled, client by client: [3, 2, 7, 6] -> [6, 7, 2, 3], [1, 0, 5, 4] -> [4, 5, 0, 1]."""

    class Reversing(_ScriptedExdir):
        def shuffle(self, array):
            self.shuffled.append(array.tolist())
            array[:] = array[::-1].copy()

    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    rng = Reversing([[0, 1], [1, 0]], [0.9, 0.1], [0.9, 0.1], [0.5, 0.5], [0.5, 0.5])
    rng.shuffled = []
    parts = partition_exdir_pfllib(labels, 2, 0.1, 2, 2, 3, rng)
    assert [p.tolist() for p in parts] == [[6, 7, 2, 3], [4, 5, 0, 1]]
    assert len(rng.choice_calls) == 2 and rng.calls == 4
    assert rng.shuffled == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2 + [[3, 2, 7, 6], [1, 0, 5, 4]]


def test_exdir_never_gives_a_client_a_class_it_did_not_pick():
    """Seeded property: the first level is the stream's first draw, so the holders can be recomputed;
    every sample is used once, every client holds only classes it picked and at least 10 samples."""
    rs = np.random.RandomState(7)
    labels = rs.randint(0, 6, 600)
    for seed in range(5):
        holders = pfllib_exdir_holders(8, 2, 6, np.random.RandomState(seed), 1000)
        splits = pfllib_client_splits(labels, 8, 6, partition="exdir", seed=seed, beta=0.1, classes_per_client=2,
                                      least_samples=PFLLIB_EXDIR_MIN_SAMPLES, train_ratio=0.75)
        every = np.concatenate([np.concatenate(s) for s in splits])
        assert sorted(every.tolist()) == list(range(600))
        for client, (train, test) in enumerate(splits):
            held = {c for c, clients in enumerate(holders) if client in clients}
            assert set(labels[np.concatenate([train, test])].tolist()) <= held
            assert train.size + test.size >= 10


def test_exdir_guard_is_a_fixed_10_unless_set():
    assert pfllib_guard(DataConfig(partition="exdir"), 70000, 20, 32) == PFLLIB_EXDIR_MIN_SAMPLES == 10
    assert pfllib_guard(DataConfig(partition="dirichlet"), 70000, 20, 32) == 128  # least_samples
    assert pfllib_guard(DataConfig(partition="exdir", min_samples_per_client=3), 70000, 20, 32) == 3


def test_exdir_and_balance_options_and_their_refusals():
    assert DataConfig().balance is False
    config = load_config(None, ["data.partition=exdir", "data.beta=100", "data.classes_per_client=3"])
    assert (config.data.partition, config.data.beta, config.data.classes_per_client) == ("exdir", 100.0, 3)
    assert load_config(None, ["data.partition=pathological", "data.balance=true"]).data.balance is True
    with pytest.raises(ConfigError, match=r"exdir and data.balance=true are PFLlib's rules.*partition_rules=pfllib"):
        load_config(None, ["data.partition=exdir", "data.partition_rules=legacy"])
    with pytest.raises(ConfigError, match=r"no legacy form"):
        load_config(None, ["data.partition=pathological", "data.balance=true", "data.partition_rules=legacy"])
    for partition in ("dirichlet", "exdir"):  # PFLlib ignores balance there; refused, not ignored
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"data.partition={partition}", "data.balance=true"])
        assert str(refused.value) == balance_refusal(partition)  # one line, whichever layer refuses
        with pytest.raises(ConfigError, match=r"leave data.balance false"):
            pfllib_client_splits(np.zeros(8, np.int64), 2, 1, partition=partition, seed=1, least_samples=0,
                                 train_ratio=0.75, balance=True)
    with pytest.raises(ConfigError, match=r"data.partition_rules=pfllib"):  # a config built in code
        _build_indices(DataConfig(partition="exdir", partition_rules="legacy"), np.zeros(8, np.int64), 1, 2, 1)


def test_new_keys_keep_old_hashes_and_enter_the_cache_key():
    smoke = load_config(SMOKE_CONFIG, [])
    assert "balance" not in smoke.experiment()["data"]  # at its default: every shipped config keeps its hash
    balanced = load_config(SMOKE_CONFIG, ["data.partition=pathological", "data.balance=true"])
    unbalanced = load_config(SMOKE_CONFIG, ["data.partition=pathological"])
    assert balanced.experiment()["data"]["balance"] is True and balanced.config_hash() != unbalanced.config_hash()

    def key(**options):
        return partition_key(DataConfig(partition_rules="pfllib", **options), 20, 1, None, 10)

    assert all("balance" not in key(partition=p) for p in ("dirichlet", "pathological"))  # old caches stay valid
    exdir = key(partition="exdir")
    assert exdir["partition"] == "exdir" and (exdir["beta"], exdir["classes_per_client"]) == (0.1, 2)
    assert "batch_size" not in exdir  # its guard is 10 whatever the batch size
    assert key(partition="exdir", beta=100.0) != exdir and key(partition="exdir", classes_per_client=3) != exdir
    assert key(partition="exdir") != key(partition="dirichlet")
    pat_balanced = key(partition="pathological", balance=True)
    assert pat_balanced["balance"] is True and "batch_size" not in pat_balanced  # draws nothing from the guard
    assert pat_balanced != key(partition="pathological")


@needs_fmnist
def test_prepare_partition_builds_exdir(tmp_path):
    data = DataConfig(partition="exdir", partition_rules="pfllib", subsample=0.05, cache_dir=str(tmp_path))
    info = prepare_partition(data, 6, seed=1, batch_size=10)
    assert (info.class_counts > 0).sum(axis=1).max() <= 2  # training counts: at most the 2 classes picked
    again = prepare_partition(DataConfig(partition="exdir", partition_rules="pfllib", subsample=0.05,
                                         classes_per_client=3, cache_dir=str(tmp_path)), 6, seed=1, batch_size=10)
    assert again.path != info.path


# --------------------------------------------------------------------------- train/test split


class _ScriptedPermutation:
    def __init__(self, order: list[int]):
        self.order = order

    def permutation(self, n):
        assert n == len(self.order)
        return np.array(self.order)


def test_split_keeps_sklearns_floor_and_takes_test_from_the_head():
    indices = np.array([10, 11, 12, 13, 14])  # floor(0.75 * 5) = 3 train, 2 test
    train, test = split_train_test_pfllib(indices, 0.75, _ScriptedPermutation([4, 0, 3, 1, 2]))
    assert train.tolist() == [13, 11, 12] and test.tolist() == [14, 10]
    train, test = split_train_test_pfllib(np.arange(4), 0.75, _ScriptedPermutation([0, 1, 2, 3]))
    assert (train.size, test.size) == (3, 1)  # floor(3.0)


def test_a_client_too_small_to_train_names_the_keys():
    with pytest.raises(DataError, match=r"holds 1 samples.*data.train_ratio=0.75.*lower num_clients"):
        split_train_test_pfllib(np.array([7]), 0.75, np.random.RandomState(0))


# --------------------------------------------------------------------------- config and cache


def test_partition_rules_option_and_its_checks(tmp_path):
    assert DataConfig().partition_rules == "pfllib" and DataConfig().min_samples_per_client is None
    config = load_config(None, ["data.partition_rules=legacy", "data.min_samples_per_client=null"])
    assert config.data.partition_rules == "legacy" and config.data.min_samples_per_client is None
    with pytest.raises(ConfigError, match=r"data.partition_rules.*pfllib, legacy"):
        load_config(None, ["data.partition_rules=pflib"])
    with pytest.raises(ConfigError, match=r"data.min_samples_per_client' must be >= 0"):
        load_config(None, ["data.min_samples_per_client=-1"])
    with pytest.raises(ConfigError, match=r"config key 'seed' is -1"):
        pfllib_client_splits(np.zeros(4, np.int64), 1, 1, partition="dirichlet", seed=-1,
                             least_samples=0, train_ratio=0.75)


def test_cache_key_names_the_rules_only_when_not_legacy():
    legacy = partition_key(DataConfig(partition_rules="legacy"), 20, 1, None, 10)
    assert "partition_rules" not in legacy and legacy["min_samples_per_client"] == 10  # as before
    pfllib = partition_key(DataConfig(partition_rules="pfllib"), 20, 1, None, 10)
    assert pfllib["partition_rules"] == "pfllib" and pfllib["batch_size"] == 10
    assert partition_key(DataConfig(partition_rules="pfllib"), 20, 1, None, 32) != pfllib
    fixed = DataConfig(partition_rules="pfllib", min_samples_per_client=40)
    assert "batch_size" not in partition_key(fixed, 20, 1, None, 32)
    pathological = partition_key(DataConfig(partition="pathological", partition_rules="pfllib"), 20, 1, None, 10)
    assert pathological["batch_size"] == 10  # the guard enters the share floor too


@needs_fmnist
def test_prepare_partition_builds_the_pfllib_split(tmp_path):
    data = DataConfig(partition="pathological", partition_rules="pfllib", subsample=0.02,
                      cache_dir=str(tmp_path))
    info = prepare_partition(data, 6, seed=1, batch_size=10)
    legacy = prepare_partition(DataConfig(partition="pathological", partition_rules="legacy", subsample=0.02,
                                          cache_dir=str(tmp_path)), 6, seed=1)
    assert info.path != legacy.path
    # blocks: clients 0-1 hold classes 0 and 1 (block ceil(6 / 10 * 2) = 2), ...; 0 elsewhere
    held = [set(np.flatnonzero(row)) for row in info.class_counts]
    assert held == [{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}]


def test_partition_seed_fixes_the_split_across_training_seeds(tmp_path):
    """PFLlib draws one split (seed 1) and reuses it for every repetition: data.partition_seed=1
    with seed=0 gives seed 1's split, and a different experiment than seed=0 alone."""
    from htfl_dist.data import load_client_split

    def counts(*overrides):
        config = load_config(SMOKE_CONFIG, [f"data.cache_dir={tmp_path}", "data.partition_rules=pfllib", *overrides])
        info = prepare_partition(config.data, config.num_clients, config.seed,
                                 batch_size=config.train.batch_size)
        return config, info.class_counts.tolist(), load_client_split(info.path, 0).train_y.tolist()

    fixed, fixed_counts, fixed_labels = counts("seed=0", "data.partition_seed=1")
    _, seeded_counts, seeded_labels = counts("seed=1")
    plain, plain_counts, _ = counts("seed=0")
    assert (fixed_counts, fixed_labels) == (seeded_counts, seeded_labels)
    assert plain_counts != fixed_counts
    assert fixed.config_hash() != plain.config_hash()  # a different experiment
    assert "partition_seed" not in load_config(SMOKE_CONFIG, []).experiment()["data"]  # old hashes kept
