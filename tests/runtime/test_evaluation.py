"""The evaluation metric of the round loop, by hand: a real ``Federation`` (one process, local
transport) whose data and models are replaced by tiny hand-made clients.

test_acc is pooled over clients (Σ correct / Σ samples), test_acc_std is the population std of
the per-client accuracies, test_acc_head uses the head's argmax, and every client (participant
or not) is evaluated in eval mode with the knowledge after this round's server update.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import SMOKE, read_metrics
from htfl_dist.algorithms import ClientState
from htfl_dist.config import load_config
from htfl_dist.models import InputSpec, SplitModel
from htfl_dist.runtime import session as session_module
from htfl_dist.runtime.evaluation import evaluate_clients
from htfl_dist.runtime.loop import Federation, RunContext, start
from htfl_dist.runtime.placement import sample_participants
from htfl_dist.runtime.startup import ClientFactory
from htfl_dist.runtime.transport import LocalTransport

NUM_CLIENTS = 4

TRAIN_X = [[-1.0, -1.0], [-1.0, 1.0], [1.0, -1.0], [1.0, 1.0]]
TRAIN_Y = [0, 0, 1, 1]
"""Every client's training split: class means (−1, 0) and (1, 0), so whoever participates,
FedProto's global prototypes are P̂^0 = (−1, 0) and P̂^1 = (1, 0): the nearest one is class 1
exactly when the first feature is positive."""

TEST_SPLITS = {  # client: (first features of x, labels); the second feature alternates ±1
    0: ([-2.0, -1.0, 3.0, 5.0], [0, 0, 0, 1]),  # predicted 0 0 1 1: 3 of 4 right
    1: ([1.0, 2.0, 3.0, 6.0, 7.0, 11.0], [0, 0, 0, 0, 0, 1]),  # all predicted 1: 1 of 6
    2: ([-3.0, 4.0], [0, 1]),  # 2 of 2
    3: ([2.0, -2.0, 4.0, -4.0], [0, 1, 0, 1]),  # all wrong: 0 of 4
}
"""Per-client accuracy 3/4, 1/6, 1, 0 (mean 23/48); pooled 6/16. The zero head predicts class 0
everywhere: 3 + 5 + 1 + 2 = 11 of 16. Client 1's first features are all positive: a BatchNorm in
train mode would centre them on their mean 5 and turn 1, 2, 3 into class 0."""


def _client(client_id: int) -> ClientState:
    """BatchNorm extractor, the identity up to 1/√(1 + eps) in eval mode (running statistics
    0 and 1, kept by momentum 0); a zero head; an optimizer that holds none of the model's
    parameters (the round loop sets the round's lr on it), so nothing trains."""
    extractor = nn.BatchNorm1d(2, momentum=0.0)
    head = nn.Linear(2, 2)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = SplitModel(extractor, head, feature_dim=2)
    first, labels = TEST_SPLITS[client_id]
    test_x = torch.tensor([[value, (-1.0) ** index] for index, value in enumerate(first)])
    return ClientState(client_id, "tiny", model, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0),
                       torch.tensor(TRAIN_X), torch.tensor(TRAIN_Y), test_x, torch.tensor(labels),
                       torch.device("cpu"))


def _federation(monkeypatch, out, *overrides: str) -> Federation:
    """FedProto, 4 clients, half of them training in each round."""
    partition = SimpleNamespace(num_classes=2, in_channels=1, image_size=1, path=None,
                                inputs=lambda: InputSpec.image(1, 1),
                                class_counts=np.ones((NUM_CLIENTS, 2), dtype=np.int64))
    monkeypatch.setattr(session_module, "prepare_data", lambda config, transport: partition)
    monkeypatch.setattr(ClientFactory, "build", lambda self, client_id, shell=False: _client(client_id))
    monkeypatch.setattr(ClientFactory, "load_splits", lambda self, client_ids: None)  # the clients hold their data
    config = load_config(SMOKE, ["algorithm=fedproto", "rounds=1", f"num_clients={NUM_CLIENTS}",
                                 "join_ratio=0.5", "model.feature_dim=2", *overrides])
    return start(RunContext(config, LocalTransport(), torch.device("cpu"), out))


@pytest.fixture
def federation(monkeypatch, tmp_path) -> Federation:
    return _federation(monkeypatch, tmp_path)


@pytest.mark.integration
def test_accuracy_is_pooled_over_all_clients_with_the_updated_knowledge(federation, tmp_path):
    """Round 1 starts with no global prototypes (every prediction would be −1, accuracy 0): the
    accuracies of TEST_SPLITS hold only with the prototypes the server made from this round's
    uploads, and only if all 4 clients are counted, though only 2 trained."""
    assert len(sample_participants(0, 0, NUM_CLIENTS, 0.5)) == 2
    federation.run()
    (row,) = read_metrics(tmp_path)
    assert row["test_acc"] == 6 / 16  # pooled, not the mean of the per-client accuracies (23/48)
    assert row["test_acc_head"] == 11 / 16
    # population std of 36/48, 8/48, 48/48, 0/48 around 23/48: √(13² + 15² + 25² + 23²) / 48 / √4
    assert row["test_acc_std"] == pytest.approx(math.sqrt(1548) / 96, rel=1e-12)
    expected = torch.tensor([[-1.0, 0.0], [1.0, 0.0]]) / math.sqrt(1.0 + 1e-5)  # eval-mode BatchNorm
    torch.testing.assert_close(federation.session.server.download()["protos"], expected)


