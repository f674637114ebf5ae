"""FedHKD maths by hand: the soft predictions, both distillation terms, both feature terms, the
client's hyper-knowledge, its whole loss and its gradients, the server's weighted and "last"
rules, ν, clipping, and the options."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import make_client, make_context
from torch import nn

from htfl_dist.algorithms import ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.fedhkd import (
    FedHKDOptions,
    distillation_term,
    feature_term,
    hyper_knowledge,
    soft_predictions,
)
from htfl_dist.algorithms.training import Batch
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import SplitModel
from htfl_dist.resolution import resolved_config
from htfl_dist.runtime.checkpoint import _changes_since
from htfl_dist.seeding import torch_generator

LN2 = math.log(2.0)


def _sigmoid(value: float) -> float:
    return 1.0 / (1.0 + math.exp(-value))


def _identity_client(x, y, head_weight, lr=0.0) -> ClientState:
    """features = x (2 wide); logits = W·x with the given 2×2 (or C×2) head, no bias."""
    weight = torch.tensor(head_weight)
    head = nn.Linear(2, weight.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    model = SplitModel(nn.Identity(), head, feature_dim=2)
    x, y = torch.tensor(x), torch.tensor(y)
    return ClientState(0, "tiny", model, torch.optim.SGD(head.parameters(), lr=lr), x, y, x, y,
                       torch.device("cpu"))


def _knowledge(class_ids, protos, soft):
    return {"class_ids": torch.tensor(class_ids), "protos": torch.tensor(protos), "soft": torch.tensor(soft)}


def _upload(class_ids, protos, soft, counts):
    return {**_knowledge(class_ids, protos, soft), "counts": torch.tensor(counts)}


def _server(num_classes=2, feature_dim=2, **options):
    entry, context = make_context("fedhkd", num_classes=num_classes, feature_dim=feature_dim, **options)
    return entry.server(context)


def get_client(context):
    return get_algorithm("fedhkd").client(context)


def _update(server, uploads):
    return server.update(uploads, 0, torch_generator(0, "s"))


# ------------------------------------------------------------------------------ the loss terms

def test_soft_predictions_use_the_temperature():
    """z = (0, ln 2), T = 0.5: softmax(0, 2 ln 2) = (1, 4)/5; T = 1 gives (1, 2)/3."""
    logits = torch.tensor([[0.0, LN2]])
    torch.testing.assert_close(soft_predictions(logits, 0.5), torch.tensor([[0.2, 0.8]]))
    torch.testing.assert_close(soft_predictions(logits, 1.0), torch.tensor([[1 / 3, 2 / 3]]))


def test_paper_distillation_is_the_mean_l2_distance():
    """Row 1: q = (0.2, 0.8) against Q = (0.5, 0.5), ‖(−0.3, 0.3)‖ = 0.3√2; row 2: q = (0.5, 0.5)
    against (1, 0), 0.5√2; the mean over the two classes is 0.4√2."""
    options = FedHKDOptions()
    head_logits = torch.tensor([[0.0, LN2], [0.0, 0.0]])
    targets = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    torch.testing.assert_close(distillation_term(options, head_logits, targets), torch.tensor(0.4 * math.sqrt(2)))


def test_reference_distillation_is_kldivloss_mean_over_all_entries():
    """KL(Q‖q): row 1 0.5·ln(0.5/0.2) + 0.5·ln(0.5/0.8) = 0.5·ln 1.5625; row 2 1·ln(1/0.5) = ln 2
    (the 0·log 0 entry counts 0); nn.KLDivLoss() divides by all m·C = 4 entries."""
    options = FedHKDOptions(client_loss="reference")
    head_logits = torch.tensor([[0.0, LN2], [0.0, 0.0]])
    targets = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    expected = (0.5 * math.log(1.5625) + LN2) / 4
    torch.testing.assert_close(distillation_term(options, head_logits, targets), torch.tensor(expected))


FEATURES = torch.tensor([[3.0, 4.0], [5.0, 5.0], [1.0, 0.0]])
LABELS = torch.tensor([0, 1, 0])
TABLE = torch.tensor([[0.0, 0.0], [9.0, 9.0]])
AVAILABLE = torch.tensor([True, False])  # class 1 has no global feature: its sample counts 0


def test_paper_feature_term_is_the_mean_l2_distance_over_the_batch():
    """Distances 5, (absent) 0, 1 over B = 3 samples: 2; padding weights (1, 1, 0) leave the
    third out: (5 + 0)/2."""
    options = FedHKDOptions()
    torch.testing.assert_close(feature_term(options, FEATURES, LABELS, TABLE, AVAILABLE), torch.tensor(2.0))
    weights = torch.tensor([1.0, 1.0, 0.0])
    torch.testing.assert_close(feature_term(options, FEATURES, LABELS, TABLE, AVAILABLE, weights),
                               torch.tensor(2.5))


def test_reference_feature_term_is_mseloss_over_b_times_k():
    """Squared distances 25, 0, 1 over B·K = 6 entries: 26/6."""
    options = FedHKDOptions(client_loss="reference")
    torch.testing.assert_close(feature_term(options, FEATURES, LABELS, TABLE, AVAILABLE), torch.tensor(26 / 6))


def test_feature_term_gradient_reaches_features_only_of_known_classes():
    """∂/∂f of the mean L2 distance: (f − H)/(‖f − H‖·B) for known classes, 0 for the absent one."""
    features = FEATURES.clone().requires_grad_(True)
    feature_term(FedHKDOptions(), features, LABELS, TABLE, AVAILABLE).backward()
    expected = torch.tensor([[3 / 5, 4 / 5], [0.0, 0.0], [1.0, 0.0]]) / 3
    torch.testing.assert_close(features.grad, expected)


# ------------------------------------------------------------------------------ the client

def test_hyper_knowledge_by_hand():
    """Head = identity, T = 0.5: class 0 holds x = (1, 2) and (0, 0): H = (0.5, 1), Q = the mean of
    softmax(2, 4) = (σ(−2), σ(2)) and (0.5, 0.5); class 1 holds (3, 3): H = (3, 3), Q = (0.5, 0.5)."""
    client = _identity_client([[1.0, 2.0], [0.0, 0.0], [3.0, 3.0]], [0, 0, 1], [[1.0, 0.0], [0.0, 1.0]])
    class_ids, features, soft, counts = hyper_knowledge(client, 2, 0.5)
    torch.testing.assert_close(class_ids, torch.tensor([0, 1]))
    torch.testing.assert_close(features, torch.tensor([[0.5, 1.0], [3.0, 3.0]]))
    expected = torch.tensor([[(_sigmoid(-2) + 0.5) / 2, (_sigmoid(2) + 0.5) / 2], [0.5, 0.5]])
    torch.testing.assert_close(soft, expected)
    torch.testing.assert_close(counts, torch.tensor([2, 1]))


def test_hyper_knowledge_is_taken_in_eval_mode():
    """A dropout layer of p = 0.99 in the extractor would zero almost everything in train mode."""
    client = _identity_client([[1.0, 2.0], [3.0, 3.0]], [0, 1], [[1.0, 0.0], [0.0, 1.0]])
    client.model.feature_extractor = nn.Dropout(0.99)
    client.model.train()
    _, features, _, _ = hyper_knowledge(client, 2, 0.5)
    torch.testing.assert_close(features, torch.tensor([[1.0, 2.0], [3.0, 3.0]]))
    assert client.model.training


def _loss_setup(**options):
    """x = (1, 0) of class 0 and (0, 1) of class 1, a zero head (CE = ln 2 each); the server knows
    class 0 only: H^0 = (0, 0), Q^0 = (1, 0)."""
    _, context = make_context("fedhkd", num_classes=2, feature_dim=2, **options)
    client = _identity_client([[1.0, 0.0], [0.0, 1.0]], [0, 1], [[0.0, 0.0], [0.0, 0.0]])
    knowledge = _knowledge([0], [[0.0, 0.0]], [[1.0, 0.0]])
    features, logits = client.model.forward_with_features(client.train_x)
    batch = Batch(client.train_x, client.train_y, features, logits)
    return client, get_client(context).loss_function(client, knowledge)(batch)


def test_paper_client_loss_by_hand():
    """CE = ln 2; distillation: h(H^0) = 0, q = (0.5, 0.5) against (1, 0): √0.5; features: sample
    0 is 1 away from H^0, sample 1's class has no row: (1 + 0)/2. L = ln 2 + 0.1·√0.5 + 0.2·0.5."""
    _, loss = _loss_setup(lam=0.1, gamma=0.2, compat="paper")
    torch.testing.assert_close(loss, torch.tensor(LN2 + 0.1 * math.sqrt(0.5) + 0.2 * 0.5))


