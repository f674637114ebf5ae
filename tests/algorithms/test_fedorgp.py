"""FedORGP: the sigmoid weights and the weighted server loss, the client's outlier filter and its
adaptive mixing weight on a few 2-D prototypes worked out by hand, the uploaded means (filtered,
over the full batches), the options (FedOC's paper defaults with d over C − 1, the htfllib values),
the server's wiring, the registration (FedOC left as it was), and a real run."""
from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch
from helpers import launch_smoke, tiny_identity_client
from reference_starts import trainable_prototypes

from conftest import SMOKE, run_program
from htfl_dist import testing
from htfl_dist.algorithms import AlgorithmContext, get_algorithm, parse_options
from htfl_dist.algorithms import fedtgp as fedtgp_module
from htfl_dist.algorithms.fedoc import FedOCOptions, orthogonality_loss
from htfl_dist.algorithms.fedorgp import (
    filtered_class_means,
    outlier_mask,
    outlier_scores,
    sigmoid_weights,
    weighted_orthogonality_loss,
)
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.seeding import torch_generator


def sigma(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def w(x: float) -> float:
    """w(x) = 1 + σ((x − 0.3)/0.5), written out."""
    return 1 + sigma((x - 0.3) / 0.5)


# --------------------------------------------------------------------------- the sigmoid weights


def test_sigmoid_weights_by_hand():
    x = torch.tensor([0.3, 0.8, 0.0, -1.7, 50.0])
    expected = [1.5, 1 + sigma(1.0), 1 + sigma(-0.6), 1 + sigma(-4.0), 2.0]  # 1.5, 1.7311, 1.3543, 1.0180, 2
    assert sigmoid_weights(x).tolist() == pytest.approx(expected, rel=1e-6)


# The FedOC tests' example. Global prototypes, C = 3, K = 2: P̂^0 = (1, 0), P̂^1 = (0, 2), P̂^2 = (−4, 3);
# uploads a = (3, 4) of class 0 and b = (0, −2) of class 1 (nobody uploads class 2):
#   cos(a, ·) = [0.6, 0.8, 0]      cos(b, ·) = [0, −1, −0.6]
#   o_a = (0.8 + 0)/2 = 0.4        o_b = (0 + 0.6)/2 = 0.3   (mean |cos| to the other classes)
#   s_w = (w(0.4)·(1 − 0.6) + w(0.3)·(1 − (−1)))/2 = (1.549834·0.4 + 1.5·2)/2 = 1.809967
#   Σ w(A)·A over the other classes = w(0.8)·0.8 + w(0)·0 + w(0)·0 + w(0.6)·0.6 = 1.384847 + 0.987394 = 2.372241
#   d_w = 2.372241/(|B|·(C − 1)) = 0.593060 (other_classes), 2.372241/(|B|·C) = 0.395373 (all_classes)
PROTOS = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-4.0, 3.0]])
PAIRS = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
LABELS = torch.tensor([0, 1])
S_W = (w(0.4) * 0.4 + w(0.3) * 2) / 2
D_SUM = w(0.8) * 0.8 + w(0.6) * 0.6


@pytest.mark.parametrize("intra,inter,norm,expected", [
    (1.0, 0.0, "other_classes", S_W),
    (0.0, 1.0, "other_classes", D_SUM / 4),
    (0.0, 1.0, "all_classes", D_SUM / 6),
    (1.0, 10.0, "other_classes", S_W + 10 * D_SUM / 4),  # the defaults: λ_s = 1, γ = 10
    (2.0, 0.5, "all_classes", 2 * S_W + 0.5 * D_SUM / 6),
])
def test_weighted_orthogonality_loss_by_hand(intra, inter, norm, expected):
    value = weighted_orthogonality_loss(PAIRS, LABELS, PROTOS, intra, inter, norm)
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_weighted_loss_exceeds_fedocs_and_its_intra_term_reaches_the_unheld_class():
    """Every weight is in (1, 2), so the weighted loss lies between FedOC's and twice it. Unlike
    FedOC's λ_s term, the weighted one moves the unheld class's prototype: o_b reads every class."""
    plain = orthogonality_loss(PAIRS, LABELS, PROTOS, 1.0, 10.0, "other_classes").item()  # 1.2 + 3.5
    weighted = weighted_orthogonality_loss(PAIRS, LABELS, PROTOS, 1.0, 10.0, "other_classes").item()
    assert plain == pytest.approx(4.7, rel=1e-6)
    assert plain < weighted < 2 * plain
    protos = PROTOS.clone().requires_grad_(True)
    weighted_orthogonality_loss(PAIRS, LABELS, protos, 1.0, 0.0, "other_classes").backward()
    assert protos.grad[2].abs().sum() > 0  # through w(o_b): b's |cos| to class 2 is 0.6
    protos.grad = None
    orthogonality_loss(PAIRS, LABELS, protos, 1.0, 0.0, "other_classes").backward()
    assert torch.equal(protos.grad[2], torch.zeros(2))


