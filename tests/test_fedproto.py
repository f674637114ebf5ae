"""FedProto maths: client prototypes, server aggregation (missing classes), regulariser, inference."""
from __future__ import annotations

import pytest
import torch

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.class_rows import class_prototypes, global_prototype_diagnostics
from htfl_dist.algorithms.fedproto import dense_prototypes, prototype_regulariser
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import build_model
from htfl_dist.runtime.screening import screen_uploads
from htfl_dist.seeding import torch_generator

C, K = 5, 8


def _context(**options):
    entry = get_algorithm("fedproto")
    return entry, AlgorithmContext(num_classes=C, feature_dim=K, seed=0, train=TrainConfig(),
                                   options=parse_options(entry, options))


def _client(labels: list[int]) -> ClientState:
    torch.manual_seed(0)
    model = build_model("htcnn1", num_classes=C, feature_dim=K, in_channels=1, image_size=28)
    y = torch.tensor(labels)
    x = torch.randn(len(labels), 1, 28, 28)
    return ClientState(0, "htcnn1", model, torch.optim.SGD(model.parameters(), lr=0.01),
                       x, y, x[:2], y[:2], torch.device("cpu"))


def test_client_prototypes_are_class_means_of_features():
    client = _client([0, 0, 3, 3, 3, 1])
    class_ids, protos = class_prototypes(client, C, batch_size=4)  # batches straddle classes
    assert class_ids.tolist() == [0, 1, 3]  # only the classes held, no rows for 2 and 4
    client.model.eval()
    with torch.no_grad():
        features = client.model.features(client.train_x)
    for row, c in enumerate(class_ids.tolist()):
        torch.testing.assert_close(protos[row], features[client.train_y == c].mean(0))


def test_server_mean_with_missing_classes():
    entry, context = _context()
    server = entry.server(context)
    uploads = {
        4: {"class_ids": torch.tensor([0, 2]), "protos": torch.tensor([[2.0] * K, [4.0] * K])},
        1: {"class_ids": torch.tensor([2]), "protos": torch.tensor([[8.0] * K])},
    }
    server.update(uploads, round_index=0, generator=torch_generator(0, "s"))
    download = server.download()
    assert download["class_ids"].tolist() == [0, 2]  # 1, 3, 4: nobody holds them -> absent
    torch.testing.assert_close(download["protos"][0], torch.full((K,), 2.0))
    torch.testing.assert_close(download["protos"][1], torch.full((K,), 6.0))  # unweighted mean


def test_server_weighted_mean_uses_counts():
    entry, context = _context(weighted=True)
    assert [f.name for f in entry.client.upload_fields(context)] == ["class_ids", "protos", "counts"]
    server = entry.server(context)
    server.update({
        0: {"class_ids": torch.tensor([1]), "protos": torch.ones(1, K), "counts": torch.tensor([3])},
        1: {"class_ids": torch.tensor([1]), "protos": torch.full((1, K), 5.0), "counts": torch.tensor([1])},
    }, round_index=0, generator=torch_generator(0, "s"))
    torch.testing.assert_close(server.download()["protos"][0], torch.full((K,), 2.0))


@pytest.mark.parametrize("bad,match", [
    ({"class_ids": torch.tensor([7]), "protos": torch.ones(1, K)}, "outside"),
    ({"class_ids": torch.tensor([1, 1]), "protos": torch.ones(2, K)}, "twice"),
    ({"class_ids": torch.tensor([1]), "protos": torch.full((1, K), float("nan"))}, "NaN"),
])
def test_bad_uploads_are_skipped_or_fail(bad, match):
    entry, context = _context()
    server = entry.server(context)
    good = {"class_ids": torch.tensor([1]), "protos": torch.ones(1, K)}
    kept, skipped = screen_uploads({2: good, 3: bad}, server.validate_upload, "skip", round_number=1)
    assert list(kept) == [2] and skipped == [3]
    with pytest.raises(ProtocolError, match=match):
        screen_uploads({2: good, 3: bad}, server.validate_upload, "fail", round_number=1)


def test_regulariser_forms():
    _, paper = _context()
    _, reference = _context(client_reg="htfllib")
    assert paper.options.reg_weight == 0.1 and reference.options.reg_weight == 10.0
    table, available = dense_prototypes(
        {"class_ids": torch.tensor([0]), "protos": torch.zeros(1, K)}, C, torch.device("cpu"))
    features = torch.tensor([[3.0, 4.0] + [0.0] * (K - 2), [1.0, 0.0] + [0.0] * (K - 2), [9.0] * K])
    labels = torch.tensor([0, 0, 2])  # class 2 has no global prototype: contributes nothing
    # paper: distance of the batch's class-0 mean (2, 2, 0...) to the zero prototype
    expected = 0.1 * torch.tensor([2.0, 2.0]).norm()
    torch.testing.assert_close(prototype_regulariser(paper.options, features, labels, table, available), expected)
    # HtFLlib: MSE over batch × K against P̂^y, the class-2 row compared with itself
    expected_mse = 10.0 * (9 + 16 + 1) / (3 * K)
    torch.testing.assert_close(
        prototype_regulariser(reference.options, features, labels, table, available), torch.tensor(expected_mse))


