"""FedPCL maths by hand: the prototype-wise contrastive term, the padding of a client's local
prototypes with the global ones, the whole loss under each option, the uploaded means of unit
features, the server's global mean and its set of local prototypes, inference, and the options."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_identity_client
from torch import nn

from htfl_dist import testing
from htfl_dist.algorithms import AlgorithmContext, get_algorithm, parse_options
from htfl_dist.algorithms.fedpcl import contrastive_terms, padded
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.seeding import torch_generator


def softplus(value: float) -> float:
    """log(1 + e^v): the two-class −log softmax of a logit gap −v."""
    return math.log1p(math.exp(value))


def _context(num_classes=2, feature_dim=2, batch_size=10, lr=0.0, num_clients=3, **options):
    entry = get_algorithm("fedpcl")
    return entry, AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=0,
                                   train=TrainConfig(batch_size=batch_size, lr=lr), num_clients=num_clients,
                                   options=parse_options(entry, options))


def _linear_client(x, y, lr=0.0):
    """features = W x with W = I (trainable), so the features are x and the loss reaches W."""
    extractor = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        extractor.weight.copy_(torch.eye(2))
    return tiny_identity_client(x, y, extractor=extractor, lr=lr)


def _knowledge(rows):
    """A download from (owner, class, prototype) rows; owner −1 is the global table."""
    return {"owners": torch.tensor([r[0] for r in rows]), "class_ids": torch.tensor([r[1] for r in rows]),
            "protos": torch.tensor([r[2] for r in rows])}


def _upload(class_ids, protos):
    return {"class_ids": torch.tensor(class_ids), "protos": torch.tensor(protos)}


# ------------------------------------------------------------------------------ the contrastive term

def test_contrastive_term_by_hand():
    """(3, 4) → z = (0.6, 0.8); against c^0 = (1, 0), c^1 = (0, 1) at τ = 0.5 the logits are
    (1.2, 1.6), so class 0 costs log(1 + e^0.4). (0, 5) → z = (0, 1), logits (0, 2), class 1 costs
    log(1 + e^−2). The term is their mean."""
    table = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    available = torch.tensor([[True, True]])
    features = torch.tensor([[3.0, 4.0], [0.0, 5.0]])
    terms = contrastive_terms(features, torch.tensor([0, 1]), table, available, 0.5)
    assert terms.shape == (1,)
    assert float(terms[0]) == pytest.approx((softplus(0.4) + softplus(-2.0)) / 2, rel=1e-6)
    single = contrastive_terms(features[:1], torch.tensor([1]), table, available, 1.0)
    assert float(single[0]) == pytest.approx(softplus(-0.2), rel=1e-6)  # logits (0.6, 0.8), class 1


def test_a_table_without_the_samples_class_leaves_the_sample_out():
    """A table holding class 0 alone: class 0's sample has one column, its own (−log 1 = 0); the
    class-1 sample has no positive there and is not counted in that table's mean."""
    tables = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])
    available = torch.tensor([[True, False], [True, True]])
    features = torch.tensor([[3.0, 4.0], [0.0, 5.0]])
    terms = contrastive_terms(features, torch.tensor([0, 1]), tables, available, 1.0)
    assert float(terms[0]) == pytest.approx(0.0, abs=1e-7)
    assert float(terms[1]) == pytest.approx((softplus(0.2) + softplus(-1.0)) / 2, rel=1e-6)
    weights = torch.tensor([0.0, 1.0])  # a padded first row counts nowhere
    terms = contrastive_terms(features, torch.tensor([0, 1]), tables, available, 1.0, weights)
    assert float(terms[1]) == pytest.approx(softplus(-1.0), rel=1e-6)


