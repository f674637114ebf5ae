"""FedNH maths by hand: the spread of the initial prototypes (its gradient, one and two steps, the
simplex it reaches, the reference's orthogonal draw), the server's count-weighted smoothing, the
client's cosine loss and learnt scale, what it uploads, how it predicts, and the options."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import tiny_identity_client

from htfl_dist import testing
from htfl_dist.algorithms import AlgorithmContext, get_algorithm, parse_options
from htfl_dist.algorithms.fednh import (
    SCALE_MODULE,
    TRAINED_MODULE,
    initial_prototypes,
    largest_cosines,
    orthogonal_rows,
    smooth_max_gradient,
    smooth_prototypes,
    spread_on_sphere,
)
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.runtime.evaluation import test_client as score_client
from htfl_dist.seeding import torch_generator

DEFAULT_SPREAD: dict[str, Any] = {"steps": 1000, "lr": 0.1, "momentum": 0.9, "temperature": 10.0}


def _context(num_classes=2, feature_dim=2, batch_size=10, seed=0, **options):
    entry = get_algorithm("fednh")
    return entry, AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=seed,
                                   train=TrainConfig(batch_size=batch_size), options=parse_options(entry, options))


def _server(prototypes=None, **kwargs):
    entry, context = _context(**kwargs)
    server = entry.server(context)
    if prototypes is not None:
        server.load_state_dict({"protos": torch.tensor(prototypes)})
    return server


def _upload(class_ids, means, counts):
    return {"class_ids": torch.tensor(class_ids), "protos": torch.tensor(means), "counts": torch.tensor(counts)}


def _unit(*values):
    row = torch.tensor(values)
    return row / row.norm()


# ------------------------------------------------------------------------------ the spread

def test_smooth_max_gradient_by_hand():
    """(1, 0), (0, 1), (−1, 0) with τ = ln 2: cosines 0, −1, 0, so exp(τ·cos) is 1 for the four
    ordered pairs at 90° and 1/2 for the two antipodal ones; Σ = 5, w = 1/5 and 1/10.
    ∂L/∂P^1 = 2(P^2/5 + P^3/10) = (−0.2, 0.4), ∂L/∂P^2 = 2(P^1 + P^3)/5 = 0, ∂L/∂P^3 = (0.2, 0.4)."""
    units = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    gradient = smooth_max_gradient(units, math.log(2))
    torch.testing.assert_close(gradient, torch.tensor([[-0.2, 0.4], [0.0, 0.0], [0.2, 0.4]]))
    # two rows: one pair each way, w = 1/2 whatever τ; the gradient of each is the other
    torch.testing.assert_close(smooth_max_gradient(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 7.0),
                               torch.tensor([[0.0, 1.0], [1.0, 0.0]]))


def test_one_spread_step_by_hand():
    """From (2, 0) and (0, 3): on the sphere (1, 0) and (0, 1) first; v = ∇ = (0, 1) and (1, 0);
    P^1 = (1, −0.1)/√1.01, P^2 = (−0.1, 1)/√1.01."""
    units = spread_on_sphere(torch.tensor([[2.0, 0.0], [0.0, 3.0]]), 1, 0.1, 0.9, 10.0)
    root = math.sqrt(1.01)
    torch.testing.assert_close(units, torch.tensor([[1 / root, -0.1 / root], [-0.1 / root, 1 / root]]))


def test_two_spread_steps_keep_the_momentum():
    """Step 2 by the mirror symmetry P^2 = (b, a), P^1 = (a, b), a = 1/√1.01, b = −0.1/√1.01:
    ∇_1 = P^2 = (b, a), v_1 = 0.9·(0, 1) + (b, a), P^1 = (a − 0.1b, b − 0.1(0.9 + a))/‖·‖."""
    a, b = 1 / math.sqrt(1.01), -0.1 / math.sqrt(1.01)
    x, y = a - 0.1 * b, b - 0.1 * (0.9 + a)
    norm = math.hypot(x, y)
    units = spread_on_sphere(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 2, 0.1, 0.9, 10.0)
    torch.testing.assert_close(units[0], torch.tensor([x / norm, y / norm]))
    torch.testing.assert_close(units[1], torch.tensor([y / norm, x / norm]))


@pytest.mark.parametrize("count,dim", [(2, 5), (3, 2), (4, 3), (10, 512)])
def test_spread_reaches_the_regular_simplex(count, dim):
    """C ≤ K + 1: every pairwise cosine −1/(C − 1) (antipodal pair, 120° in the plane, the
    tetrahedron, the 10-point simplex of the config's K = 512), unit rows."""
    draw = torch.randn(count, dim, generator=torch.Generator().manual_seed(3))
    units = spread_on_sphere(draw, **DEFAULT_SPREAD)
    torch.testing.assert_close(units.norm(dim=1), torch.ones(count))
    cosines = (units @ units.t())[~torch.eye(count, dtype=torch.bool)]
    torch.testing.assert_close(cosines, torch.full_like(cosines, -1 / (count - 1)), atol=1e-4, rtol=0)


def test_spread_of_one_row_or_no_step_is_the_normalised_draw():
    torch.testing.assert_close(spread_on_sphere(torch.tensor([[3.0, 4.0]]), **DEFAULT_SPREAD),
                               torch.tensor([[0.6, 0.8]]))
    draw = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    torch.testing.assert_close(spread_on_sphere(draw, 0, 0.1, 0.9, 10.0), torch.tensor([[0.6, 0.8], [0.0, 1.0]]))


def test_largest_cosines_by_hand():
    units = torch.stack([_unit(1.0, 0.0), _unit(0.6, 0.8), _unit(0.0, 1.0)])
    torch.testing.assert_close(largest_cosines(units), torch.tensor([0.6, 0.8, 0.8]))


def test_orthogonal_draw_is_the_reference_codes_init():
    """The reference's ``torch.nn.init.orthogonal_`` under torch.manual_seed(s) draws the same
    numbers as our generator seeded with s: the same rows, orthonormal for C ≤ K, unit for C > K."""
    for count, dim in [(10, 32), (4, 4), (6, 3)]:
        torch.manual_seed(11)
        expected = torch.nn.init.orthogonal_(torch.empty(count, dim))
        rows = orthogonal_rows(count, dim, torch.Generator().manual_seed(11))
        torch.testing.assert_close(rows.norm(dim=1), torch.ones(count))
        if count <= dim:
            torch.testing.assert_close(rows, expected)
            torch.testing.assert_close(rows @ rows.t(), torch.eye(count), atol=1e-5, rtol=0)
        else:  # orthonormal columns; the rows are then put on the sphere
            torch.testing.assert_close(rows, expected / expected.norm(dim=1, keepdim=True))


def test_initial_prototypes_come_from_the_seed_alone():
    """Two servers of one seed hold the same P^0 (every rank that builds one agrees); another seed
    another; the default spread is the simplex, the orthogonal init has cosines 0."""
    first, again, other = (_server(num_classes=5, feature_dim=8, seed=s, init="spread").download()["protos"]
                           for s in (0, 0, 1))
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.allclose(first, other)
    assert float(largest_cosines(first).max()) == pytest.approx(-0.25, abs=1e-4)
    orthogonal = _server(num_classes=5, feature_dim=8, init="orthogonal").download()["protos"]
    assert float(largest_cosines(orthogonal).abs().max()) < 1e-5
    _, context = _context(num_classes=5, feature_dim=8, init="spread", init_steps=0)
    draw = initial_prototypes(context.options, 5, 8, torch_generator(0, "fednh-prototypes"))
    torch.testing.assert_close(draw, torch.nn.functional.normalize(
        torch.randn(5, 8, generator=torch_generator(0, "fednh-prototypes")), dim=1))


# ------------------------------------------------------------------------------ the server

def test_smoothing_by_hand():
    """ρ = 0.9: (1, 0) towards (0, 1) gives (0.9, 0.1)/√0.82; an absent class keeps its row."""
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    aggregate = torch.tensor([[0.0, 1.0], [5.0, 5.0]])
    smoothed = smooth_prototypes(prototypes, aggregate, torch.tensor([True, False]), 0.9)
    torch.testing.assert_close(smoothed, torch.stack([_unit(0.9, 0.1), torch.tensor([0.0, 1.0])]))


def test_server_update_weights_the_class_means_by_counts():
    """P = (1, 0), (0, 1), (−1, 0). Class 0: (0, 1) from 3 samples and (1, 0) from 1, so
    a^0 = (0.25, 0.75) (the plain mean would be (0.5, 0.5)); P^0 ← (0.925, 0.075)/‖·‖. Class 1:
    a^1 = (1, 0), P^1 ← (0.1, 0.9)/‖·‖. Class 2: nobody, unchanged."""
    server = _server([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], num_classes=3, normalise_aggregate=False)
    uploads = {5: _upload([0], [[0.0, 1.0]], [3]), 2: _upload([0, 1], [[1.0, 0.0], [1.0, 0.0]], [1, 2])}
    metrics = server.update(uploads, 0, torch_generator(0, "s"))
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1, 2]
    expected = torch.stack([_unit(0.925, 0.075), _unit(0.1, 0.9), torch.tensor([-1.0, 0.0])])
    torch.testing.assert_close(download["protos"], expected)
    assert metrics["global_classes"] == 2
    assert metrics["proto_max_cos"] == pytest.approx(float(expected[0] @ expected[1]))