def test_prototype_inference_is_nearest_global_prototype():
    entry, context = _context()
    client_algorithm = entry.client(context)
    knowledge = {"class_ids": torch.tensor([1, 4]), "protos": torch.stack([torch.zeros(K), torch.ones(K)])}
    features = torch.stack([torch.full((K,), 0.2), torch.full((K,), 0.9)])
    predicted = client_algorithm.predict(None, knowledge, features, torch.zeros(2, C))
    assert predicted.tolist() == [1, 4]


def test_training_round_uploads_rows_only_for_held_classes():
    entry, context = _context()
    client = _client([0, 0, 3, 3, 3, 1, 1, 0, 3, 1, 0, 0])
    result = entry.client(context).train(client, {"class_ids": torch.empty(0, dtype=torch.int64),
                                                  "protos": torch.empty(0, K)}, 0, torch_generator(0, "t"))
    assert result.upload["class_ids"].tolist() == [0, 1, 3]
    assert result.upload["protos"].shape == (3, K)
    assert result.samples == 12 and result.loss_sum > 0


def test_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match=r"algo\.lamda"):
        _context(lamda=1.0)


def test_paper_regulariser_gradient_is_finite_at_zero_distance():
    _, paper = _context()
    table, available = dense_prototypes(
        {"class_ids": torch.tensor([0]), "protos": torch.zeros(1, K)}, C, torch.device("cpu"))
    features = torch.zeros(2, K, requires_grad=True)
    prototype_regulariser(paper.options, features, torch.tensor([0, 0]), table, available).backward()
    assert torch.isfinite(features.grad).all()


def test_prototypes_during_training_average_the_features_seen():
    entry, context = _context(proto_from="during_training")
    client = _client([0, 0, 3, 3, 3, 1, 1, 0, 3, 1, 0, 0])
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, K)}
    result = entry.client(context).train(client, empty, 0, torch_generator(0, "t"))
    assert result.upload["class_ids"].tolist() == [0, 1, 3]
    assert torch.isfinite(result.upload["protos"]).all()


def test_global_prototype_diagnostics_by_hand():
    """Upload fit and drift on a 2-d example: a class without a global prototype is left out,
    a drift is measured only on classes present in both rounds."""
    uploads = {
        0: {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[1.0, 0.0], [9.0, 9.0]])},
        1: {"class_ids": torch.tensor([2]), "protos": torch.tensor([[1.0, 0.0]])},
    }
    current = {"class_ids": torch.tensor([0, 2]), "protos": torch.tensor([[0.0, 0.0], [4.0, 0.0]])}
    previous = {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[0.0, 1.0], [5.0, 5.0]])}
    nothing = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}
    got = global_prototype_diagnostics(uploads, 3, current, previous)
    assert got["upload_to_global"] == pytest.approx((1.0 + 3.0) / 2)  # class 1 has no P̂: excluded
    assert got["upload_nearest_own"] == pytest.approx(0.5)  # class 2's row is nearer P̂^0
    assert got["proto_drift"] == pytest.approx(1.0)  # only class 0 is in both rounds
    assert "proto_drift" not in global_prototype_diagnostics(uploads, 3, current, nothing)
    assert global_prototype_diagnostics(uploads, 3, nothing, nothing) == {}


def test_server_reports_drift_from_the_second_round():
    entry, context = _context()
    server = entry.server(context)
    upload = {"class_ids": torch.tensor([0, 1]), "protos": torch.ones(2, K)}
    first = server.update({0: upload}, 0, torch_generator(0, "t"))
    assert "proto_drift" not in first and first["upload_to_global"] == pytest.approx(0.0)
    moved = {"class_ids": torch.tensor([0]), "protos": torch.ones(1, K) * 3}
    second = server.update({0: moved}, 1, torch_generator(0, "t"))
    assert second["proto_drift"] == pytest.approx(2.0 * K ** 0.5)


def test_round_with_no_surviving_upload_keeps_the_global_prototypes():
    """Every upload screened out: the server keeps last round's prototypes rather than
    replacing them with none (which would make every prediction -1)."""
    entry, context = _context()
    server = entry.server(context)
    assert server.update({}, 0, torch_generator(0, "t")) == {}  # before any round, too
    server.update({0: {"class_ids": torch.tensor([0, 2]), "protos": torch.ones(2, K)}}, 1, torch_generator(0, "t"))
    before = server.download()
    assert server.update({}, 2, torch_generator(0, "t")) == {}
    after = server.download()
    assert after["class_ids"].tolist() == [0, 2]
    torch.testing.assert_close(after["protos"], before["protos"], rtol=0, atol=0)
    assert server.theory_download_floats() == K * C  # all C classes count, present or not