def test_reference_client_loss_by_hand():
    """CE = ln 2; KL((1, 0)‖(0.5, 0.5))/(1·2) = ln 2/2; MSE: (1 + 0)/(2·2) = 0.25."""
    _, loss = _loss_setup(lam=0.1, gamma=0.2, client_loss="reference")
    torch.testing.assert_close(loss, torch.tensor(LN2 + 0.1 * LN2 / 2 + 0.2 * 0.25))


def test_distillation_trains_the_head_on_the_global_features():
    """With CE and the feature term switched off (no samples' gradient on W beyond CE's, which is
    symmetric here), the head's gradient is λ·∂/∂W ‖softmax(W·H/T) − Q‖ with H = (1, 0): only W's
    first column moves, and the logit of class 0 is pushed up."""
    _, context = make_context("fedhkd", num_classes=2, feature_dim=2, lam=1.0, gamma=0.0, compat="paper")
    client = _identity_client([[0.0, 0.0]], [0], [[0.0, 0.0], [0.0, 0.0]])
    knowledge = _knowledge([0], [[1.0, 0.0]], [[1.0, 0.0]])
    features, logits = client.model.forward_with_features(client.train_x)
    loss_fn = get_client(context).loss_function(client, knowledge)
    loss_fn(Batch(client.train_x, client.train_y, features, logits)).backward()
    grad = client.model.head.weight.grad
    # q = (0.5, 0.5), d = q − Q = (−0.5, 0.5), ‖d‖ = √0.5; ∂‖d‖/∂q = d/‖d‖; ∂q/∂z = J/T with
    # J = [[.25, −.25], [−.25, .25]]: ∂/∂z = J·d/(‖d‖·T) = (−0.25, 0.25)/(√0.5·0.5); x = H = (1, 0)
    dz = torch.tensor([-0.25, 0.25]) / (math.sqrt(0.5) * 0.5)
    torch.testing.assert_close(grad, torch.stack([dz, torch.zeros(2)], dim=1))


