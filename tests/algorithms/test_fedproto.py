"""FedProto maths: client prototypes, server aggregation (missing classes), regulariser, inference."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_identity_client
from torch import nn

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


def test_download_holds_the_uploaded_classes_only():
    """(A round whose uploads were all screened out never reaches the server: the loop keeps the
    knowledge, tests/runtime/test_evaluation.py.)"""
    entry, context = _context()
    server = entry.server(context)
    server.update({0: {"class_ids": torch.tensor([0, 2]), "protos": torch.ones(2, K)}}, 1, torch_generator(0, "t"))
    after = server.download()
    assert after["class_ids"].tolist() == [0, 2]
    torch.testing.assert_close(after["protos"], torch.ones(2, K), rtol=0, atol=0)
    assert server.theory_download_floats() == K * C  # all C classes count, present or not


# --------------------------------------------------------------- the client's train(), by hand
# FedTGP's clients are FedProto's (PrototypeClient): every test below runs for both.

def _tiny_context(algorithm, num_classes=2, local_epochs=1, **options):
    """K = 2; batches of 10 (every tiny split below is one batch)."""
    entry = get_algorithm(algorithm)
    context = AlgorithmContext(num_classes=num_classes, feature_dim=2, seed=0,
                               train=TrainConfig(batch_size=10, local_epochs=local_epochs),
                               options=parse_options(entry, options))
    return entry.client(context)


def _identity_linear() -> nn.Linear:
    extractor = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        extractor.weight.copy_(torch.eye(2))
    return extractor


def _knowledge(class_ids, protos) -> dict:
    return {"class_ids": torch.tensor(class_ids), "protos": torch.tensor(protos)}


NO_KNOWLEDGE = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp"])
@pytest.mark.parametrize("client_reg,regulariser", [
    ("paper", 0.1 * (5.0 + 2.0) / 2),  # λ · mean over the batch's 2 classes of ‖P_i^c − P̂^c‖
    ("htfllib", 10.0 * (25.0 + 4.0) / (2 * 2)),  # λ · MSE over 2 samples × K = 2
])
def test_client_loss_is_ce_plus_the_regulariser_by_hand(algorithm, client_reg, regulariser):
    """Identity features (3, 4) of class 0 and (0, 1) of class 1, zero head (CE = ln 3, C = 3),
    lr 0, one batch. P̂ = (0, 0), (0, −1) and (10, 0) for class 2, which the batch lacks:
    paper: ‖(3, 4)‖ = 5 and ‖(0, 2)‖ = 2, mean 3.5 (not the sum 7; class 2 adds nothing);
    htfllib: squared errors 25 + 4 over 4 entries. The reported loss is the batch mean × 2."""
    client = tiny_identity_client([[3.0, 4.0], [0.0, 1.0]], [0, 1], num_classes=3)
    knowledge = _knowledge([0, 1, 2], [[0.0, 0.0], [0.0, -1.0], [10.0, 0.0]])
    result = _tiny_context(algorithm, num_classes=3, client_reg=client_reg).train(
        client, knowledge, 1, torch_generator(0, "t"))
    assert result.samples == 2
    assert result.loss_sum / 2 == pytest.approx(math.log(3) + regulariser, rel=1e-6)


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp"])
def test_client_loss_without_knowledge_is_ce_only(algorithm):
    """Round 0 (nothing downloaded): zero head over C = 3 classes, CE = ln 3 exactly."""
    client = tiny_identity_client([[3.0, 4.0], [0.0, 1.0]], [0, 1], num_classes=3)
    result = _tiny_context(algorithm, num_classes=3).train(client, NO_KNOWLEDGE, 0, torch_generator(0, "t"))
    assert result.loss_sum / result.samples == pytest.approx(math.log(3), rel=1e-6)


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp"])
@pytest.mark.parametrize("proto_from,length", [
    ("pre_update", 5.0),  # before training: x itself
    ("during_training", (5.0 + 4.75) / 2),  # mean of the features of the 2 steps, each before its step
    ("post_update", 4.5),  # after both steps
])
def test_regulariser_trains_the_extractor_and_proto_from_picks_when_prototypes_are_taken(
        algorithm, proto_from, length):
    """One sample x = (3, 4) = 5·u of class 0, P̂^0 = (0, 0), extractor W = I (Linear, no bias),
    the head never trains, so the features move by the regulariser alone: λ‖Wx‖ has gradient
    λ·u·xᵀ in W, so one SGD step (lr η = 0.1, λ = 0.1) moves Wx by −ηλ‖x‖²·u = −0.25·u along u.
    Two local epochs: Wx = 5u → 4.75u → 4.5u; the upload is length·u for the source asked for.
    The loss is ln 2 + λ·5 then ln 2 + λ·4.75."""
    client = tiny_identity_client([[3.0, 4.0]], [0], extractor=_identity_linear(), lr=0.1)
    algorithm_client = _tiny_context(algorithm, local_epochs=2, proto_from=proto_from)
    result = algorithm_client.train(client, _knowledge([0], [[0.0, 0.0]]), 1, torch_generator(0, "t"))
    assert result.upload["class_ids"].tolist() == [0]
    torch.testing.assert_close(result.upload["protos"], torch.tensor([[0.6, 0.8]]) * length)
    assert result.loss_sum == pytest.approx(2 * math.log(2) + 0.1 * (5.0 + 4.75), rel=1e-6)


EPS = 1e-5  # BatchNorm's default


def _batchnorm_extractor() -> nn.BatchNorm1d:
    """x / √(1 + eps) in eval mode (running mean 0 and variance 1, which momentum 0 keeps);
    in train mode it standardises each batch, which moves every feature here."""
    return nn.BatchNorm1d(2, eps=EPS, momentum=0.0)


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp"])
@pytest.mark.parametrize("proto_from", ["pre_update", "post_update"])
def test_uploaded_prototypes_are_taken_in_eval_mode(algorithm, proto_from):
    """BatchNorm extractor (x / √(1 + eps) in eval mode), lr 0: the prototypes are the class
    means of x, (2, 2) for class 0 and (5, −4) for class 1, over √(1 + eps). In train mode the
    batch would be standardised (class 0's mean would be about (−0.61, 0.71))."""
    client = tiny_identity_client([[1.0, 2.0], [3.0, 2.0], [5.0, -4.0]], [0, 0, 1], extractor=_batchnorm_extractor())
    result = _tiny_context(algorithm, proto_from=proto_from).train(client, NO_KNOWLEDGE, 0, torch_generator(0, "t"))
    assert result.upload["class_ids"].tolist() == [0, 1]
    expected = torch.tensor([[2.0, 2.0], [5.0, -4.0]]) / math.sqrt(1.0 + EPS)
    torch.testing.assert_close(result.upload["protos"], expected)
    assert client.model.training  # the mode training left it in is restored


# ------------------------------------------------------ edges found by a mutmut pass (issue 12)


@pytest.mark.parametrize("options,message", [
    ({"client_reg": "l2"}, r"^config key 'algo.client_reg' is 'l2'; allowed: paper, htfllib$"),
    ({"proto_from": "later"},
     r"^config key 'algo.proto_from' is 'later'; allowed: post_update, pre_update, during_training$"),
    ({"reg_weight": -0.1}, r"^config key 'algo.reg_weight' must be >= 0, got -0.1$"),
])
def test_option_errors_are_one_exact_line(options, message):
    with pytest.raises(ConfigError, match=message):
        _context(**options)


def test_a_zero_regulariser_weight_is_allowed():
    assert _context(reg_weight=0.0)[1].options.reg_weight == 0.0


def test_upload_fields_are_bounded_by_the_class_count():
    entry, context = _context(weighted=True)
    ids, protos, counts = entry.client.upload_fields(context)
    assert (ids.max_rows, protos.max_rows, protos.trailing_shape) == (C, C, (K,))
    assert (counts.name, counts.dtype, counts.max_rows) == ("counts", torch.int64, C)
    assert [f.name for f in entry.server.download_fields(context)] == ["class_ids", "protos"]
    assert all(f.max_rows == C for f in entry.server.download_fields(context))


def test_prediction_without_global_prototypes_is_minus_one():
    entry, context = _context()
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, K)}
    predicted = entry.client(context).predict(None, empty, torch.zeros(3, K), torch.zeros(3, C))
    assert predicted.dtype == torch.int64 and predicted.tolist() == [-1, -1, -1]