@pytest.mark.integration
def test_every_client_is_evaluated_in_eval_mode_with_the_download(federation):
    """What each client reports: [correct by nearest prototype, correct by the head, samples, AUC,
    FedNH's validclass and labeldist accuracies]."""
    federation.run()
    session = federation.session
    rows = evaluate_clients(session.client_algorithm, session.clients, federation.knowledge(),
                            session.context.num_classes)
    # the zero head scores every (sample, class) pair alike: AUC 1/2 wherever it is defined; every
    # client trains on both classes alike, so FedNH's two weightings give the plain accuracy
    assert rows == {0: [3.0, 3.0, 4.0, 0.5, 3 / 4, 3 / 4], 1: [1.0, 5.0, 6.0, 0.5, 1 / 6, 1 / 6],
                    2: [2.0, 1.0, 2.0, 0.5, 1.0, 1.0], 3: [0.0, 2.0, 4.0, 0.5, 0.0, 0.0]}


@pytest.mark.integration
def test_a_round_without_evaluation_still_hands_its_knowledge_to_the_next(monkeypatch, tmp_path):
    """eval_every = 2: round 1 ends without the broadcast that evaluation does, yet round 2's
    participants must train towards the prototypes of round 1, not the empty round-0 download."""
    federation = _federation(monkeypatch, tmp_path, "rounds=2", "eval_every=2")
    seen = {}
    train = federation.session.client_algorithm.train

    def recording_train(client, knowledge, round_index, generator):
        seen[round_index] = knowledge["class_ids"].tolist()
        return train(client, knowledge, round_index, generator)

    monkeypatch.setattr(federation.session.client_algorithm, "train", recording_train)
    federation.run()
    assert seen == {0: [], 1: [0, 1]}
    assert [row["round"] for row in read_metrics(tmp_path)] == [2]


@pytest.mark.integration
def test_a_rank_uploading_for_a_client_it_does_not_host_is_left_out(monkeypatch, tmp_path, capsys):
    """The message of rank 0 (the only rank) claims client 999 instead of its participants: with
    on_bad_upload=skip the round goes on without them, named in a warning and in the row;
    with fail the job ends with that line."""
    from htfl_dist.errors import NothingAggregated, ProtocolError
    from htfl_dist.runtime import exchange as exchange_module

    def forge_uploads(federation: Federation) -> None:
        """The uploads that reach rank 0 are the forged ones; other messages pass through. In one
        process they are handed over, not sent (``wire.pass_within_process``): what it hands over is forged."""
        forged = {999: {"class_ids": torch.tensor([0]), "protos": torch.zeros(1, 2)}}
        gather_uploads, uploading = federation.session.exchange.gather_uploads, []
        passed = exchange_module.pass_within_process

        def uploads_then_flag(*args):
            uploading.append(True)
            try:
                return gather_uploads(*args)
            finally:
                uploading.clear()

        monkeypatch.setattr(exchange_module, "pass_within_process",
                            lambda spec, entries, device="cpu", owned=False:
                            passed(spec, forged if uploading else entries, device, owned))
        monkeypatch.setattr(federation.session.exchange, "gather_uploads", uploads_then_flag)

    federation = _federation(monkeypatch, tmp_path)
    assert [field.name for field in federation.session.upload_spec] == ["class_ids", "protos"]
    forge_uploads(federation)

    def no_server_step(*args):
        raise AssertionError("the server step ran on a round whose uploads were all screened out")

    monkeypatch.setattr(federation.session.rank0_server, "update", no_server_step)  # the loop keeps the round
    before = federation.session.rank0_server.download()
    with pytest.raises(NothingAggregated):  # its only round aggregated nothing: said after the rows
        federation.run()
    participants = sample_participants(0, 0, NUM_CLIENTS, 0.5)
    (row,) = read_metrics(tmp_path)
    assert row["skipped_clients"] == participants and row.get("server_skipped") is True
    for key, tensor in federation.session.rank0_server.download().items():
        assert torch.equal(tensor, before[key]), key
    assert f"left out rank 0 (clients [0, 1, 2, 3])'s clients {participants}" in capsys.readouterr().err
    strict = _federation(monkeypatch, tmp_path / "strict", "on_bad_upload=fail")
    forge_uploads(strict)
    with pytest.raises(ProtocolError, match=r"^rank 0 \(clients \[0, 1, 2, 3\]\) sent uploads for clients \[999\]"):
        strict.run()
