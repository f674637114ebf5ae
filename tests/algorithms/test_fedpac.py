"""FedPAC: the count-weighted prototypes, the combination weights of the heads (worked out by hand,
and their limits), the client's statistics, its two stages and its alignment term by hand, the
wire, and one real run."""
from __future__ import annotations

import pytest
import torch
from helpers import head_row, launch_smoke, make_client, make_context
from torch import nn

from htfl_dist.algorithms import ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.fedpac import (
    alignment_loss,
    combination_weights,
    feature_statistics,
    simplex_quadratic_min,
    variance_of_statistics,
)
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

HEAD_FLOATS = 4 * 3 + 3  # make_context's head: Linear(K = 4, C = 3)


def _server(**options):
    entry, context = make_context("fedpac", **options)
    return entry.server(context)


def _upload(class_ids, counts, means, variance, head_value, protos=None):
    means = torch.tensor(means, dtype=torch.float32)
    return {"class_ids": torch.tensor(class_ids), "counts": torch.tensor(counts),
            "protos": means if protos is None else torch.tensor(protos, dtype=torch.float32), "means": means,
            "variance": torch.tensor([float(variance)]), "head": torch.full((1, HEAD_FLOATS), float(head_value))}


def _update(server, uploads):
    return server.update(uploads, 0, torch_generator(0, "server", 0))


def _heads(server):
    download = server.download()
    return dict(zip(download["head_ids"].tolist(), download["heads"], strict=True))


# --------------------------------------------------------------------------- global prototypes


@pytest.mark.parametrize(("proto_avg", "class_0"), [("count_weighted", [2.0, 1.0, 0.0, 0.0]),
                                                    ("uniform", [3.0, 2.0, 0.0, 0.0])])
def test_global_prototypes_by_hand(proto_avg, class_0):
    server = _server(proto_avg=proto_avg)
    uploads = {2: _upload([0], [1], [[0, 0, 0, 0]], 0, 0, protos=[[5, 4, 0, 0]]),
               0: _upload([0, 2], [3, 1], [[0, 0, 0, 0]] * 2, 0, 0, protos=[[1, 0, 0, 0], [0, 2, 0, 0]])}
    _update(server, uploads)
    # count_weighted: class 0 (3·(1, 0) + 1·(5, 4)) / 4 = (2, 1); uniform ((1, 0) + (5, 4)) / 2; class 1 absent
    download = server.download()
    assert download["class_ids"].tolist() == [0, 2]
    torch.testing.assert_close(download["protos"], torch.tensor([class_0, [0.0, 2, 0, 0]]))


# --------------------------------------------------------------------------- combination weights


def _weights(biases, variances, floor=0.0):
    """Client 0's weights for h_j = ``biases`` (one class, K = 1, h_0 = 0) and v_j = ``variances``."""
    stacked = torch.tensor(biases, dtype=torch.float64).view(-1, 1, 1)
    return combination_weights(stacked, torch.tensor(variances, dtype=torch.float64), floor)[0]


def test_two_clients_by_hand():
    # P = diag(v) + [[0, 0], [0, ‖h_0 − h_1‖²]] = diag(1, 1 + 2): α ∝ (1/1, 1/3), so (3/4, 1/4)
    torch.testing.assert_close(_weights([0.0, 2 ** 0.5], [1.0, 1.0]), torch.tensor([0.75, 0.25], dtype=torch.float64))


def test_three_clients_with_opposite_biases_by_hand():
    # b_j = h_0 − h_j = (0, −1, 1), v = (2, 1, 1): P = [[2, 0, 0], [0, 2, −1], [0, −1, 2]]; by symmetry
    # α = (1 − 2a, a, a), f = 2(1 − 2a)² + 2a², f' = 0 at a = 0.4; Pα = (0.4, 0.4, 0.4): KKT holds
    torch.testing.assert_close(_weights([0.0, 1.0, -1.0], [2.0, 1.0, 1.0]),
                               torch.tensor([0.2, 0.4, 0.4], dtype=torch.float64))