def test_theory_upload_is_k_floats_per_held_class():
    entry, context = _context()
    assert entry.client(context).theory_upload_floats(_client([0, 3, 3, 1])) == K * 3


def test_weighted_client_uploads_its_class_counts():
    entry, context = _context(weighted=True)
    client = _client([0, 0, 3, 3, 3, 1])
    result = entry.client(context).train(client, {"class_ids": torch.empty(0, dtype=torch.int64),
                                                  "protos": torch.empty(0, K)}, 0, torch_generator(0, "t"))
    assert result.upload["class_ids"].tolist() == [0, 1, 3]
    assert result.upload["counts"].tolist() == [2, 1, 3]
    assert "counts" not in entry.client(_context()[1]).train(
        _client([0, 1]), {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, K)}, 0,
        torch_generator(0, "t")).upload


@pytest.mark.parametrize("counts", [torch.tensor([2]), torch.tensor([2, 0]), torch.tensor([2, -1])])
def test_weighted_server_refuses_bad_counts_naming_the_client(counts):
    entry, context = _context(weighted=True)
    upload = {"class_ids": torch.tensor([0, 1]), "protos": torch.ones(2, K), "counts": counts}
    with pytest.raises(ProtocolError, match=r"^client 6 sent invalid class counts$"):
        entry.server(context).validate_upload(6, upload)
    good = dict(upload, counts=torch.tensor([1, 1]))  # a class seen once is a valid count
    entry.server(context).validate_upload(6, good)


