"""FedGMKD: the EM steps and the mixture prototype on cases with known answers, the server's
discrepancy-aware weights and means worked out by hand, the client's loss terms and one clipped
step by hand, its uploaded knowledge, the wire, and one real run through the conformance kit."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import launch_smoke, make_client, make_context
from torch import nn

from htfl_dist import testing
from htfl_dist.algorithms import ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.fedgmkd import aggregation_weights, distillation_term, feature_discrepancy, feature_term
from htfl_dist.algorithms.fedgmkd_mixture import (
    REG_COVAR,
    DiagonalMixture,
    fit_diagonal_mixture,
    log_joint,
    maximisation,
    mixture_prototype,
)
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

D64 = torch.float64


def _column(values):
    return torch.tensor(values, dtype=D64).unsqueeze(1)


# --------------------------------------------------------------------------- the mixture


def test_log_joint_by_hand():
    # one component, π = 1/2, μ = 1, σ² = 4, x = 0: ln ½ − ½·(ln(2π·4) + (0 − 1)²/4)
    value = log_joint(_column([0.0]), torch.tensor([0.5], dtype=D64), _column([1.0]), _column([4.0]))
    assert float(value) == pytest.approx(math.log(0.5) - 0.5 * (math.log(8 * math.pi) + 0.25))


def test_maximisation_by_hand():
    # x = (0, 2, 10), hard responsibilities {0, 2} → component 0, {10} → component 1:
    # N = (2, 1), π = (2/3, 1/3), μ = (1, 10), σ² = (((0 − 1)² + (2 − 1)²)/2, 0) + reg
    responsibilities = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=D64)
    weights, means, variances = maximisation(_column([0.0, 2.0, 10.0]), responsibilities)
    torch.testing.assert_close(weights, torch.tensor([2 / 3, 1 / 3], dtype=D64))
    torch.testing.assert_close(means, _column([1.0, 10.0]))
    torch.testing.assert_close(variances, _column([1.0 + REG_COVAR, REG_COVAR]))


def test_em_finds_two_separated_clusters():
    # {−5.1, −4.9} and {4.9, 5.1}, started from one sample of each: the first E-step assigns each
    # cluster to its start, so π = (½, ½), μ = ∓5, σ² = 0.01 + reg, and nothing moves after
    x = _column([-5.1, -4.9, 4.9, 5.1])
    checked = 0
    for seed in range(8):
        starts = torch.randperm(4, generator=torch.Generator().manual_seed(seed))[:2]  # what the fit draws
        if bool((x[starts, 0] > 0).all() or (x[starts, 0] < 0).all()):
            continue
        checked += 1
        fit = fit_diagonal_mixture(x, 2, 10, 1e-3, torch.Generator().manual_seed(seed))
        order = fit.means[:, 0].argsort()
        assert fit.iterations == 3  # E-steps at the start, at the answer, and once more: no change, stop
        torch.testing.assert_close(fit.weights[order], torch.tensor([0.5, 0.5], dtype=D64))
        torch.testing.assert_close(fit.means[order], _column([-5.0, 5.0]))
        torch.testing.assert_close(fit.variances[order], _column([0.01 + REG_COVAR] * 2))
    assert checked >= 2


def test_bic_by_hand_and_the_selection_prefers_the_true_cluster_count():
    # one component on (−1, 1): μ = 0, σ² = 1 + reg; mean ln-likelihood −½(ln 2πσ² + 1/σ²);
    # BIC = −2·2·ll + (2·1·1 + 0)·ln 2
    fit = fit_diagonal_mixture(_column([-1.0, 1.0]), 1, 10, 1e-3, torch.Generator().manual_seed(0))
    variance = 1 + REG_COVAR
    ll = -0.5 * (math.log(2 * math.pi * variance) + 1 / variance)
    assert fit.mean_log_likelihood == pytest.approx(ll)
    assert fit.bic(2) == pytest.approx(-4 * ll + 2 * math.log(2))
    generator = torch.Generator().manual_seed(0)
    clusters = torch.cat([torch.randn(40, 3, generator=generator, dtype=D64) * 0.1 + 5,
                          torch.randn(40, 3, generator=generator, dtype=D64) * 0.1 - 5])
    _, chosen = mixture_prototype(clusters, 6, 20, 1e-3, torch.Generator().manual_seed(3))
    assert chosen == 2


def test_the_weighted_mean_of_any_fitted_mixture_is_the_sample_mean():
    """Σ_j π_j·μ_j = mean(x) after any M-step: the prototype is the class mean in feature space,
    and 0 where it stays standardised (the reference's upload)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, 5, generator=generator, dtype=D64).relu() * 3 + 1
    for components in (1, 2, 4):
        fit = fit_diagonal_mixture(x, components, 3, 1e-3, torch.Generator().manual_seed(components))
        torch.testing.assert_close(fit.weighted_mean, x.mean(dim=0), rtol=0, atol=1e-12)
    prototype, _ = mixture_prototype(x, 6, 10, 1e-3, torch.Generator().manual_seed(1))
    torch.testing.assert_close(prototype, x.mean(dim=0), rtol=0, atol=1e-12)
    standardised, _ = mixture_prototype(x, 6, 10, 1e-3, torch.Generator().manual_seed(1), standardised=True)
    assert float(standardised.abs().max()) < 1e-12


def test_one_sample_is_its_own_prototype_and_a_fit_is_deterministic():
    row = torch.tensor([[3.0, -1.0]], dtype=D64)
    assert torch.equal(mixture_prototype(row, 6, 10, 1e-3, torch.Generator())[0], row[0])
    standardised, _ = mixture_prototype(row, 6, 10, 1e-3, torch.Generator(), standardised=True)
    assert torch.equal(standardised, torch.zeros(2, dtype=D64))
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(5), dtype=D64)
    fits = [fit_diagonal_mixture(x, 3, 10, 1e-3, torch_generator(0, "m", 1, 2, 3)) for _ in range(2)]
    assert all(torch.equal(getattr(fits[0], f), getattr(fits[1], f)) for f in ("weights", "means", "variances"))
    assert isinstance(fits[0], DiagonalMixture) and 1 <= fits[0].iterations <= 10