def test_the_gradient_is_the_weighted_losss_own_weights_included():
    """As in the reference, the weights are part of the function: autograd's gradient with respect to
    the prototypes matches central differences of the loss (float64), which a detached w would not."""
    protos = PROTOS.double().requires_grad_(True)
    pairs = PAIRS.double()
    weighted_orthogonality_loss(pairs, LABELS, protos, 1.0, 10.0, "other_classes").backward()
    numeric = torch.zeros_like(protos)
    for index in range(protos.numel()):
        step = torch.zeros(protos.numel(), dtype=torch.float64)
        step[index] = 1e-6
        step = step.view_as(protos)
        with torch.no_grad():
            up = weighted_orthogonality_loss(pairs, LABELS, protos + step, 1.0, 10.0, "other_classes")
            down = weighted_orthogonality_loss(pairs, LABELS, protos - step, 1.0, 10.0, "other_classes")
        numeric.view(-1)[index] = (up - down) / 2e-6
    torch.testing.assert_close(protos.grad, numeric, rtol=1e-6, atol=1e-8)


def test_weighted_loss_with_two_classes_averages_over_the_one_other_class():
    # C = 2: cos(a, ·) = [0.6, 0.8], cos(b, ·) = [0, −1]; o_a = 0.8, o_b = 0
    #   s_w = (w(0.8)·0.4 + w(0)·2)/2,  d_w = (w(0.8)·0.8 + w(0)·0)/(2·1)
    value = weighted_orthogonality_loss(PAIRS, LABELS, PROTOS[:2], 1.0, 1.0, "other_classes")
    assert value.item() == pytest.approx((w(0.8) * 0.4 + w(0.0) * 2) / 2 + w(0.8) * 0.8 / 2, rel=1e-6)


# --------------------------------------------------------------------------- the outlier filter

# One class, five 2-D features: four near the direction (1, 1) and one opposite it.
#   μ = ((2 + 1 + 2 + 1 − 4)/5, same) = (0.4, 0.4)
#   d = ‖f − μ‖: the four √(1.6² + 0.6²) = 1.709, the far one √(2·4.4²) = 6.223 (the largest)
#   c = cos(f, μ): the four 3/√10 = 0.949, the far one −1 (the smallest)
# So each of the four scores 1 on both min-max scales and the far one 0, whatever a is:
#   s = [1, 1, 1, 1, 0];  Q1 = s_(1) = 1, Q3 = s_(3) = 1 (n = 5: the quartiles sit on ranks 1 and 3);
#   IQR = 0, the fences are [1, 1]: the far feature goes. The mean of the rest is (1.5, 1.5).
CLUSTER = torch.tensor([[2.0, 1.0], [1.0, 2.0], [2.0, 1.0], [1.0, 2.0], [-4.0, -4.0]])


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_the_far_feature_scores_zero_and_is_dropped(alpha):
    scores, _ = outlier_scores(CLUSTER, alpha)
    assert scores.tolist() == pytest.approx([1, 1, 1, 1, 0], abs=1e-6)
    assert outlier_mask(CLUSTER, alpha).tolist() == [True, True, True, True, False]
    class_ids, means = filtered_class_means(CLUSTER, torch.zeros(5, dtype=torch.int64), 3, alpha)
    assert class_ids.tolist() == [0]
    torch.testing.assert_close(means, torch.tensor([[1.5, 1.5]]))
    class_ids, means = filtered_class_means(CLUSTER, torch.zeros(5, dtype=torch.int64), 3, None)  # no filter
    torch.testing.assert_close(means, torch.tensor([[0.4, 0.4]]))