def test_server_refuses_bad_rows_naming_the_client():
    entry, context = _context()
    with pytest.raises(ProtocolError, match=r"^client 6 sent 1 class ids for 2 rows$"):
        entry.server(context).validate_upload(6, {"class_ids": torch.tensor([0]), "protos": torch.ones(2, K)})


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp"])
def test_the_sample_order_comes_from_the_round_generator_not_the_global_rng(algorithm):
    """Two clients in the same state trained with equal generators give equal uploads, whatever
    torch's global RNG holds (it is reseeded in between); another generator gives another order
    and so other prototypes (lr > 0, several batches, prototypes taken during training)."""
    def run(global_seed: int, stream: str):
        torch.manual_seed(global_seed)
        client = _client([0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
        entry, context = _context(proto_from="during_training") if algorithm == "fedproto" else (
            get_algorithm("fedtgp"), AlgorithmContext(num_classes=C, feature_dim=K, seed=0,
                                                      train=TrainConfig(batch_size=5),
                                                      options=parse_options(get_algorithm("fedtgp"),
                                                                            {"proto_from": "during_training"})))
        knowledge = {"class_ids": torch.tensor([0, 1]),
                     "protos": torch.randn(2, K, generator=torch.Generator().manual_seed(3))}
        torch.manual_seed(global_seed + 1000)  # the global RNG differs between the calls
        return entry.client(context).train(client, knowledge, 1, torch_generator(0, stream))

    first, second, other = run(1, "order"), run(2, "order"), run(1, "another order")
    torch.testing.assert_close(first.upload["protos"], second.upload["protos"])
    assert not torch.allclose(first.upload["protos"], other.upload["protos"])


def test_server_state_round_trips():
    entry, context = _context()
    server = entry.server(context)
    server.update({0: {"class_ids": torch.tensor([1, 3]), "protos": torch.randn(2, K)}}, 0, torch_generator(0, "s"))
    fresh = entry.server(context)
    fresh.load_state_dict(server.state_dict())
    assert fresh.download()["class_ids"].tolist() == [1, 3]
    torch.testing.assert_close(fresh.download()["protos"], server.download()["protos"])


def test_fedtgp_fields_and_upload_checks():
    entry = get_algorithm("fedtgp")
    context = AlgorithmContext(num_classes=C, feature_dim=K, seed=0, train=TrainConfig(),
                               options=parse_options(entry, {}))
    for fields in (entry.client.upload_fields(context), entry.server.download_fields(context)):
        assert [(f.name, f.max_rows) for f in fields] == [("class_ids", C), ("protos", C)]
        assert fields[1].trailing_shape == (K,)
    server = entry.server(context)
    with pytest.raises(ProtocolError, match=r"^client 2 sent 1 class ids for 2 rows$"):
        server.validate_upload(2, {"class_ids": torch.tensor([0]), "protos": torch.ones(2, K)})
    with pytest.raises(ProtocolError, match=r"^client 2 sent a class id outside \[0, 5\)$"):
        server.validate_upload(2, {"class_ids": torch.tensor([5]), "protos": torch.ones(1, K)})
    server.validate_upload(2, {"class_ids": torch.tensor([4]), "protos": torch.ones(1, K)})