def test_without_global_knowledge_the_loss_is_cross_entropy():
    _, context = make_context("fedhkd", num_classes=2, feature_dim=2)
    client = _identity_client([[1.0, 0.0], [0.0, 1.0]], [0, 1], [[1.0, 0.0], [0.0, 1.0]])
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2), "soft": torch.empty(0, 2)}
    features, logits = client.model.forward_with_features(client.train_x)
    loss = get_client(context).loss_function(client, empty)(Batch(client.train_x, client.train_y, features, logits))
    torch.testing.assert_close(loss, nn.functional.cross_entropy(logits, client.train_y))


def test_min_class_share_drops_rare_classes():
    """Counts (2, 1) of N = 3: ν = 1/3 keeps both (1 ≥ 1), ν = 0.5 keeps class 0 only (1 < 1.5)."""
    client = _identity_client([[1.0, 2.0], [0.0, 0.0], [3.0, 3.0]], [0, 0, 1], [[1.0, 0.0], [0.0, 1.0]])
    for share, kept in ((1 / 3, [0, 1]), (0.5, [0])):
        _, context = make_context("fedhkd", num_classes=2, feature_dim=2, min_class_share=share)
        upload = get_client(context).upload(client)
        assert upload["class_ids"].tolist() == kept
        assert get_client(context).theory_upload_floats(client) == (2 + 2) * len(kept)  # (K + C) per class sent
        assert upload["counts"].shape == upload["class_ids"].shape == upload["protos"].shape[:1]


def test_gradient_clipping_bounds_each_step():
    """SGD at lr 0.05 with the gradient clipped to norm 1e-3: 2 steps (9 samples, batch 4, the
    trailing single sample left out) move the parameters by at most 2·0.05·1e-3 in L2; without
    clipping they move much further."""
    moved = {}
    for clip in (None, 1e-3):
        _, context = make_context("fedhkd", num_classes=3, feature_dim=4, clip_grad_norm=clip)
        client = make_client(context)
        before = torch.cat([p.detach().flatten().clone() for p in client.model.parameters()])
        get_client(context).train(client, {"class_ids": torch.empty(0, dtype=torch.int64),
                                           "protos": torch.empty(0, 4), "soft": torch.empty(0, 3)},
                                  0, torch_generator(0, "c"))
        after = torch.cat([p.detach().flatten() for p in client.model.parameters()])
        moved[clip] = float((after - before).norm())
    assert moved[1e-3] <= 2 * 0.05 * 1e-3 * (1 + 1e-4)
    assert moved[None] > 10 * moved[1e-3]