# A cross around (2, 0), five features: (0, 1), (0, −1), (1, 0), (−1, 0), (10, 0).
#   μ = (2, 0);  d = [√5, √5, 1, 3, 8];  c = cos(f, (1, 0)) = [0, 0, 1, −1, 1]
#   cv(d) = stdev(d)/mean(d) = 2.72642/3.29443 = 0.82758;  cv(c) = stdev(c)/|mean(c)| = √0.7/0.2 = 4.18330
#   ρ = 0.19783;  a = α·(1 − 0.3·tanh(0.5·(ρ − 1))) = α·1.11427
#   min-max: d → 1 − (d − 1)/7 = [(8 − √5)/7, (8 − √5)/7, 1, 5/7, 0];  c → (c + 1)/2 = [½, ½, 1, 0, 1]
CROSS = torch.tensor([[0.0, 1.0], [0.0, -1.0], [1.0, 0.0], [-1.0, 0.0], [10.0, 0.0]])
CROSS_D = [math.sqrt(5), math.sqrt(5), 1.0, 3.0, 8.0]
CROSS_C = [0.0, 0.0, 1.0, -1.0, 1.0]


def _cross_weight(alpha: float) -> float:
    ratio = (statistics.stdev(CROSS_D) / statistics.mean(CROSS_D)) / (
        statistics.stdev(CROSS_C) / abs(statistics.mean(CROSS_C)))
    return min(max(alpha * (1 - 0.3 * math.tanh(0.5 * (ratio - 1))), 0.1), 0.9)


@pytest.mark.parametrize("alpha,expected_weight", [
    (0.5, 0.5 * 1.114272),  # the default α
    (0.3, 0.3 * 1.114272),
    (1.0, 0.9),  # clamped from above
    (0.0, 0.1),  # clamped from below
])
def test_adaptive_weight_and_scores_of_the_cross_by_hand(alpha, expected_weight):
    assert _cross_weight(alpha) == pytest.approx(expected_weight, rel=1e-5)  # the derivation above
    scores, weight = outlier_scores(CROSS, alpha)
    assert weight == pytest.approx(expected_weight, rel=1e-5)
    a = _cross_weight(alpha)
    near = (8 - math.sqrt(5)) / 7
    assert scores.tolist() == pytest.approx([a * near + (1 - a) / 2, a * near + (1 - a) / 2, 1.0, a * 5 / 7,
                                             1 - a], rel=1e-5)


def test_the_cross_keeps_every_feature():
    # α = 0.5, a = 0.557: s = [0.680, 0.680, 1, 0.398, 0.443]; sorted 0.398, 0.443, 0.680, 0.680, 1
    #   Q1 = 0.443, Q3 = 0.680, IQR = 0.237: fences [0.087, 1.036] hold all five (the far (10, 0) too:
    #   it lies on μ's direction, so its cosine score is the best)
    assert outlier_mask(CROSS, 0.5).all()


def test_the_fences_are_two_sided_the_feature_at_the_centre_goes():
    # The class mean itself, (5, 5), and four features one step from it: d = [0, 1, 1, 1, 1], so the
    # distance scores are [1, 0, 0, 0, 0]; cos(·, (1, 1)) = [1, 0.99589, 0.99388, 0.99589, 0.99388], so
    # the cosine scores are [1, 0.3285, 0, 0.3285, 0]. With x = (1 − a)·0.3285 ≤ 0.9·0.3285 = 0.296:
    #   s = [1, x, 0, x, 0];  Q1 = 0, Q3 = x, IQR = x: the upper fence 2.5·x < 1 leaves the centre out.
    around = torch.tensor([[5.0, 5.0], [6.0, 5.0], [4.0, 5.0], [5.0, 6.0], [5.0, 4.0]])
    for alpha in (0.0, 0.5, 1.0):
        scores, weight = outlier_scores(around, alpha)
        x = (1 - weight) * (0.995893 - 0.993884) / (1 - 0.993884)
        assert scores.tolist() == pytest.approx([1, x, 0, x, 0], abs=2e-4)
        assert outlier_mask(around, alpha).tolist() == [False, True, True, True, True]