# --------------------------------------------------------------------------- the server's weights


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")  # the reference's own kl_div call, kept as it is
def test_feature_discrepancy_by_hand():
    # softmax(0, 0) = (½, ½), softmax(ln 3, 0) = (¾, ¼): KL = ½ ln(⅔) + ½ ln 2 = ½ ln(4/3), over K = 2
    global_rows, local_rows = torch.zeros(1, 2), torch.tensor([[math.log(3.0), 0.0]])
    assert float(feature_discrepancy(global_rows, local_rows)[0]) == pytest.approx(0.25 * math.log(4 / 3))
    reference = F.kl_div(F.log_softmax(local_rows[0], dim=0), F.softmax(global_rows[0], dim=0))  # the code's call
    assert float(feature_discrepancy(global_rows, local_rows)[0]) == pytest.approx(float(reference))


def test_aggregation_weights_by_hand():
    # n = (10, 20, 30); client 0 holds {0, 1}, client 1 {0, 2}, client 2 {2}; a = 2, b = 1
    totals = torch.tensor([10.0, 20.0, 30.0])
    holds = torch.tensor([[True, True, False], [True, False, True], [False, False, True]])
    d = torch.tensor([[0.5, 0.0, 0.0], [3.0, 0.0, 20.0], [0.0, 0.0, 0.0]])
    # scores n − 2d + 1: class 0 (10, 15), class 1 (11), class 2 (ReLU(20 − 40 + 1) = 0, 31)
    weights = aggregation_weights(totals, d, holds, 2.0, 1.0, "holders")
    expected = torch.tensor([[10 / 25, 1.0, 0.0], [15 / 25, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=D64)
    torch.testing.assert_close(weights, expected)
    # participants: the non-holders' scores n + 1 join the denominator: class 0 + 31, class 1 + 21 + 31,
    # class 2 + 11
    weights = aggregation_weights(totals, d, holds, 2.0, 1.0, "participants")
    expected = torch.tensor([[10 / 56, 11 / 63, 0.0], [15 / 56, 0.0, 0.0], [0.0, 0.0, 31 / 42]], dtype=D64)
    torch.testing.assert_close(weights, expected)


def test_a_class_whose_holders_all_score_zero_gets_no_weight():
    weights = aggregation_weights(torch.tensor([1.0, 5.0]), torch.tensor([[10.0], [0.0]]),
                                  torch.tensor([[True], [False]]), 1.0, 0.0, "participants")
    assert torch.equal(weights, torch.zeros(2, 1, dtype=D64))


def _server(**options):
    entry, context = make_context("fedgmkd", **options)
    return entry.server(context)


def _upload(class_ids, counts, protos, soft):
    return {"class_ids": torch.tensor(class_ids), "counts": torch.tensor(counts),
            "protos": torch.tensor(protos, dtype=torch.float32), "soft": torch.tensor(soft, dtype=torch.float32)}


def _update(server, uploads, round_index=0):
    return server.update(uploads, round_index, torch_generator(0, "server", round_index))


def test_first_round_weights_by_quantity_by_hand():
    # no earlier global rows: d = 0, scores n + 0.2 = (4.2, 2.2); class 0 (4.2·(1, 0) + 2.2·(0, 1)) / 6.4
    server = _server()
    _update(server, {1: _upload([0], [2], [[0, 1, 0, 0]], [[0, 1, 0]]),
                     0: _upload([0, 1], [3, 1], [[1, 0, 0, 0], [0, 0, 2, 0]], [[1, 0, 0], [0, 0, 1]])})
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(download["protos"], torch.tensor([[4.2 / 6.4, 2.2 / 6.4, 0, 0], [0, 0, 2, 0]]))
    torch.testing.assert_close(download["soft"], torch.tensor([[4.2 / 6.4, 2.2 / 6.4, 0], [0, 0, 1]]))


def test_the_discrepancy_to_last_rounds_prototype_lowers_a_clients_weight_by_hand():
    server = _server(discrepancy_weight=10.0)
    uniform = [[1 / 3] * 3]
    _update(server, {0: _upload([0], [4], [[0, 0, 0, 0]], uniform), 1: _upload([0], [2], [[0, 0, 0, 0]], uniform)})
    # round 2: G = 0, client 0 uploads 0 (d = 0), client 1 (ln 3, 0, 0, 0): softmax (½, ⅙, ⅙, ⅙), so
    # d = ¼·Σ ¼ ln(¼ / p_j) = ln(1.6875) / 16; scores (4.2, 2.2 − 10·d)
    distance = math.log(1.6875) / 16
    shifted = 2.2 - 10 * distance
    diagnostics = _update(server, {0: _upload([0], [4], [[0, 0, 0, 0]], uniform),
                                   1: _upload([0], [2], [[math.log(3.0), 0, 0, 0]], uniform)}, 1)
    torch.testing.assert_close(server.download()["protos"],
                               torch.tensor([[shifted * math.log(3.0) / (4.2 + shifted), 0, 0, 0]]))
    assert diagnostics["discrepancy_mean"] == pytest.approx(distance / 2)
    assert diagnostics["weight_shift_max"] == pytest.approx(2.2 / 6.4 - shifted / (4.2 + shifted))
    assert diagnostics["global_classes"] == 1.0


def test_each_class_is_compared_with_its_own_global_row():
    # round 1 makes G^1 = 0 only. Round 2: client 1's class 0 row (5, 0, 0, 0) has no global row to
    # compare with (d = 0); its class 1 row (ln 3, 0, 0, 0) is compared with G^1 (d as above). The
    # soft rows, which differ per client, show the weights: class 0 (4.2, 2.2)/6.4, class 1 shifted
    server = _server(discrepancy_weight=10.0)
    first = _upload([1], [2], [[0, 0, 0, 0]], [[1 / 3] * 3])
    _update(server, {0: first, 1: {**first, "counts": torch.tensor([1])}})
    _update(server, {0: _upload([0, 1], [2, 2], [[0, 0, 0, 0]] * 2, [[1, 0, 0], [1, 0, 0]]),
                     1: _upload([0, 1], [1, 1], [[5, 0, 0, 0], [math.log(3.0), 0, 0, 0]], [[0, 1, 0], [0, 1, 0]])}, 1)
    shifted = 2.2 - 10 * math.log(1.6875) / 16
    torch.testing.assert_close(server.download()["soft"], torch.tensor(
        [[4.2 / 6.4, 2.2 / 6.4, 0], [4.2 / (4.2 + shifted), shifted / (4.2 + shifted), 0]]))


def test_participants_normalisation_shrinks_a_rare_class_and_absent_classes_drop():
    server = _server(normalise="participants")
    _update(server, {0: _upload([0, 1], [1, 1], [[2, 0, 0, 0], [0, 2, 0, 0]], [[1, 0, 0], [0, 1, 0]]),
                     1: _upload([0], [3], [[2, 0, 0, 0]], [[1, 0, 0]])})
    # class 1: client 0 scores 2.2, client 1 (not holding it) 3.2 in the denominator: 2.2 / 5.4 of (0, 2)
    torch.testing.assert_close(server.download()["protos"][1], torch.tensor([0, 2 * 2.2 / 5.4, 0, 0]))
    _update(server, {1: _upload([0], [3], [[2, 0, 0, 0]], [[1, 0, 0]])}, 1)
    assert server.download()["class_ids"].tolist() == [0]  # only this round's classes go down


def test_state_round_trips():
    server = _server()
    _update(server, {0: _upload([0, 2], [1, 2], [[1, 2, 3, 4], [0, 0, 0, 1]], [[1, 0, 0], [0, 0, 1]])})
    fresh = _server()
    fresh.load_state_dict(server.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.download().values(), server.download().values(), strict=True))


@pytest.mark.parametrize(("change", "message"), [
    ({"soft": torch.tensor([[0.5, 0.6, -0.1]])}, "not distributions"),
    ({"soft": torch.tensor([[0.5, 0.6, 0.0]])}, "not distributions"),
    ({"counts": torch.tensor([0])}, "invalid class counts"),
    ({"protos": torch.zeros(2, 4)}, "2 rows"),
    ({"class_ids": torch.tensor([3])}, "outside"),
])
def test_bad_uploads_are_refused(change, message):
    upload = {**_upload([0], [1], [[1, 0, 0, 0]], [[0.5, 0.5, 0.0]]), **change}
    with pytest.raises(ProtocolError, match=message):
        _server().validate_upload(3, upload)


# --------------------------------------------------------------------------- the client


def test_loss_terms_by_hand():
    # head logits (0, 0) at T = 1: q = (½, ½); S = (1, 0): KL = ln 2, over m·C = 2 entries
    assert float(distillation_term(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), 1.0)) == pytest.approx(
        math.log(2) / 2)
    # logits (2 ln 3, 0) at T = 2: q = (¾, ¼); S = (½, ½): KL = ½ ln(⅔) + ½ ln 2
    value = distillation_term(torch.tensor([[2 * math.log(3.0), 0.0]]), torch.tensor([[0.5, 0.5]]), 2.0)
    assert float(value) == pytest.approx((0.5 * math.log(2 / 3) + 0.5 * math.log(2)) / 2)
    # sample 0 to G^0 = 0: (1 + 4) / 2 per entry; sample 1's class has no row: 0; over B = 2
    features, labels = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 1])
    table, available = torch.tensor([[0.0, 0.0], [3.0, 2.0]]), torch.tensor([True, False])
    assert float(feature_term(features, labels, table, available)) == pytest.approx(1.25)
    assert float(feature_term(features, labels, table, available, torch.tensor([1.0, 0.0]))) == pytest.approx(2.5)