def test_server_update_with_the_reference_codes_normalised_aggregate():
    """a^0 = (0.25, 0.75) put on the sphere first: (0.25, 0.75)/√0.625, then smoothed."""
    server = _server([[1.0, 0.0], [0.0, 1.0]], normalise_aggregate=True)
    server.update({0: _upload([0], [[0.0, 1.0]], [3]), 1: _upload([0], [[1.0, 0.0]], [1])}, 0,
                  torch_generator(0, "s"))
    length = math.sqrt(0.625)
    torch.testing.assert_close(server.download()["protos"][0], _unit(0.9 + 0.1 * 0.25 / length, 0.1 * 0.75 / length))


@pytest.mark.parametrize("smoothing,expected", [(1.0, [1.0, 0.0]), (0.0, [0.6, 0.8]), (0.5, [1.3, 0.4])])
def test_smoothing_edges(smoothing, expected):
    """a^0 = (0.3, 0.4), not a unit row: ρ = 1 never moves; ρ = 0 takes a^c on the sphere,
    (0.6, 0.8); ρ = 0.5 the direction of ((1, 0) + (0.3, 0.4))/2, i.e. of (1.3, 0.4)."""
    server = _server([[1.0, 0.0], [0.0, 1.0]], smoothing=smoothing, normalise_aggregate=False)
    server.update({0: _upload([0], [[0.3, 0.4]], [2])}, 0, torch_generator(0, "s"))
    torch.testing.assert_close(server.download()["protos"][0], _unit(*expected))