def test_a_client_too_far_gets_no_weight():
    # b = (0, −1, −3), v = (1, 1, 1): P = [[1, 0, 0], [0, 2, 3], [0, 3, 10]]; on {0, 1}: α = (2/3, 1/3),
    # αᵀPα = 2/3, and (Pα)_2 = 1 > 2/3, so client 2's constraint is active
    torch.testing.assert_close(_weights([0.0, 1.0, 3.0], [1.0, 1.0, 1.0]),
                               torch.tensor([2 / 3, 1 / 3, 0.0], dtype=torch.float64))


def test_identical_statistics_give_equal_weights():
    stacked = torch.ones(4, 3, 2, dtype=torch.float64)
    weights = combination_weights(stacked, torch.full((4,), 0.5, dtype=torch.float64), 1e-3)
    torch.testing.assert_close(weights, torch.full((4, 4), 0.25, dtype=torch.float64))


def test_without_variance_every_client_keeps_its_own_head():
    stacked = torch.tensor([[[0.0]], [[1.0]], [[3.0]]], dtype=torch.float64)
    weights = combination_weights(stacked, torch.zeros(3, dtype=torch.float64), 1e-3)
    torch.testing.assert_close(weights, torch.eye(3, dtype=torch.float64))


def test_weights_at_the_floor_are_dropped_and_the_rest_renormalised():
    # P = diag(0.0005, 0.4995 + 0.5): α_1 = 0.0005 / 1.0 = 5·10⁻⁴
    raw = _weights([0.0, 0.5 ** 0.5], [0.0005, 0.4995])
    torch.testing.assert_close(raw, torch.tensor([0.9995, 0.0005], dtype=torch.float64))
    torch.testing.assert_close(_weights([0.0, 0.5 ** 0.5], [0.0005, 0.4995], floor=1e-3),
                               torch.tensor([1.0, 0.0], dtype=torch.float64))
    # three clients: (0.2, 0.4, 0.4) under a floor of 0.25 keeps (0, 0.5, 0.5)
    torch.testing.assert_close(_weights([0.0, 1.0, -1.0], [2.0, 1.0, 1.0], floor=0.25),
                               torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64))