def test_train_uploads_every_class_with_counts():
    _, context = make_context("fedhkd", num_classes=3, feature_dim=4)
    client = make_client(context)
    knowledge = _knowledge([0, 2], torch.ones(2, 4).tolist(), [[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]])
    result = get_client(context).train(client, knowledge, 1, torch_generator(0, "c"))
    upload = result.upload
    assert upload["class_ids"].tolist() == [0, 1, 2]
    assert upload["counts"].tolist() == [3, 3, 3]
    assert upload["protos"].shape == (3, 4) and upload["soft"].shape == (3, 3)
    torch.testing.assert_close(upload["soft"].sum(dim=1), torch.ones(3))
    assert get_client(context).theory_upload_floats(client) == (4 + 3) * 3
    assert result.samples == 8 and math.isfinite(result.loss_sum)  # the trailing batch of 1 is not trained


# ------------------------------------------------------------------------------ the server

UPLOADS = {
    0: _upload([0, 1], [[1.0, 0.0], [0.0, 2.0]], [[1.0, 0.0], [0.0, 1.0]], [3, 1]),
    1: _upload([1], [[4.0, 2.0]], [[0.5, 0.5]], [3]),
}


def test_server_weights_by_class_counts():
    """Class 1: (1·(0, 2) + 3·(4, 2))/4 = (3, 2) and (1·(0, 1) + 3·(0.5, 0.5))/4 = (0.375, 0.625);
    class 0 has one uploader."""
    server = _server(aggregation="weighted")
    metrics = _update(server, UPLOADS)
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(download["protos"], torch.tensor([[1.0, 0.0], [3.0, 2.0]]))
    torch.testing.assert_close(download["soft"], torch.tensor([[1.0, 0.0], [0.375, 0.625]]))
    assert metrics["global_classes"] == 2.0
    assert server.theory_download_floats() == (2 + 2) * 2


def test_server_last_rule_keeps_the_last_uploader():
    """aggregation=last: client 1 (later in id order) sets class 1's rows."""
    server = _server(aggregation="last")
    _update(server, UPLOADS)
    torch.testing.assert_close(server.download()["protos"], torch.tensor([[1.0, 0.0], [4.0, 2.0]]))
    torch.testing.assert_close(server.download()["soft"], torch.tensor([[1.0, 0.0], [0.5, 0.5]]))