def test_uploads_are_checked():
    server = _server()
    with pytest.raises(ProtocolError, match="invalid class counts"):
        server.validate_upload(0, _upload([0], [[1.0, 0.0]], [0]))
    with pytest.raises(ProtocolError, match="invalid class counts"):
        server.validate_upload(0, _upload([0, 1], [[1.0, 0.0], [0.0, 1.0]], [4]))
    with pytest.raises(ProtocolError, match="twice"):
        server.validate_upload(0, _upload([1, 1], [[1.0, 0.0], [0.0, 1.0]], [1, 1]))
    server.validate_upload(0, _upload([1], [[1.0, 0.0]], [4]))


def test_state_round_trips():
    server = _server()
    before = server.download()
    torch.testing.assert_close(server.download()["protos"], before["protos"], rtol=0, atol=0)
    server.update({0: _upload([1], [[0.3, 0.4]], [2])}, 1, torch_generator(0, "s"))
    fresh = _server()
    fresh.load_state_dict(server.state_dict())
    torch.testing.assert_close(fresh.download()["protos"], server.download()["protos"], rtol=0, atol=0)


# ------------------------------------------------------------------------------ the client

KNOWLEDGE = {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}


def _identity_layer() -> torch.nn.Linear:
    """f(x) = x through a parameter (a loss with s fixed needs something to train)."""
    layer = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(2))
    return layer