def _linear_client(lr=0.5):
    """f(x) = W x, W = I (2 × 2), a zero head Linear(2, 2); SGD over both at ``lr``; one sample x = (1, 0), y = 0."""
    extractor, head = nn.Linear(2, 2, bias=False), nn.Linear(2, 2)
    nn.init.eye_(extractor.weight)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = SplitModel(extractor, head, feature_dim=2)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    return ClientState(0, "tiny", model, torch.optim.SGD(model.parameters(), lr=lr), x, y, x, y, torch.device("cpu"))


def _knowledge(protos, soft):
    return {"class_ids": torch.arange(protos.shape[0]), "protos": protos, "soft": soft}


def test_one_clipped_step_by_hand():
    # G = 0, S uniform: h(G) = bias = 0 gives q = S, so the KL term is 0 with no gradient.
    # z = (1, 0), logits 0: CE = ln 2; ∂/∂bias = p − e_0 = (−½, ½), ∂/∂W_head = (p − e_0)·zᵀ, and no CE
    # gradient reaches W (zero head). γ·MSE(z, 0) = 2·½ = 1; ∂/∂W = γ·(2/K)·z·xᵀ = [[2, 0], [0, 0]].
    # Norm √(4 + ¼ + ¼ + ¼ + ¼) = √5 > 1.1: every gradient scaled by 1.1/√5, then SGD at 0.5
    entry, context = make_context("fedgmkd", feature_dim=2, num_classes=2, batch_size=1, lr=0.5, gamma=2.0, lam=5.0)
    client = _linear_client()
    result = entry.client(context).train(client, _knowledge(torch.zeros(2, 2), torch.full((2, 2), 0.5)), 1,
                                         torch_generator(0, "b", 0, 1))
    scale = 0.5 * 1.1 / math.sqrt(5)
    torch.testing.assert_close(client.model.feature_extractor.weight, torch.tensor([[1 - 2 * scale, 0.0], [0.0, 1.0]]))
    torch.testing.assert_close(client.model.head.bias, torch.tensor([0.5 * scale, -0.5 * scale]))
    assert (result.loss_sum, result.samples) == (pytest.approx(math.log(2) + 1), 1)