@pytest.mark.parametrize("keep", [False, True])
def test_server_absent_classes(keep):
    """Round 2 uploads class 1 only: class 0 disappears, or keeps round 1's rows (keep_absent)."""
    server = _server(keep_absent=keep)
    _update(server, UPLOADS)
    _update(server, {0: _upload([1], [[2.0, 2.0]], [[0.0, 1.0]], [5])})
    download = server.download()
    if keep:
        assert download["class_ids"].tolist() == [0, 1]
        torch.testing.assert_close(download["protos"], torch.tensor([[1.0, 0.0], [2.0, 2.0]]))
        torch.testing.assert_close(download["soft"], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    else:
        assert download["class_ids"].tolist() == [1]
        torch.testing.assert_close(download["protos"], torch.tensor([[2.0, 2.0]]))


def test_server_round_trips_its_state():
    from helpers import roundtrip

    server = _server()
    _update(server, UPLOADS)
    other = _server()
    other.load_state_dict(roundtrip(server.state_dict()))
    for key, value in server.download().items():
        assert torch.equal(other.download()[key], value)


@pytest.mark.parametrize("upload", [
    _upload([0, 1], [[1.0, 0.0], [0.0, 2.0]], [[1.0, 0.0], [0.0, 1.0]], [3, 0]),  # a zero count
    _upload([0, 1], [[1.0, 0.0], [0.0, 2.0]], [[1.0, 0.0], [0.0, 1.0]], [3]),  # counts short
    _upload([0, 0], [[1.0, 0.0], [0.0, 2.0]], [[1.0, 0.0], [0.0, 1.0]], [3, 1]),  # a class twice
    _upload([0, 2], [[1.0, 0.0], [0.0, 2.0]], [[1.0, 0.0], [0.0, 1.0]], [3, 1]),  # class out of range
    _upload([0, 1], [[1.0, 0.0], [0.0, 2.0]], [[1.0, 0.0]], [3, 1]),  # soft rows short
])
def test_server_rejects_bad_uploads(upload):
    with pytest.raises(ProtocolError):
        _server().validate_upload(0, upload)


# ------------------------------------------------------------------------------ options

def test_defaults_are_the_reference_codes():
    """Issue 47: nothing set resolves to compat=reference, the code's values
    (CityChan/Federated-Hyper-Knowledge-Distillation@8a930f4): KL/MSE loss, the last uploader's
    rows kept across rounds, clipping at 1.1; λ, γ, T from its option.py."""
    options = parse_options(get_algorithm("fedhkd"), {})
    assert options.compat == "reference"
    assert (options.lam, options.gamma, options.temperature, options.min_class_share) == (0.05, 0.05, 0.5, 0.0)
    assert (options.client_loss, options.aggregation, options.keep_absent, options.clip_grad_norm) == \
        ("reference", "last", True, 1.1)


def test_compat_paper_is_the_recalled_equations():
    """compat=paper: mean L2 distances, count-weighted means, absent classes dropped, no clipping
    (the defaults before issue 47); a knob set by hand still wins."""
    options = parse_options(get_algorithm("fedhkd"), {"compat": "paper"})
    assert (options.client_loss, options.aggregation, options.keep_absent, options.clip_grad_norm) == \
        ("paper", "weighted", False, None)
    mixed = parse_options(get_algorithm("fedhkd"), {"compat": "paper", "keep_absent": True})
    assert (mixed.aggregation, mixed.keep_absent) == ("weighted", True)


def test_hash_keeps_paper_runs_and_moves_the_unset_default():
    """compat=paper is what an unset compat computed before issue 47: left out of the hash as then.
    The new default hashes 'htfllib' exactly as an explicit reference run always did, so a config
    that sets nothing has a new hash, and a paper run's checkpoint is refused by it."""
    default = resolved_config(None, ["algorithm=fedhkd"])
    paper = resolved_config(None, ["algorithm=fedhkd", "algo.compat=paper"])
    reference = resolved_config(None, ["algorithm=fedhkd", "algo.compat=reference"])
    assert "compat" not in paper.experiment()["algo"]
    assert default.experiment()["algo"]["compat"] == "htfllib"
    assert default.config_hash() == reference.config_hash() != paper.config_hash()
    old_run = {"config_hash": paper.config_hash(), "experiment": paper.experiment()}
    assert "algo.client_loss: 'paper' -> 'reference'" in _changes_since(old_run, default)
    assert _changes_since(old_run, paper) == []


def test_an_old_paper_checkpoint_is_not_read_at_the_new_default():
    """The stored view of a paper run has no compat key (left out) and clip_grad_norm null. Read
    back at today's default (reference), the null would become 1.1 and the run would look like
    this config (paper knobs set by hand, clipping left to the preset): it must read as paper."""
    paper = resolved_config(None, ["algorithm=fedhkd", "algo.compat=paper"])
    knobs = ["algo.client_loss=paper", "algo.aggregation=weighted", "algo.keep_absent=false"]
    clipped = resolved_config(None, ["algorithm=fedhkd", *knobs])
    assert clipped.algo["clip_grad_norm"] == 1.1
    old_run = {"config_hash": paper.config_hash(), "experiment": paper.experiment()}
    assert any(change.startswith("algo.clip_grad_norm: None -> 1.1") for change in _changes_since(old_run, clipped))


@pytest.mark.parametrize("option", [
    {"temperature": 0.0}, {"lam": -1.0}, {"gamma": -0.1}, {"min_class_share": 1.0},
    {"clip_grad_norm": -1.0}, {"client_loss": "kl"}, {"aggregation": "median"}, {"compat": "htfllib"},
])
def test_invalid_options_are_refused(option):
    with pytest.raises(ConfigError):
        make_context("fedhkd", **option)


def test_compat_reference_sets_the_knobs_left_unset_to_the_reference_codes():
    """A knob set by hand wins over the preset."""
    mixed = make_context("fedhkd", compat="reference", aggregation="weighted", clip_grad_norm=0.0)[1].options
    assert (mixed.client_loss, mixed.aggregation, mixed.clip_grad_norm) == ("reference", "weighted", 0.0)
