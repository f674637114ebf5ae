"""``eval.test_set=global`` (issue 47 item 2, FedNH's protocol): every tested client's model on the
union of the N clients' test splits. The union by hand from the cache, a run's rows (every client
tested on the same samples, test_acc their mean), the hash, and world-size invariance."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import SMOKE, run_smoke
from htfl_dist.data.cache import load_client_splits, load_test_union
from htfl_dist.resolution import resolved_config
from htfl_dist.runtime import evaluation
from htfl_dist.runtime.evaluation import class_weighted_accuracies
from htfl_dist.runtime.simulate import simulate

GLOBAL = ("eval.test_set=global",)


def _per_client(out):
    return [json.loads(line) for line in (out / "per_client.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_every_client_is_tested_on_the_union_of_the_test_splits(tmp_path, cache_dir):
    rows = simulate(SMOKE, [f"data.cache_dir={cache_dir}", "rounds=2", *GLOBAL], out=tmp_path / "global")
    local = simulate(SMOKE, [f"data.cache_dir={cache_dir}", "rounds=2"], out=tmp_path / "local")
    per_client, per_client_local = _per_client(tmp_path / "global"), _per_client(tmp_path / "local")
    union = sum(per_client_local[0]["test_samples"])  # the six local splits, each once
    for row in per_client:
        assert row["test_samples"] == [union] * 6
    for row, clients in zip(rows, per_client, strict=True):  # equal samples: the pooled figure is the mean
        assert row["test_acc"] == pytest.approx(sum(clients["test_acc"]) / 6)
    assert rows[-1]["train_loss"] == local[-1]["train_loss"]  # training does not change, only the test
    assert [row["test_acc"] for row in rows] != [row["test_acc"] for row in local]
    for row, clients in zip(rows, per_client, strict=True):  # FedNH's weightings: a plain mean over clients
        for weighting in ("validclass", "labeldist"):
            figures = clients[f"test_acc_{weighting}"]
            assert len(figures) == 6 and all(0 <= f <= 1 for f in figures)
            assert row[f"test_acc_{weighting}"] == pytest.approx(sum(figures) / 6)
    assert "test_acc_validclass" not in local[-1] and "test_acc_labeldist" not in per_client_local[-1]


def test_fednh_weightings_by_hand():
    # hits [3, 0, 2] of tested [4, 2, 5]; trained on classes 0 and 2 only, 10 and 30 samples
    hits, tested, trained = torch.tensor([3, 0, 2]), torch.tensor([4, 2, 5]), torch.tensor([10, 0, 30])
    validclass, labeldist = class_weighted_accuracies(hits, tested, trained)
    assert validclass == pytest.approx(5 / 9)  # (3 + 2) / (4 + 5)
    assert labeldist == pytest.approx((0.25 * 3 + 0.75 * 2) / (0.25 * 4 + 0.75 * 5))
    # trained only on a class nobody tests: both undefined
    assert all(math.isnan(v) for v in class_weighted_accuracies(hits, torch.tensor([4, 0, 5]),
                                                               torch.tensor([0, 7, 0])))


class _AlwaysClassZero:
    """A model and algorithm that predict class 0 for every sample."""

    def forward_with_features(self, x):
        return x, torch.tensor([[1.0, 0.0, 0.0]]).repeat(x.shape[0], 1)

    def eval(self):
        return self

    def prepare_evaluation(self, client, knowledge):
        pass

    def predict(self, client, knowledge, features, logits, x):
        return logits.argmax(dim=1)

    def head_predict(self, client, logits):
        return logits.argmax(dim=1)


def test_a_clients_row_carries_its_weighted_accuracies():
    stub = _AlwaysClassZero()
    client = SimpleNamespace(model=stub, test_x=torch.zeros(5, 2), test_y=torch.tensor([0, 0, 1, 2, 2]),
                             train_y=torch.tensor([0, 0, 0, 2]))
    correct, correct_head, samples, _, validclass, labeldist = evaluation.test_client(stub, client, {}, 3)
    assert (correct, correct_head, samples) == (2, 2, 5)
    assert validclass == pytest.approx(2 / 4)  # classes 0 and 2: 2 hits of 4
    assert labeldist == pytest.approx(0.75 * 2 / (0.75 * 2 + 0.25 * 2))


def test_the_union_is_the_test_splits_in_client_order(tmp_path, cache_dir):
    from htfl_dist.data.prepare import prepare_partition

    config = resolved_config(str(SMOKE), [f"data.cache_dir={cache_dir}"])
    info = prepare_partition(config.data, config.num_clients, config.seed)
    x, y = load_test_union(info.path, [2, 0, 1])  # any order asked: client-id order given
    splits = load_client_splits(info.path, [0, 1, 2])
    assert torch.equal(y, torch.cat([split.test_y for split in splits]))
    assert torch.equal(x, torch.cat([split.test_x for split in splits]))


def test_the_global_test_set_is_another_experiment():
    assert "eval" not in resolved_config(None, []).experiment()
    assert resolved_config(None, list(GLOBAL)).experiment()["eval"]["test_set"] == "global"


@pytest.mark.launch
def test_three_ranks_test_on_the_global_set_as_one_process(tmp_path, cache_dir):
    single = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *GLOBAL], out=tmp_path / "single")
    rows = run_smoke("torchrun", 3, tmp_path / "ranks", cache_dir, *GLOBAL)
    assert [row["test_acc"] for row in rows] == [row["test_acc"] for row in single]