def _train(x, y, lr=0.0, **options):
    entry, context = _context(**options)
    algorithm = entry.client(context)
    extractor = None if context.options.learn_scale else _identity_layer()
    client = tiny_identity_client(x, y, lr=lr, extractor=extractor)
    algorithm.init_client(client)
    return algorithm, client, algorithm.train(client, KNOWLEDGE, 1, torch_generator(0, "t"))


def test_client_loss_is_ce_on_scaled_cosines():
    """f = (3, 4) of class 0 and (0, 2) of class 1: cosines (0.6, 0.8) and (0, 1); with s = 1
    CE = ln(1 + e^0.2) and ln(1 + e^−1); with s = 30, ln(1 + e^6) and ln(1 + e^−30)."""
    _, _, result = _train([[3.0, 4.0], [0.0, 2.0]], [0, 1])
    assert result.samples == 2
    assert result.loss_sum / 2 == pytest.approx((math.log1p(math.exp(0.2)) + math.log1p(math.exp(-1))) / 2, rel=1e-6)
    _, _, result = _train([[3.0, 4.0], [0.0, 2.0]], [0, 1], scale=30.0, learn_scale=False)
    assert result.loss_sum / 2 == pytest.approx((math.log1p(math.exp(6)) + math.log1p(math.exp(-30))) / 2, rel=1e-6)


def test_client_learns_its_scale():
    """∂L/∂s = mean over samples of Σ_c (p_c − y_c)·cos_c at s = 1: sample 1 gives 0.2·σ(0.2),
    sample 2 −1/(1 + e); one SGD step at lr 0.5 moves s by −0.5 times their mean. With
    learn_scale=False s stays; clipping at 0.01 moves it by exactly 0.5·0.01."""
    sigma = 1 / (1 + math.exp(-0.2))
    gradient = (0.2 * sigma - 1 / (1 + math.e)) / 2
    x, y = [[3.0, 4.0], [0.0, 2.0]], [0, 1]
    algorithm, client, _ = _train(x, y, lr=0.5)
    assert float(algorithm.scale(client).detach()) == pytest.approx(1 - 0.5 * gradient, rel=1e-6)
    algorithm, client, _ = _train(x, y, lr=0.5, learn_scale=False)
    assert float(algorithm.scale(client).detach()) == 1.0
    algorithm, client, _ = _train(x, y, lr=0.5, clip_grad_norm=0.01)
    assert float(algorithm.scale(client).detach()) == pytest.approx(1 + 0.5 * 0.01, rel=1e-6)  # the gradient is < 0
    assert isinstance(client.modules[SCALE_MODULE], torch.nn.Module)


def test_client_uploads_means_of_unit_features_and_counts():
    """Class 0: (3, 4) and (0, 5) → (0.6, 0.8) and (0, 1), mean (0.3, 0.9), 2 samples; class 1:
    (2, 0) → (1, 0), 1 sample. The reference's normalise_client_means puts (0.3, 0.9) on the sphere."""
    x, y = [[3.0, 4.0], [2.0, 0.0], [0.0, 5.0]], [0, 1, 0]
    _, _, result = _train(x, y, normalise_client_means=False)
    upload = result.upload
    assert upload["class_ids"].tolist() == [0, 1] and upload["counts"].tolist() == [2, 1]
    torch.testing.assert_close(upload["protos"], torch.tensor([[0.3, 0.9], [1.0, 0.0]]))
    _, _, result = _train(x, y, normalise_client_means=True)
    torch.testing.assert_close(result.upload["protos"], torch.stack([_unit(0.3, 0.9), torch.tensor([1.0, 0.0])]))