def test_padding_takes_the_global_prototype_for_classes_the_client_lacks():
    own = (torch.tensor([[0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([True, False, False]))
    global_table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    table, mask = padded(own, global_table, torch.tensor([True, True, False]))
    torch.testing.assert_close(table, torch.tensor([[0.5, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    assert mask.tolist() == [True, True, False]


# ------------------------------------------------------------------------------ the client's loss

KNOWLEDGE = [(-1, 0, [1.0, 0.0]), (-1, 1, [0.0, 1.0]),       # c̄
             (0, 0, [0.6, 0.8]),                              # client 0 holds class 0 only
             (1, 0, [0.0, 1.0]), (1, 1, [1.0, 0.0])]          # client 1, its classes swapped
GLOBAL = softplus(-1.0)   # z = (1, 0), class 0: logits (1, 0) against c̄
OWN = softplus(-0.6)      # client 0 padded: c^0 = (0.6, 0.8), c^1 = c̄^1 = (0, 1): logits (0.6, 0)
OTHER = softplus(1.0)     # client 1: logits (0, 1)


@pytest.mark.parametrize("options,expected", [
    ({}, GLOBAL + (OWN + OTHER) / 2),
    ({"local_reduction": "sum"}, GLOBAL + OWN + OTHER),
    ({"local_from": "others"}, GLOBAL + OTHER),
    ({"global_term": False}, (OWN + OTHER) / 2),
    ({"global_term": False, "local_reduction": "sum"}, OWN + OTHER),  # the official code's
])
def test_client_loss_by_hand(options, expected):
    """One sample x = (1, 0) of class 0 at τ = 1, trained by client 0 (lr 0: the loss is read only)."""
    entry, context = _context(tau=1.0, **options)
    client = _linear_client([[1.0, 0.0]], [0])
    result = entry.client(context).train(client, _knowledge(KNOWLEDGE), 1, torch_generator(0, "t"))
    assert result.samples == 1
    assert result.loss_sum == pytest.approx(expected, rel=1e-6)


def test_temperature_scales_the_logits():
    """τ = 0.5 doubles every logit gap: log(1 + e^−2) + (log(1 + e^−1.2) + log(1 + e^2))/2."""
    entry, context = _context(tau=0.5)
    client = _linear_client([[1.0, 0.0]], [0])
    result = entry.client(context).train(client, _knowledge(KNOWLEDGE), 1, torch_generator(0, "t"))
    assert result.loss_sum == pytest.approx(softplus(-2.0) + (softplus(-1.2) + softplus(2.0)) / 2, rel=1e-6)


def test_one_step_by_hand():
    """One step of lr 1 on W = I from x = (1, 0) of class 1, c̄ = (e_0, e_1), no local sets, τ = 1:
    z = (1, 0), p = softmax(1, 0) = (σ(1), σ(−1)), ∂L/∂z = p_0·e_0 + p_1·e_1 − e_1 = σ(1)·(1, −1);
    the normalisation keeps only the part orthogonal to z, (0, −σ(1)), so ∂L/∂W = [[0, 0], [−σ(1), 0]]
    and the feature of x becomes (1, σ(1))."""
    entry, context = _context(tau=1.0, lr=1.0)
    client = _linear_client([[1.0, 0.0]], [1], lr=1.0)
    knowledge = _knowledge([(-1, 0, [1.0, 0.0]), (-1, 1, [0.0, 1.0])])
    result = entry.client(context).train(client, knowledge, 1, torch_generator(0, "t"))
    assert result.loss_sum == pytest.approx(softplus(1.0), rel=1e-6)
    sigma = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(client.model.feature_extractor.weight.detach(), torch.tensor([[1.0, 0.0], [sigma, 1.0]]))


def test_gradient_clipping_bounds_the_step():
    """``clip_grad_norm`` = 1e-3 at lr 1: W moves by exactly 1e-3 (the raw gradient is far larger)."""
    knowledge = _knowledge(KNOWLEDGE)
    moved = {}
    for clip in (0.0, 1e-3):
        entry, context = _context(tau=1.0, lr=1.0, clip_grad_norm=clip)
        client = _linear_client([[1.0, 0.0]], [0], lr=1.0)
        entry.client(context).train(client, knowledge, 1, torch_generator(0, "t"))
        moved[clip] = float((client.model.feature_extractor.weight.detach() - torch.eye(2)).norm())
    assert moved[0.0] > 0.05  # 0: no clipping
    assert moved[1e-3] == pytest.approx(1e-3, rel=1e-4)


def test_upload_is_the_mean_of_unit_features_and_the_first_round_does_not_train():
    """Nothing downloaded yet: no step (lr 1 would move W), 0 samples; c^0 = ((0.6, 0.8) +
    (0, 1))/2 = (0.3, 0.9), not normalised again, and c^1 = (1, 0)."""
    entry, context = _context(lr=1.0)
    client = _linear_client([[3.0, 4.0], [0.0, 2.0], [5.0, 0.0]], [0, 0, 1], lr=1.0)
    empty = {"owners": torch.empty(0, dtype=torch.int64), "class_ids": torch.empty(0, dtype=torch.int64),
             "protos": torch.empty(0, 2)}
    result = entry.client(context).train(client, empty, 0, torch_generator(0, "t"))
    assert (result.samples, result.loss_sum) == (0, 0.0)
    torch.testing.assert_close(client.model.feature_extractor.weight.detach(), torch.eye(2), rtol=0, atol=0)
    assert result.upload["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(result.upload["protos"], torch.tensor([[0.3, 0.9], [1.0, 0.0]]))
    assert entry.client(context).theory_upload_floats(client) == 2 * 2


# ------------------------------------------------------------------------------ the server

def test_server_means_this_rounds_uploads_and_keeps_every_clients_latest():
    """Round 0: c̄^0 = ((1, 0) + (0, 1))/2, c̄^1 = (0, 1) (client 0 alone). Round 1, client 1 alone
    sends class 1: c̄ holds class 1 only, client 0's round-0 rows stay in the set, client 1's
    are replaced."""
    entry, context = _context()
    server = entry.server(context)
    server.update({0: _upload([0, 1], [[1.0, 0.0], [0.0, 1.0]]), 1: _upload([0], [[0.0, 1.0]])}, 0,
                  torch_generator(0, "s"))
    download = server.download()
    assert download["owners"].tolist() == [-1, -1, 0, 0, 1]
    assert download["class_ids"].tolist() == [0, 1, 0, 1, 0]
    torch.testing.assert_close(download["protos"][:2], torch.tensor([[0.5, 0.5], [0.0, 1.0]]))
    metrics = server.update({1: _upload([1], [[2.0, 2.0]])}, 1, torch_generator(0, "s"))
    assert metrics["set_clients"] == 2.0 and metrics["global_classes"] == 1.0
    download = server.download()
    assert download["owners"].tolist() == [-1, 0, 0, 1]
    assert download["class_ids"].tolist() == [1, 0, 1, 1]
    torch.testing.assert_close(download["protos"], torch.tensor([[2.0, 2.0], [1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]))
    assert server.theory_download_floats() == 2 * 2 * (1 + 3)


def test_state_round_trips():
    entry, context = _context()
    server = entry.server(context)
    server.update({2: _upload([1], [[0.0, 1.0]])}, 1, torch_generator(0, "s"))
    before = server.download()
    fresh = entry.server(context)
    fresh.load_state_dict(server.state_dict())
    for payload in (server.download(), fresh.download()):
        assert set(payload) == set(before)
        for key in before:
            torch.testing.assert_close(payload[key], before[key], rtol=0, atol=0)


# ------------------------------------------------------------------------------ inference

PREDICT = [(-1, 0, [1.0, 0.0]), (-1, 1, [0.0, 1.0]), (0, 0, [0.5, 0.0])]
FEATURES = torch.tensor([[8.0, 6.0], [0.0, 2.0]])  # z = (0.8, 0.6) and (0, 1)


@pytest.mark.parametrize("options,client_id,expected", [
    # client 0's table: c^0 = (0.5, 0), c^1 = c̄^1 = (0, 1); z·c = (0.4, 0.6) and (0, 1)
    ({}, 0, [1, 1]),
    # −‖z − c‖: 0.67 against 0.89 for the first, 1.12 against 0 for the second
    ({"predict_score": "distance"}, 0, [0, 1]),
    ({"predict_with": "local_own"}, 0, [0, 0]),  # class 0 is all it holds
    ({"predict_with": "global"}, 0, [0, 1]),     # z·c̄ = (0.8, 0.6) and (0, 1)
    ({}, 5, [0, 1]),                            # not in the set yet: c̄
])
def test_prediction_by_hand(options, client_id, expected):
    entry, context = _context(**options)
    predicted = entry.client(context).predict(SimpleNamespace(client_id=client_id), _knowledge(PREDICT),
                                              FEATURES, torch.zeros(2, 2))
    assert predicted.tolist() == expected


def test_prediction_without_prototypes_is_no_class():
    entry, context = _context()
    empty = {"owners": torch.empty(0, dtype=torch.int64), "class_ids": torch.empty(0, dtype=torch.int64),
             "protos": torch.empty(0, 2)}
    assert entry.client(context).predict(SimpleNamespace(client_id=0), empty, FEATURES,
                                         torch.zeros(2, 2)).tolist() == [-1, -1]


# ------------------------------------------------------------------------------ options and a run

def _knobs(options):
    return (options.tau, options.global_term, options.local_reduction, options.local_from, options.predict_with,
            options.predict_score, options.clip_grad_norm)


def test_defaults_are_pfllibs_and_compat_official_is_the_authors_code():
    """Defaults: TsingZ0/PFLlib@d832e76 (main.py -tau 1.0; clientpcl.py: the global term, each
    local term / len(set), test_metrics' dot over its padded prototypes, clip_grad_norm_ 10).
    compat=official: yuetan031/FedPCL@0c3895b lib/update.py (ConLoss(temperature=0.07), no global
    term, summed over the set, MSE to its own prototypes, no clipping). A knob set wins."""
    assert _knobs(_context()[1].options) == (1.0, True, "mean", "all", "local", "dot", 10.0)
    assert _knobs(_context(compat="official")[1].options) == (0.07, False, "sum", "all", "local_own", "distance",
                                                              None)
    assert _knobs(_context(compat="official", tau=0.5, clip_grad_norm=3.0)[1].options)[::6] == (0.5, 3.0)
    assert _context(clip_grad_norm=0.0)[1].options.clip_grad_norm == 0.0  # 0: no clipping, not the preset's


@pytest.mark.parametrize("options,message", [
    ({"tau": 0.0}, r"^config key 'algo.tau' must be > 0 \(null: the compat preset's\), got 0.0$"),
    ({"clip_grad_norm": -1.0}, r"^config key 'algo.clip_grad_norm' must be >= 0"),
    ({"predict_with": "nearest"}, r"algo.predict_with"),
    ({"local_reduction": "max"}, r"algo.local_reduction"),
    ({"compat": "paper"}, r"algo.compat"),
])
def test_option_errors_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        _context(**options)


def test_real_run(single_run):
    """Two rounds on the smoke config: round 1 only uploads (it is evaluated on the untrained
    models' own class means), round 2 trains; both beat chance, and the upload is K·|C_i| floats."""
    _, rows = single_run(*testing.run_overrides("fedpcl"))
    assert [row["round"] for row in rows] == [1, 2]
    for row in rows:
        assert row["test_acc"] > 0.2  # 10 classes: chance is 0.1
        assert 1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.05, row