def test_small_classes_keep_every_feature():
    """n ≤ 2 keeps all (n = 1 has no spread to score); with n = 3 the lower fence
    Q1 − 1.5·IQR = (s0 + s1)/2 − 0.75·(s2 − s0) never passes s0, so a far third feature stays."""
    one = torch.tensor([[3.0, -1.0]])
    assert outlier_mask(one, 0.5).tolist() == [True]
    _, means = filtered_class_means(one, torch.tensor([1]), 2, 0.5)
    torch.testing.assert_close(means, one)
    assert outlier_mask(torch.tensor([[1.0, 0.0], [-60.0, 40.0]]), 0.5).tolist() == [True, True]
    assert outlier_mask(torch.tensor([[1.0, 0.0], [1.0, 0.1], [-50.0, -50.0]]), 0.5).tolist() == [True] * 3


def test_more_than_half_of_a_class_always_survives():
    """Why the reference's keep-the-best-half fallback is not written: on random classes (ReLU-like
    rows, some far ones) the fences always keep more than ⌊n/2⌋."""
    generator = torch.Generator().manual_seed(3)
    for n in range(3, 60):
        rows = torch.relu(torch.randn(n, 4, generator=generator) + 1)
        rows[: n // 6] += 30 * torch.rand(n // 6, 4, generator=generator)
        assert int(outlier_mask(rows, 0.5).sum()) > n // 2, n


def test_class_means_per_class_and_with_nothing_to_average():
    # class 0: CLUSTER (filtered mean (1.5, 1.5)); class 2: two rows (kept, mean (0, 2)); class 1 absent
    features = torch.cat([CLUSTER, torch.tensor([[0.0, 1.0], [0.0, 3.0]])])
    labels = torch.tensor([0, 0, 0, 0, 0, 2, 2])
    class_ids, means = filtered_class_means(features, labels, 3, 0.5)
    assert class_ids.tolist() == [0, 2] and class_ids.dtype == torch.int64
    torch.testing.assert_close(means, torch.tensor([[1.5, 1.5], [0.0, 2.0]]))
    class_ids, means = filtered_class_means(torch.empty(0, 2), torch.empty(0, dtype=torch.int64), 3, 0.5)
    assert class_ids.shape == (0,) and class_ids.dtype == torch.int64 and means.shape == (0, 2)


# --------------------------------------------------------------------------- the client


def _context(num_classes=2, feature_dim=2, batch_size=2, **options):
    entry = get_algorithm("fedorgp")
    context = AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=0,
                               train=TrainConfig(batch_size=batch_size, lr=0.0), options=parse_options(entry, options))
    return entry, context


# CLUSTER as class 0, then two rows of class 1; the features are x (tiny_identity_client, lr 0)
CLIENT_X = [[2.0, 1.0], [1.0, 2.0], [2.0, 1.0], [1.0, 2.0], [-4.0, -4.0], [0.0, 1.0], [0.0, 3.0]]
CLIENT_Y = [0, 0, 0, 0, 0, 1, 1]
NO_PROTOTYPES = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}