def test_client_predicts_the_largest_scaled_cosine():
    """Feature lengths play no part: (10, 1) → class 0, (−1, 3) → class 1, (0.1, 0.2) → class 1;
    the downloaded class ids are what comes back."""
    entry, context = _context()
    algorithm = entry.client(context)
    client = tiny_identity_client([[1.0, 0.0]], [0])
    algorithm.init_client(client)
    features = torch.tensor([[10.0, 1.0], [-1.0, 3.0], [0.1, 0.2]])
    assert algorithm.predict(client, KNOWLEDGE, features, torch.zeros(3, 2)).tolist() == [0, 1, 1]
    swapped = {"class_ids": torch.tensor([1, 0]), "protos": KNOWLEDGE["protos"]}
    assert algorithm.predict(client, swapped, features, torch.zeros(3, 2)).tolist() == [1, 0, 0]


UPDATED = {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[0.0, 1.0], [1.0, 0.0]])}
"""The server's prototypes after the round: KNOWLEDGE's two rows swapped."""


def test_a_client_is_scored_with_the_prototypes_it_trained_against():
    """Trained (lr 0: model and s stay) against P = (1, 0), (0, 1); scored after the server moved to
    P' = (0, 1), (1, 0). The feature (10, 1) has cosines (10, 1)/√101 with P: class 0, its label;
    with P', (1, 10)/√101: class 1. trained: right (1 of 1 through the runtime's test); updated:
    wrong (0 of 1); a client that has not trained yet is scored with the download."""
    x, y, features = [[10.0, 1.0]], [0], torch.tensor([[10.0, 1.0]])
    algorithm, client, _ = _train(x, y)
    assert algorithm.predict(client, UPDATED, features, torch.zeros(1, 2)).tolist() == [0]
    assert score_client(algorithm, client, UPDATED, 2)[0::2][:2] == [1.0, 1.0]  # (correct, samples)
    algorithm, client, _ = _train(x, y, eval_prototypes="updated")
    assert algorithm.predict(client, UPDATED, features, torch.zeros(1, 2)).tolist() == [1]
    assert score_client(algorithm, client, UPDATED, 2)[0::2][:2] == [0.0, 1.0]
    assert TRAINED_MODULE not in client.modules  # runs under updated keep the modules they had
    entry, context = _context()
    untrained = tiny_identity_client(x, y)
    entry.client(context).init_client(untrained)
    assert entry.client(context).predict(untrained, UPDATED, features, torch.zeros(1, 2)).tolist() == [1]


def test_the_trained_against_prototypes_travel_with_the_clients_state():
    """The table is a module's buffers: a fresh client loaded from the state scores as the trained one."""
    algorithm, client, _ = _train([[10.0, 1.0]], [0])
    state = {name: module.state_dict() for name, module in client.modules.items()}
    torch.testing.assert_close(state[TRAINED_MODULE]["protos"], KNOWLEDGE["protos"])
    fresh = tiny_identity_client([[10.0, 1.0]], [0])
    algorithm.init_client(fresh)
    for name, module in fresh.modules.items():
        module.load_state_dict(state[name])
    assert algorithm.predict(fresh, UPDATED, torch.tensor([[10.0, 1.0]]), torch.zeros(1, 2)).tolist() == [0]


# ------------------------------------------------------------------------------ options and a run

def test_defaults_are_the_reference_codes():
    """Issue 47: nothing set resolves to compat=reference, Yutong-Dai/FedNH@60c3161's values:
    orthogonal start, both normalisations, clipping at 10, clients scored with the prototypes
    they trained against; ρ and s from its yaml files and CNN."""
    options = parse_options(get_algorithm("fednh"), {})
    assert (options.compat, options.smoothing, options.scale, options.learn_scale) == ("reference", 0.9, 1.0, True)
    assert (options.init, options.normalise_client_means, options.normalise_aggregate, options.clip_grad_norm,
            options.eval_prototypes) == ("orthogonal", True, True, 10.0, "trained")
    assert (options.init_steps, options.init_lr, options.init_momentum, options.init_temperature) == \
        (1000, 0.1, 0.9, 10.0)


