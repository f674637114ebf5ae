"""Unseen clients (``eval.new_clients``): where they live, how their rows are pooled apart from the
federation's, the config identity, and in whole runs that they never feed the federation, that
their fine-tuning counts and that any world size gives their figures."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import SMOKE, maths_only, run_smoke
from htfl_dist.config import load_config
from htfl_dist.runtime.exchange import RoundReports
from htfl_dist.runtime.placement import Placement
from htfl_dist.runtime.records import RoundOutcome, per_client_row, pooled_columns, set_unseen_apart


def _report(correct, head, samples, auc):
    return {"eval": torch.tensor([[correct, head, samples, auc]], dtype=torch.float64),
            "train": torch.empty(0, 2, dtype=torch.float64)}


def test_unseen_clients_follow_the_federation_ids_and_take_the_client_ranks_in_turn():
    three = Placement.round_robin(3, 4).with_unseen(3)
    assert three.unseen_of(1) == [4, 6] and three.unseen_of(2) == [5] and three.unseen_of(0) == []
    assert three.clients_of(1) == [0, 2]  # the federation's placement is untouched
    alone = Placement.round_robin(1, 4).with_unseen(2)
    assert alone.unseen_of(0) == [4, 5]
    assert Placement.round_robin(3, 4).unseen_of(1) == []


def test_unseen_rows_are_pooled_apart_from_the_federation():
    outcome = RoundOutcome(0, [0, 1], evaluated=True)
    outcome.reports = RoundReports({0: _report(5, 5, 10, 0.9), 1: _report(1, 1, 10, 0.5),
                                    2: _report(3, 4, 10, 0.8), 3: _report(1, 2, 5, math.nan)}, [])
    unseen = set_unseen_apart(outcome, num_clients=2)
    assert sorted(unseen) == [2, 3] and sorted(outcome.reports.clients) == [0, 1]
    columns = pooled_columns(unseen, "new_client")
    assert columns["new_client_acc"] == pytest.approx(4 / 15)  # Σ correct / Σ samples
    assert columns["new_client_acc_head"] == pytest.approx(6 / 15)
    assert columns["new_client_acc_std"] == pytest.approx(0.05)  # accuracies 0.3 and 0.2
    assert columns["new_client_auc"] == pytest.approx(0.8)  # client 3's AUC is undefined
    assert columns["new_client_acc_worst10"] == pytest.approx(0.2)  # the worse of the two
    row = per_client_row(outcome, unseen)
    assert row["clients"] == [0, 1] and row["test_acc"] == [0.5, 0.1]
    assert row["new_clients"] == [2, 3] and row["new_client_acc"] == pytest.approx([0.3, 0.2])
    assert row["new_client_samples"] == [10, 5] and row["new_client_auc"][1] is None


def test_unseen_clients_are_part_of_the_experiment_only_when_asked_for():
    plain = load_config(SMOKE, [])
    assert load_config(SMOKE, ["eval.new_client_epochs=1"]).config_hash() == plain.config_hash()
    assert load_config(SMOKE, ["eval.new_clients=2"]).config_hash() != plain.config_hash()
    assert load_config(SMOKE, ["eval.new_clients=2", "eval.new_client_epochs=3"]).config_hash() != \
        load_config(SMOKE, ["eval.new_clients=2"]).config_hash()


@pytest.mark.integration
def test_unseen_clients_never_feed_the_federation_and_their_fine_tuning_counts(tmp_path, cache_dir):
    one = run_smoke("single", 1, tmp_path / "one", cache_dir, "eval.new_clients=2", "rounds=2")
    three = run_smoke("single", 1, tmp_path / "three", cache_dir, "eval.new_clients=2", "rounds=2",
                      "eval.new_client_epochs=3")
    federation = ("test_acc", "test_acc_head", "train_loss", "test_auc")
    assert [[r[k] for k in federation] for r in one] == [[r[k] for k in federation] for r in three]
    assert [r["new_client_auc"] for r in one] != [r["new_client_auc"] for r in three]
    for row in one:
        assert 0 <= row["new_client_acc"] <= 1 and 0 <= row["new_client_acc_head"] <= 1


@pytest.mark.launch
def test_unseen_clients_give_the_same_figures_on_any_world_size(tmp_path, cache_dir):
    overrides = ("eval.new_clients=3", "rounds=2")
    alone = run_smoke("single", 1, tmp_path / "alone", cache_dir, *overrides)
    spread = run_smoke("torchrun", 3, tmp_path / "spread", cache_dir, *overrides)
    assert "new_client_acc" in alone[0]
    assert maths_only(alone) == maths_only(spread)


def test_an_unseen_client_fine_tunes_its_epochs_at_the_base_rate_whatever_the_schedule():
    """At the last round of a cosine run the federation's clients train at about lr_min; a
    newcomer fine-tunes at train.lr, for eval.new_client_epochs epochs (PFLlib's new clients)."""
    import dataclasses

    from helpers import make_client, make_context

    from htfl_dist.runtime.evaluation import UnseenClients

    config = load_config(SMOKE, ["algorithm=local", "train.lr_schedule=cosine", "train.lr=0.05", "rounds=20",
                                 "eval.new_clients=1", "eval.new_client_epochs=3"])
    entry, context = make_context("local", num_classes=3, feature_dim=4, batch_size=3)
    context = dataclasses.replace(context, train=config.train)
    unseen = UnseenClients(config, context, entry.client, partition=None, client_ids=[6])
    client = make_client(unseen.algorithm.context, client_id=6, samples=9)
    steps = []
    client.optimizer.step = lambda *a, _step=client.optimizer.step, **k: (steps.append(1), _step(*a, **k))[1]
    unseen.fine_tune(client, {}, round_index=19)
    assert client.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert len(steps) == 3 * math.ceil(9 / 10)  # 3 epochs of one batch (train.batch_size=10)