@pytest.mark.parametrize("options,expected", [
    ({}, [[1.5, 1.5], [0.0, 2.0]]),  # the far feature of class 0 left out
    ({"outlier_filter": "none"}, [[0.4, 0.4], [0.0, 2.0]]),  # FedOC's plain means
    ({"outlier_filter": "none", "proto_samples": "full_batches"}, [[0.4, 0.4], [0.0, 1.0]]),  # the first 6 rows
    ({"proto_samples": "full_batches"}, [[1.5, 1.5], [0.0, 1.0]]),
])
def test_client_uploads_the_filtered_means(options, expected):
    entry, context = _context(batch_size=3, **options)
    client = tiny_identity_client(CLIENT_X, CLIENT_Y)
    result = entry.client(context).train(client, NO_PROTOTYPES, 0, torch_generator(0, "b"))
    assert result.loss_sum / result.samples == pytest.approx(math.log(2))  # a zero head; the features stay x
    assert result.upload["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(result.upload["protos"], torch.tensor(expected))
    assert client.model.training  # eval mode only while the features were taken


def test_full_batches_keep_a_class_seen_only_in_the_dropped_tail_out():
    entry, context = _context(batch_size=5, proto_samples="full_batches")  # 7 samples: rows 0–4 only
    result = entry.client(context).train(tiny_identity_client(CLIENT_X, CLIENT_Y), NO_PROTOTYPES, 0,
                                         torch_generator(0, "b"))
    assert result.upload["class_ids"].tolist() == [0]
    torch.testing.assert_close(result.upload["protos"], torch.tensor([[1.5, 1.5]]))
    entry, context = _context(batch_size=8, proto_samples="full_batches")  # not one full batch: nothing
    result = entry.client(context).train(tiny_identity_client(CLIENT_X, CLIENT_Y), NO_PROTOTYPES, 0,
                                         torch_generator(0, "b"))
    assert result.upload["class_ids"].shape == (0,) and result.upload["protos"].shape == (0, 2)


def test_client_trains_fedocs_loss():
    """CE + λ_c·(1 − cos): with P̂^0 = (1, 0), P̂^1 = (0, 1), L_R averages 1 − cos over the 7 rows."""
    entry, context = _context(batch_size=7, reg_weight=2.0)  # one batch of all 7
    knowledge = {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}
    cosines = [2 / math.sqrt(5), 1 / math.sqrt(5), 2 / math.sqrt(5), 1 / math.sqrt(5), -1 / math.sqrt(2), 1.0, 1.0]
    l_r = sum(1 - c for c in cosines) / 7
    result = entry.client(context).train(tiny_identity_client(CLIENT_X, CLIENT_Y), knowledge, 1,
                                         torch_generator(0, "b"))
    assert result.loss_sum / result.samples == pytest.approx(math.log(2) + 2.0 * l_r, rel=1e-6)


# --------------------------------------------------------------------------- options


def test_paper_defaults_and_the_htfllib_values():
    o = _context()[1].options
    assert (o.reg_weight, o.intra_weight, o.inter_weight, o.inter_norm) == (100.0, 1.0, 10.0, "other_classes")
    assert (o.server_batch_size, o.server_epochs, o.server_lr, o.first_round) == (32, 1, 0.01, "initial_prototypes")
    assert (o.outlier_filter, o.filter_alpha, o.loss_weights, o.proto_samples) == ("adaptive", 0.5, "sigmoid", "all")
    o = _context(compat="reference")[1].options
    assert (o.reg_weight, o.inter_norm, o.server_batch_size, o.first_round) == (10.0, "other_classes", None, "ce_only")
    assert (o.outlier_filter, o.filter_alpha, o.loss_weights, o.proto_samples) == (
        "adaptive", 0.5, "sigmoid", "full_batches")
    o = _context(compat="reference", inter_norm="all_classes", proto_samples="all")[1].options
    assert (o.inter_norm, o.proto_samples) == ("all_classes", "all")  # knobs win


@pytest.mark.parametrize("options,message", [
    ({"outlier_filter": "iqr"}, "algo.outlier_filter"),
    ({"loss_weights": "adaptive"}, "algo.loss_weights"),
    ({"proto_samples": "first"}, "algo.proto_samples"),
    ({"filter_alpha": -0.1}, "config key 'algo.filter_alpha' must be in [0, 1], got -0.1"),
    ({"filter_alpha": 1.5}, "config key 'algo.filter_alpha' must be in [0, 1], got 1.5"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ConfigError) as info:
        _context(**options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_alpha_may_be_either_end():
    assert [_context(filter_alpha=value)[1].options.filter_alpha for value in (0.0, 1.0)] == [0.0, 1.0]


# --------------------------------------------------------------------------- server


def _uploads(num_classes=5, clients=4, dim=8, seed=1):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.eye(num_classes - 1, dim) * 6.0 + 1.0
    uploads = {}
    for client in range(clients):
        held = sorted({(client + j) % (num_classes - 1) for j in range(3)})
        uploads[client] = {"class_ids": torch.tensor(held),
                           "protos": centres[held] + 0.3 * torch.rand(len(held), dim, generator=generator)}
    return uploads


@pytest.mark.parametrize("options,loss", [({}, weighted_orthogonality_loss), ({"loss_weights": "uniform"},
                                                                                orthogonality_loss)])
def test_server_trains_the_configured_loss(monkeypatch, options, loss):
    seen = {}
    original = fedtgp_module.train_on_pairs

    def spy(rows, labels, loss_fn, optimizer, **kwargs):
        seen.update(kwargs, pairs=rows.shape[0])
        expected = loss(rows, labels, server.tgp(), 1.0, 10.0, "other_classes")
        assert torch.equal(loss_fn(rows, labels), expected)
        return original(rows, labels, loss_fn, optimizer, **kwargs)

    monkeypatch.setattr(fedtgp_module, "train_on_pairs", spy)
    entry, context = _context(num_classes=5, feature_dim=8, batch_size=10, **options)
    torch.manual_seed(0)
    server = entry.server(context)
    result = server.update(_uploads(), 0, torch_generator(0, "server", 0))
    assert (seen["epochs"], seen["batch_size"], seen["pairs"]) == (1, 32, 12)
    assert result["server_pairs"] == 12 and "global_inter_abs_cos" in result


def test_server_loss_falls_and_prototypes_separate():
    """Uploads of different classes have |cos| 0.40; 300 epochs of the weighted loss pull each global
    prototype to its class (cos 0.81) and push them apart (|cos| 0.21)."""
    entry, context = _context(num_classes=5, feature_dim=8, server_epochs=300, server_lr=0.1, server_batch_size=6)
    torch.manual_seed(0)
    server = entry.server(context)
    uploads = _uploads()
    pairs, labels = server._pairs(uploads)
    with torch.no_grad():
        before = float(weighted_orthogonality_loss(pairs, labels, server.tgp(), 1.0, 10.0, "other_classes"))
    result = server.update(uploads, 0, torch_generator(0, "server", 0))
    with torch.no_grad():
        after = float(weighted_orthogonality_loss(pairs, labels, server.tgp(), 1.0, 10.0, "other_classes"))
    assert after < 0.3 * before and result["server_loss"] < 0.5 * before
    assert result["global_intra_cos"] > 0.7
    assert result["global_inter_abs_cos"] < 0.6 * result["upload_inter_abs_cos"]
    assert server.download()["class_ids"].tolist() == list(range(5))


# --------------------------------------------------------------------------- registration and runs


def test_registration_and_fedoc_left_as_it_was():
    entry = get_algorithm("fedorgp")
    assert not (entry.private_release or entry.batched_clients or entry.evaluation_installs_knowledge
                or entry.shares_parameters)
    assert entry.conformance.ranks_covered_by == "fedoc"
    fedoc = get_algorithm("fedoc")
    assert fedoc.options is FedOCOptions and fedoc.private_release
    spelled = dataclasses.asdict(parse_options(fedoc, {}))
    assert spelled["inter_norm"] == "all_classes" and "outlier_filter" not in spelled


def test_a_private_run_is_refused_in_one_line(tmp_path, cache_dir):
    """Not private_release: which features enter a mean depends on all of the class's samples."""
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path / "run"), "algorithm=fedorgp",
                          "privacy.enabled=true", f"data.cache_dir={cache_dir}"])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "algorithm 'fedorgp' uploads what privacy.* does not noise" in lines[0]


def test_real_run(single_run):
    """The conformance checks' run (3 of 6 clients a round): learns, sends the papers' count."""
    rows = launch_smoke(single_run, "fedorgp", *testing.hints("fedorgp").overrides)
    for row in rows:
        assert row["test_acc"] == row["test_acc_head"]
        assert row["server_pairs"] > 0 and -1.0 <= row["global_intra_cos"] <= 1.0


# ------------------------------------------------------------------------------ the start under model.init=htfllib

def test_htfllib_init_draws_the_trainable_prototypes_as_the_reference_does():
    """model.init=htfllib: the server's initial P̂ = F(P̃) equals wisheverybodyhapi/FedORGP@ff4a036's
    first draws after its clients' torch.manual_seed(0) (the run seed standing for 0), and torch's
    global RNG is left as it was; other inits keep drawing from the global RNG the runtime seeded
    (the same P̂ as before)."""
    entry, context = _context(num_classes=3, feature_dim=4)
    context = dataclasses.replace(context, seed=7, model_init="htfllib")
    expected = trainable_prototypes(7, 3, 4)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    server = entry.server(context)
    torch.testing.assert_close(server.global_prototypes(), expected, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)  # the runtime's (seed, "server-init") seeding, here 123
    per_client = entry.server(dataclasses.replace(context, model_init="per_client")).global_prototypes()
    assert torch.equal(per_client, trainable_prototypes(123, 3, 4))  # from the global RNG, as before
    assert not torch.equal(per_client, expected)