def test_compat_paper_is_the_recalled_equations():
    """compat=paper: the spread, plain means, no clipping (the defaults before issue 47); the
    evaluation rule is not part of the preset (the code's is the only one known)."""
    options = parse_options(get_algorithm("fednh"), {"compat": "paper"})
    assert (options.init, options.normalise_client_means, options.normalise_aggregate, options.clip_grad_norm,
            options.eval_prototypes) == ("spread", False, False, None, "trained")


@pytest.mark.parametrize("options,message", [
    ({"smoothing": 1.5}, r"^config key 'algo.smoothing' must be in \[0, 1\], got 1.5$"),
    ({"init_momentum": 1.0}, r"^config key 'algo.init_momentum' must be in \[0, 1\), got 1.0$"),
    ({"scale": 0.0}, r"^config key 'algo.scale' must be > 0, got 0.0$"),
    ({"init_steps": -1}, r"^config key 'algo.init_steps' must be >= 0, got -1$"),
    ({"clip_grad_norm": -1.0}, r"^config key 'algo.clip_grad_norm' must be >= 0"),
    ({"init": "etf"}, r"algo.init"),
])
def test_option_errors_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        _context(**options)


def test_real_run(single_run):
    """Two rounds on the smoke config (the run the conformance checks share): it learns from
    round 1 (the fixed spread prototypes are a classifier from the start), sends K floats per class
    held, and the prototypes stay apart after the semantics are smoothed in."""
    _, rows = single_run(*testing.run_overrides("fednh"))
    assert [row["round"] for row in rows] == [1, 2]
    assert rows[1]["test_acc"] > 0.3  # 10 classes: chance is 0.1
    for row in rows:
        assert 1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.05, row
        assert 0 < row["global_classes"] <= 10 and row["proto_max_cos"] < 0.5


def test_compat_reference_sets_the_knobs_left_unset_to_the_reference_codes():
    """Yutong-Dai/FedNH: orthogonal start, both normalisations, clipping at 10; a knob set by hand wins."""
    options = parse_options(get_algorithm("fednh"), {"compat": "reference"})
    assert (options.init, options.normalise_client_means, options.normalise_aggregate, options.clip_grad_norm) == \
        ("orthogonal", True, True, 10.0)
    mixed = parse_options(get_algorithm("fednh"),
                          {"compat": "reference", "init": "spread", "normalise_aggregate": False})
    assert (mixed.init, mixed.normalise_client_means, mixed.normalise_aggregate) == ("spread", True, False)


def test_the_hash_leaves_out_what_runs_before_issue_47_computed():
    """compat=paper and eval_prototypes=updated (what an unset key computed before) are left out of
    the hash, so those runs keep theirs; the new defaults count (compat as 'htfllib', as an
    explicit reference run always hashed), so a config that sets nothing has a new hash."""
    from htfl_dist.resolution import resolved_config
    old = resolved_config(None, ["algorithm=fednh", "algo.compat=paper", "algo.eval_prototypes=updated"])
    assert "compat" not in old.experiment()["algo"] and "eval_prototypes" not in old.experiment()["algo"]
    default = resolved_config(None, ["algorithm=fednh"])
    assert (default.experiment()["algo"]["compat"], default.experiment()["algo"]["eval_prototypes"]) == \
        ("htfllib", "trained")
    paper = resolved_config(None, ["algorithm=fednh", "algo.compat=paper"])
    assert len({old.config_hash(), paper.config_hash(), default.config_hash()}) == 3


def test_an_old_checkpoint_reads_as_the_values_before():
    """A stored view without compat and eval_prototypes reads as paper and updated, not as today's
    defaults: resumed under the new default the differences are named."""
    from htfl_dist.resolution import resolved_config
    from htfl_dist.runtime.checkpoint import _changes_since
    old = resolved_config(None, ["algorithm=fednh", "algo.compat=paper", "algo.eval_prototypes=updated"])
    manifest = {"config_hash": old.config_hash(), "experiment": old.experiment()}
    assert _changes_since(manifest, old) == []
    paper = resolved_config(None, ["algorithm=fednh", "algo.compat=paper"])
    assert _changes_since(manifest, paper) == ["algo.eval_prototypes: None -> 'trained'"]
