"""Testing a client on its test split, and the unseen clients (``eval.new_clients``) that the
round loop tests beside the federation's.

An unseen client is PFLlib's "new client": its data come from the same partition, but it never
takes part in a round and never uploads. On each evaluation round it starts again from its
initial model, receives that round's download, trains ``eval.new_client_epochs`` local epochs with
the algorithm's own client step, and is tested. Starting again each time makes its figure a
function of that round's knowledge alone (not of earlier fine-tuning), and keeps nothing to
checkpoint. Its streams are keyed by its own client id (N..N+M−1) and the round, like every
client's, so any world size gives the same figure.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any

import torch

from htfl_dist.algorithms import AlgorithmContext, ClientAlgorithm, ClientState
from htfl_dist.algorithms.interface import seed_training
from htfl_dist.algorithms.optimizers import begin_local_training
from htfl_dist.config import Config
from htfl_dist.metrics.auc import micro_auc
from htfl_dist.payload import Payload
from htfl_dist.runtime.client_store import ClientStore
from htfl_dist.runtime.startup import ClientFactory
from htfl_dist.seeding import torch_generator

TEST_CHUNK = 1000
"""Test samples per forward pass."""


@torch.no_grad()
def test_client(algorithm: ClientAlgorithm, client: ClientState, knowledge: Payload, num_classes: int
                ) -> list[float]:
    """``client`` on its test split, in eval mode, with ``knowledge``: [correct by the algorithm's
    rule, correct by the head, samples, the head's AUC (NaN where undefined), then FedNH's two
    class-weighted accuracies (:func:`class_weighted_accuracies`)]."""
    algorithm.prepare_evaluation(client, knowledge)
    client.model.eval()
    correct = correct_head = 0
    scores = []
    hits_by_class = torch.zeros(num_classes, dtype=torch.float64, device=client.test_y.device)
    for start in range(0, client.test_y.shape[0], TEST_CHUNK):
        x, y = client.test_x[start : start + TEST_CHUNK], client.test_y[start : start + TEST_CHUNK]
        features, logits = client.model.forward_with_features(x)
        predicted = algorithm.predict(client, knowledge, features, logits, x)
        correct += int((predicted == y).sum())
        hits_by_class += torch.bincount(y, weights=(predicted == y).double(), minlength=num_classes)  # no mask: no sync
        correct_head += int((algorithm.head_predict(client, logits) == y).sum())
        scores.append(logits)
    return [float(correct), float(correct_head), float(client.test_y.shape[0]),
            head_auc(scores, client.test_y, num_classes),
            *class_weighted_accuracies(hits_by_class.cpu(), torch.bincount(client.test_y, minlength=num_classes).cpu(),
                                       torch.bincount(client.train_y, minlength=num_classes).cpu())]


def class_weighted_accuracies(hits: torch.Tensor, tested: torch.Tensor, trained: torch.Tensor) -> tuple[float, float]:
    """FedNH's two class-weighted test accuracies of one client (Yutong-Dai/FedNH@60c3161,
    ``src/flbase/strategies/FedAvg.py:FedAvgClient.testing``, ``weight_per_class_dict``):
    ``validclass``, Σ hits / Σ tested over the classes the client trains on, and ``labeldist``,
    Σ_c p_c·hits_c / Σ_c p_c·tested_c with p the client's training label distribution. On the
    global test set they score a personalised model on the classes it is meant to know (the
    FedNH paper's argument against a per-client split's imbalance). NaN where a weight sums to 0
    over the tested samples. ``hits``, ``tested``, ``trained``: counts per class."""
    hits, tested, trained = hits.double(), tested.double(), trained.double()
    valid = (trained > 0).double()
    share = trained / trained.sum() if float(trained.sum()) > 0 else trained

    def ratio(weights: torch.Tensor) -> float:
        denominator = float((weights * tested).sum())
        return float((weights * hits).sum()) / denominator if denominator > 0 else math.nan
    return ratio(valid), ratio(share)


def evaluate_clients(algorithm: ClientAlgorithm, clients: ClientStore, knowledge: Payload, num_classes: int,
                     tested: Collection[int] | None = None, installs_knowledge: bool = True
                     ) -> dict[int, list[float]]:
    """Every client of a rank's store (or those of them in ``tested``) on its test split, in eval
    mode, with ``knowledge``: :func:`test_client`'s row per client. Without
    ``installs_knowledge`` (the algorithm's evaluation only reads a client) parked clients are
    peeked at, not brought back."""
    rows = {}
    for client_id in clients:
        if tested is not None and client_id not in tested:
            continue
        client = clients[client_id] if installs_knowledge else clients.peek(client_id)
        rows[client_id] = test_client(algorithm, client, knowledge, num_classes)
        clients.finished_with([client_id])
    return rows


def head_auc(scores: list[Any], labels: torch.Tensor, num_classes: int) -> float:
    """HtFLlib's AUC of a client's test split from its head's raw outputs (NaN where the head's
    outputs are not one score per class, or the split has a single class)."""
    if not scores or not all(isinstance(s, torch.Tensor) and s.dim() == 2 and s.shape[1] == num_classes
                             for s in scores):
        return math.nan
    return micro_auc(torch.cat(scores).cpu(), labels.cpu(), num_classes)


class UnseenClients:
    """This rank's unseen clients: built afresh, fine-tuned on the round's download and tested,
    one at a time (so they hold no memory between evaluations)."""

    def __init__(self, config: Config, context: AlgorithmContext, client_type: type[ClientAlgorithm],
                 partition: Any, client_ids: list[int]) -> None:
        self.config = config
        # a newcomer fine-tunes at train.lr, as PFLlib's new clients do: the federation's schedule
        # (which reaches ~0 at the end of a cosine run) is not its own
        self.train = dataclasses.replace(config.train, local_epochs=config.eval.new_client_epochs,
                                         lr_schedule="constant")
        self.algorithm = client_type(dataclasses.replace(context, train=self.train))
        # built like the federation's clients, without a privacy ledger: they release nothing
        self.build = ClientFactory(config, partition, context.device, self.algorithm, privacy_plan=None).build
        self.client_ids = client_ids
        self.num_classes = context.num_classes

    def evaluate(self, knowledge: Payload, round_index: int) -> dict[int, list[float]]:
        """Each unseen client's test row after fine-tuning on ``knowledge`` in round ``round_index``."""
        rows = {}
        for client_id in self.client_ids:
            client = self.build(client_id)
            self.fine_tune(client, knowledge, round_index)
            rows[client_id] = test_client(self.algorithm, client, knowledge, self.num_classes)
        return rows

    def fine_tune(self, client: ClientState, knowledge: Payload, round_index: int) -> None:
        seed = self.config.seed
        begin_local_training([client], self.train, round_index, self.config.rounds)
        seed_training(seed, client.client_id, round_index)
        self.algorithm.train(client, knowledge, round_index, torch_generator(seed, "batches", client.client_id,
                                                                             round_index))