def test_the_solver_meets_the_optimality_conditions_on_random_problems():
    """On the simplex, α is optimal iff (Gα)_j ≥ αᵀGα for every j (the KKT conditions); rank-deficient
    Gram matrices (more clients than dimensions) included."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        n, rank = 2 + trial % 9, 1 + trial % 4
        points = torch.randn(n, rank, generator=generator, dtype=torch.float64)
        gram = points @ points.t() + torch.diag(torch.rand(n, generator=generator, dtype=torch.float64) * (trial % 2))
        alpha = simplex_quadratic_min(gram)
        assert bool((alpha >= 0).all()) and abs(float(alpha.sum()) - 1) < 1e-12
        gradient = gram @ alpha
        assert float(alpha @ gradient - gradient.min()) < 1e-10
    torch.testing.assert_close(simplex_quadratic_min(torch.zeros(3, 3, dtype=torch.float64)),
                               torch.full((3,), 1 / 3, dtype=torch.float64))


# --------------------------------------------------------------------------- the server


def test_server_combines_the_heads_with_variances_over_n_by_hand():
    server = _server()
    # client 0: n = 4, μ = (1, 0, 0, 0), V = 8 → v_0 = 2, h_0 = μ; client 1: n = 2, μ = 0, V = 2 → v_1 = 1, h_1 = 0.
    # client 0: P = diag(2, 1 + 1) → (1/2, 1/2); client 1: P = diag(2 + 1, 1) → (1/4, 3/4)
    uploads = {0: _upload([0], [4], [[1, 0, 0, 0]], 8, 4.0, protos=[[2, 0, 0, 0]]),
               1: _upload([0], [2], [[0, 0, 0, 0]], 2, 0.0, protos=[[5, 0, 0, 0]])}
    diagnostics = _update(server, uploads)
    heads = _heads(server)
    torch.testing.assert_close(heads[0], torch.full((HEAD_FLOATS,), 2.0))  # (4 + 0) / 2
    torch.testing.assert_close(heads[1], torch.full((HEAD_FLOATS,), 1.0))  # 4 / 4
    torch.testing.assert_close(server.download()["protos"], torch.tensor([[3.0, 0, 0, 0]]))  # (4·2 + 2·5) / 6
    assert diagnostics == {"global_classes": 1.0, "head_self_weight": pytest.approx(0.625), "head_partners": 2.0}


def test_the_bias_uses_class_shares_not_raw_means():
    """h_j = p_jk·μ_jk: two clients with the same μ but other class shares are biased apart."""
    server = _server()
    same = {0: _upload([0, 1], [1, 1], [[1, 0, 0, 0], [0, 1, 0, 0]], 0, 1.0),
            1: _upload([0, 1], [3, 1], [[1, 0, 0, 0], [0, 1, 0, 0]], 0, 0.0)}
    _update(server, same)
    heads = _heads(server)  # no variance: each keeps its own head unless the biases are equal
    torch.testing.assert_close(heads[0], torch.full((HEAD_FLOATS,), 1.0))
    torch.testing.assert_close(heads[1], torch.full((HEAD_FLOATS,), 0.0))


def test_a_client_out_of_the_round_keeps_its_head_and_state_round_trips():
    server = _server()
    _update(server, {0: _upload([0], [1], [[1, 0, 0, 0]], 0, 5.0), 1: _upload([1], [1], [[0, 1, 0, 0]], 0, 7.0)})
    _update(server, {1: _upload([1], [1], [[0, 1, 0, 0]], 0, 9.0)})
    heads = _heads(server)
    assert heads[0][0] == 5.0 and heads[1][0] == 9.0
    assert server.download()["class_ids"].tolist() == [1]  # this round's classes only
    fresh = _server()
    fresh.load_state_dict(server.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.download().values(), server.download().values(), strict=True))


@pytest.mark.parametrize(("change", "message"), [
    ({"variance": torch.tensor([-1.0])}, r"client 3 sent variance=\[-1.0\], expected one value >= 0"),
    ({"counts": torch.tensor([0])}, "invalid class counts"),
    ({"head": torch.zeros(2, HEAD_FLOATS)}, "client 3 sent 2 head rows, expected 1"),
    ({"means": torch.zeros(2, 4)}, "2 rows"),
    ({"class_ids": torch.tensor([3])}, "outside"),
])
def test_bad_uploads_are_refused(change, message):
    upload = {**_upload([0], [1], [[1, 0, 0, 0]], 0.5, 1.0), **change}
    with pytest.raises(ProtocolError, match=message):
        _server().validate_upload(3, upload)


def test_declared_fields_and_theory_counts():
    entry, context = make_context("fedpac")
    names = [field.name for field in entry.client.upload_fields(context)]
    assert names == ["class_ids", "counts", "protos", "means", "variance", "head"]
    assert all(field.max_rows is not None for field in entry.client.upload_fields(context))
    heads = entry.server.download_fields(context)[-1]
    assert (heads.name, heads.trailing_shape, heads.max_rows) == ("heads", (HEAD_FLOATS,), 2)
    assert entry.server(context).theory_download_floats() == 4 * 3 + HEAD_FLOATS


# --------------------------------------------------------------------------- the client's maths


def test_alignment_loss_by_hand():
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    targets = torch.tensor([[0.0, 0.0], [3.0, 2.0]])
    # (1² + 2² + 0² + 2²) / (2 samples · 2 dims) = 9 / 4
    assert float(alignment_loss(features, torch.tensor([0, 1]), targets)) == pytest.approx(2.25)


def _linear_client(x, y, *, head_lr=0.0, lr=0.5):
    """f(x) = W x with W = I (2 × 2), a zero head Linear(2, 2): logits 0, so CE sends no gradient to W."""
    extractor = nn.Linear(2, 2, bias=False)
    nn.init.eye_(extractor.weight)
    head = nn.Linear(2, 2)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = SplitModel(extractor, head, feature_dim=2)
    x, y = torch.tensor(x), torch.tensor(y)
    return ClientState(0, "tiny", model, torch.optim.SGD(model.parameters(), lr=lr), x, y, x, y, torch.device("cpu"))


def test_statistics_by_hand():
    # class 0: z ∈ {1, 3} (1-D, padded with 0), class 1: z = 2; n = 3, p = (2/3, 1/3)
    client = _linear_client([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]], [0, 1, 0])
    class_ids, counts, means, squares = feature_statistics(client, 2)
    assert class_ids.tolist() == [0, 1] and counts.tolist() == [2, 1]
    torch.testing.assert_close(means, torch.tensor([[2.0, 0.0], [2.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(squares, torch.tensor([5.0, 4.0], dtype=torch.float64))
    # V = 2/3·5 − 4/9·4 + 1/3·4 − 1/9·4 = 22/9: the variance of z ⊗ e_y, E‖·‖² = 14/3, ‖E·‖² = 20/9
    assert variance_of_statistics(counts, means, squares) == pytest.approx(22 / 9)


def test_one_extractor_step_with_the_alignment_term_by_hand():
    # one sample x = (1, 0), y = 0, c_0 = 0: loss = λ·((1 − 0)² + 0²)/2; ∂/∂W = λ·(f − c)·xᵀ = λ·[[1, 0], [0, 0]];
    # SGD at 0.5 with λ = 2: W = I − 0.5·2·[[1, 0], [0, 0]] = [[0, 0], [0, 1]]; the frozen head stays 0
    entry, context = make_context("fedpac", feature_dim=2, num_classes=2, batch_size=1, lr=0.5, lam=2.0)
    client = _linear_client([[1.0, 0.0]], [0])
    loss, seen = entry.client(context).train_extractor(client, torch.zeros(2, 2), torch_generator(0, "b", 0, 0))
    torch.testing.assert_close(client.model.feature_extractor.weight, torch.tensor([[0.0, 0.0], [0.0, 1.0]]))
    assert float(head_row(client.model.head).abs().sum()) == 0.0
    assert (loss, seen) == (pytest.approx(torch.log(torch.tensor(2.0)).item() + 1.0), 1)  # CE ln 2 + 2·1/2
    assert all(p.requires_grad for p in client.model.parameters())


def test_the_head_stage_leaves_the_feature_extractor_unchanged():
    entry, context = make_context("fedpac", head_lr=0.5)
    client = make_client(context, 1)
    extractor = head_row(client.model.feature_extractor).clone()
    head = head_row(client.model.head).clone()
    entry.client(context).train_head(client, torch_generator(0, "b", 1, 0))
    assert torch.equal(head_row(client.model.feature_extractor), extractor)
    assert not torch.equal(head_row(client.model.head), head)
    assert all(p.requires_grad for p in client.model.parameters())


def test_the_head_stage_runs_head_epochs_at_head_lr():
    entry, context = make_context("fedpac", head_epochs=3, head_lr=1e-9)
    client = make_client(context, 1)
    _, seen = entry.client(context).train_head(client, torch_generator(0, "b", 1, 0))
    assert seen == 3 * 8  # 9 samples in batches of 4, the final single sample skipped, three times
    entry, context = make_context("fedpac", head_lr=None, lr=0.0)  # null: the client's rate, here 0
    client = make_client(context, 1)
    head = head_row(client.model.head).clone()
    entry.client(context).train_head(client, torch_generator(0, "b", 1, 0))
    assert torch.equal(head_row(client.model.head), head)


# --------------------------------------------------------------------------- the client's round


def _knowledge(context, protos=None, heads=None):
    class_ids = torch.arange(context.num_classes) if protos is not None else torch.empty(0, dtype=torch.int64)
    head_ids, head_rows = zip(*heads.items(), strict=True) if heads else ((), ())
    return {"class_ids": class_ids,
            "protos": protos if protos is not None else torch.empty(0, context.feature_dim),
            "head_ids": torch.tensor(head_ids, dtype=torch.int64),
            "heads": torch.stack(head_rows) if heads else torch.empty(0, HEAD_FLOATS)}


def test_the_round_installs_its_own_head_measures_before_and_uploads_after():
    entry, context = make_context("fedpac")
    client = make_client(context, 1)
    own = torch.full((HEAD_FLOATS,), 0.125)
    knowledge = _knowledge(context, heads={0: torch.zeros(HEAD_FLOATS), 1: own})
    algorithm = entry.client(context)
    algorithm.prepare_evaluation(client, knowledge)
    torch.testing.assert_close(head_row(client.model.head)[0], own)
    _, _, before, _ = feature_statistics(client, context.num_classes)
    result = algorithm.train(client, knowledge, 0, torch_generator(0, "b", 1, 0))
    upload = result.upload
    torch.testing.assert_close(upload["means"], before.float())  # the statistics of the model it started from
    _, _, after, _ = feature_statistics(client, context.num_classes)
    torch.testing.assert_close(upload["protos"], after.float())  # the prototypes of the trained one
    assert not torch.allclose(upload["protos"], upload["means"])
    assert torch.equal(knowledge["heads"][1], own)  # training did not write into the shared download
    floats = sum(upload[key].numel() for key in ("protos", "means", "variance", "head"))
    assert algorithm.theory_upload_floats(client) == floats == 2 * 4 * 3 + 1 + HEAD_FLOATS


def test_a_client_without_a_combined_head_keeps_its_own():
    entry, context = make_context("fedpac")
    client = make_client(context, 1)
    head = head_row(client.model.head).clone()
    entry.client(context).prepare_evaluation(client, _knowledge(context, heads={0: torch.zeros(HEAD_FLOATS)}))
    assert torch.equal(head_row(client.model.head), head)


def _trained_extractor(lam, protos):
    entry, context = make_context("fedpac", lam=lam)
    client = make_client(context, 1)
    entry.client(context).train(client, _knowledge(context, protos=protos), 0, torch_generator(0, "b", 1, 0))
    return head_row(client.model.feature_extractor)


def test_alignment_applies_only_once_global_prototypes_exist():
    assert torch.equal(_trained_extractor(0.0, None), _trained_extractor(5.0, None))  # CE alone in round 1
    protos = torch.full((3, 4), 3.0)
    assert torch.equal(_trained_extractor(0.0, protos), _trained_extractor(0.0, None))
    assert not torch.equal(_trained_extractor(5.0, protos), _trained_extractor(0.0, protos))


def test_alignment_targets_fall_back_on_the_clients_own_means():
    entry, context = make_context("fedpac")
    knowledge = {"class_ids": torch.tensor([2]), "protos": torch.full((1, 4), 7.0)}
    means = torch.arange(12, dtype=torch.float64).view(3, 4)
    targets = entry.client(context).alignment_targets(knowledge, torch.tensor([0, 1, 2]), means, torch.device("cpu"))
    torch.testing.assert_close(targets, torch.cat([means[:2].float(), torch.full((1, 4), 7.0)]))


# --------------------------------------------------------------------------- options and models


def test_heterogeneous_heads_are_refused():
    entry, context = make_context("fedpac", group="htcnn1:fc,htcnn2:fc512")
    with pytest.raises(ConfigError, match="FedPAC shares the head"):
        entry.client.check_models(context)


@pytest.mark.parametrize(("options", "key"), [({"lam": -1.0}, "algo.lam"), ({"head_epochs": 0}, "algo.head_epochs"),
                                              ({"head_lr": 0.0}, "algo.head_lr"),
                                              ({"proto_avg": "median"}, "algo.proto_avg"),
                                              ({"weight_floor": 1.0}, "algo.weight_floor")])
def test_bad_options_name_their_key(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_options(get_algorithm("fedpac"), options)


@pytest.mark.integration
def test_real_run(single_run):
    rows = launch_smoke(single_run, "fedpac")
    assert all(r["test_acc"] == r["test_acc_head"] for r in rows)  # inference is the personalised head
    assert all(0 < r["head_self_weight"] <= 1 and r["head_partners"] >= 1 for r in rows)