def test_round_one_is_cross_entropy_alone_and_unclipped():
    def trained(**options):
        entry, context = make_context("fedgmkd", feature_dim=2, num_classes=2, batch_size=1, lr=0.5, **options)
        client = _linear_client()
        empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2), "soft": torch.empty(0, 2)}
        entry.client(context).train(client, empty, 0, torch_generator(0, "b", 0, 0))
        return client.model.head.bias.detach().clone()

    # unclipped: bias = −0.5·(−½, ½); the clip, λ and γ change nothing without global rows
    torch.testing.assert_close(trained(), torch.tensor([0.25, -0.25]))
    assert torch.equal(trained(), trained(clip_grad_norm=1e-3, lam=9.0, gamma=9.0))


@pytest.mark.parametrize("prototype", ["mixture", "mean", "standardised_mixture"])
def test_the_upload_is_the_class_knowledge_of_the_trained_model(prototype):
    entry, context = make_context("fedgmkd", prototype=prototype, temperature=0.5)
    client = make_client(context, 1)
    algorithm = entry.client(context)
    result = algorithm.train(client, _knowledge(torch.zeros(3, 4), torch.full((3, 3), 1 / 3)), 1,
                             torch_generator(0, "b", 1, 1))
    upload = result.upload
    client.model.eval()
    with torch.no_grad():
        features, logits = client.model.forward_with_features(client.train_x)
    soft = F.softmax(logits / 0.5, dim=1)
    assert upload["class_ids"].tolist() == [0, 1, 2] and upload["counts"].tolist() == [3, 3, 3]
    means = torch.stack([features[client.train_y == c].mean(dim=0) for c in range(3)])
    expected = torch.zeros_like(means) if prototype == "standardised_mixture" else means
    torch.testing.assert_close(upload["protos"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(upload["soft"], torch.stack([soft[client.train_y == c].mean(dim=0) for c in range(3)]))
    assert algorithm.theory_upload_floats(client) == upload["protos"].numel() + upload["soft"].numel() == (4 + 3) * 3


def test_declared_fields_and_theory_counts():
    entry, context = make_context("fedgmkd")
    assert [f.name for f in entry.client.upload_fields(context)] == ["class_ids", "counts", "protos", "soft"]
    assert all(f.max_rows == 3 for f in entry.client.upload_fields(context))
    assert [f.name for f in entry.server.download_fields(context)] == ["class_ids", "protos", "soft"]
    assert entry.server(context).theory_download_floats() == (4 + 3) * 3
    assert not entry.shares_parameters and not entry.private_release and not entry.batched_clients


@pytest.mark.parametrize(("options", "key"), [({"lam": -1.0}, "algo.lam"), ({"temperature": 0.0}, "algo.temperature"),
                                              ({"normalise": "all"}, "algo.normalise"),
                                              ({"prototype": "median"}, "algo.prototype"),
                                              ({"mixture_components": 0}, "algo.mixture_components"),
                                              ({"clip_grad_norm": -1.0}, "algo.clip_grad_norm")])
def test_bad_options_name_their_key(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_options(get_algorithm("fedgmkd"), options)


# --------------------------------------------------------------------------- a real run


@pytest.mark.integration
def test_one_round_through_the_conformance_kit(tmp_path, cache_dir):
    testing.check_registration("fedgmkd")
    played = testing.play_one_round("fedgmkd", tmp_path, overrides=[f"data.cache_dir={cache_dir}"])
    testing.check_declared_payloads(played)
    testing.check_parameters_travel_as_registered(played)
    testing.check_state_round_trip(played)


@pytest.mark.integration
def test_real_run(single_run):
    rows = launch_smoke(single_run, "fedgmkd")
    assert all(r["test_acc"] == r["test_acc_head"] for r in rows)  # inference is the client's own head
    assert rows[0]["global_classes"] == 10 and "discrepancy_mean" in rows[1]
