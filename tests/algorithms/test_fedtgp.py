"""FedTGP server maths: adaptive margin, margin contrastive training, diagnostics."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from reference_starts import trainable_prototypes

from htfl_dist.algorithms import AlgorithmContext, get_algorithm, parse_options
from htfl_dist.algorithms.fedtgp import adaptive_margin, cluster_gaps, margin_contrastive_loss
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.seeding import torch_generator


def _server(num_classes=4, feature_dim=2, seed=0, **options):
    entry = get_algorithm("fedtgp")
    context = AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=0, train=TrainConfig(),
                               options=parse_options(entry, options))
    torch.manual_seed(seed)
    return entry.server(context)


def _upload(class_ids, protos):
    return {"class_ids": torch.tensor(class_ids), "protos": torch.tensor(protos, dtype=torch.float32)}


def test_margin_by_hand_with_a_class_nobody_holds():
    # centres: class 0 at (0,0); class 1 = mean of (2,4) and (4,4) = (3,4); class 2 at (0,10); class 3 absent
    uploads = {0: _upload([0, 1], [[0.0, 0.0], [2.0, 4.0]]), 1: _upload([1, 2], [[4.0, 4.0], [0.0, 10.0]])}
    pairs = torch.cat([u["protos"] for u in uploads.values()])
    labels = torch.cat([u["class_ids"] for u in uploads.values()])
    # gaps: class 0 -> 5 (to class 1), class 1 -> 5, class 2 -> sqrt(45) (to class 1), class 3 -> min gap = 5
    gap_2 = math.sqrt(45.0)
    server = _server()
    assert server._margin(pairs, labels) == pytest.approx(gap_2)
    centres = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 10.0], [0.0, 0.0]])
    present = torch.tensor([True, True, True, False])
    torch.testing.assert_close(cluster_gaps(centres, present), torch.tensor([5.0, 5.0, gap_2, 5.0]))
    assert adaptive_margin(centres, present, tau=6.0) == 6.0  # capped by τ
    assert _server(margin="none")._margin(pairs, labels) == 0.0
    assert _server(margin="fixed", fixed_margin=2.5)._margin(pairs, labels) == 2.5


def test_margin_loss_is_euclidean_with_margin_on_the_true_class():
    protos = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    pair, label = torch.tensor([[0.0, 0.0]]), torch.tensor([0])
    # logits = -(d + δ·onehot) = [-(0 + 1), -5]
    expected = -torch.log_softmax(torch.tensor([-1.0, -5.0]), dim=0)[0]
    torch.testing.assert_close(margin_contrastive_loss(pair, label, protos, margin=1.0), expected)


def _clustered_uploads(num_classes=5, clients=6, dim=16, noise=0.3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.eye(num_classes, dim) * 6.0
    uploads = {}
    for client in range(clients):
        held = [(client + j) % num_classes for j in range(3)]
        rows = centres[held] + noise * torch.randn(len(held), dim, generator=generator)
        uploads[client] = {"class_ids": torch.tensor(held), "protos": rows}
    return uploads


def test_server_loss_decreases_over_epochs():
    server = _server(num_classes=5, feature_dim=16)  # S = 100
    uploads = _clustered_uploads()
    pairs, labels = server._pairs(uploads)
    margin = server._margin(pairs, labels)
    with torch.no_grad():
        before = float(margin_contrastive_loss(pairs, labels, server.tgp(), margin))
    diagnostics = server.update(uploads, 0, torch_generator(0, "server", 0))
    with torch.no_grad():
        after = float(margin_contrastive_loss(pairs, labels, server.tgp(), margin))
    assert after < 0.5 * before
    assert diagnostics["server_loss"] < before
    assert diagnostics["margin"] == pytest.approx(margin)
    assert diagnostics["server_pairs"] == pairs.shape[0] == 18


@pytest.mark.parametrize("options", [
    {}, {"margin": "none"},
    # without F only the raw vectors learn: slower (the paper's "w/o F" ablation), so more steps
    {"use_mapping": False, "server_lr": 0.1, "server_epochs": 300},
])
def test_global_prototypes_stay_class_consistent(options):
    server = _server(num_classes=5, feature_dim=16, **options)
    uploads = _clustered_uploads()
    server.update(uploads, 0, torch_generator(0, "server", 0))
    download = server.download()
    assert download["class_ids"].tolist() == list(range(5))  # all C classes go down
    for payload in uploads.values():
        nearest = torch.cdist(payload["protos"], download["protos"]).argmin(dim=1)
        assert nearest.tolist() == payload["class_ids"].tolist()


def test_round_zero_downloads_nothing_then_all_classes():
    server = _server()
    assert server.download()["class_ids"].numel() == 0
    server.update({0: _upload([0, 1], [[0.0, 0.0], [2.0, 4.0]])}, 0, torch_generator(0, "s"))
    assert server.download()["protos"].shape == (4, 2)


def test_untrained_server_sends_nothing_then_every_class():
    server = _server(server_epochs=2)
    generator = torch_generator(0, "s")
    assert server.download()["class_ids"].numel() == 0  # still untrained: clients keep CE only
    server.update({0: _upload([0, 1], [[0.0, 0.0], [2.0, 4.0]])}, 1, generator)
    assert server.download()["class_ids"].tolist() == [0, 1, 2, 3]
    assert server.theory_download_floats() == 4 * 2  # C · K, inherited from the prototype server


def test_only_uploaded_pairs_train_the_prototypes():
    """With partial participation the server sees only participants' uploads; those pairs
    alone decide the update (same uploads -> same prototypes, whatever else exists)."""
    uploads = _clustered_uploads()
    participants = {cid: uploads[cid] for cid in (1, 4)}
    first, second = _server(num_classes=5, feature_dim=16), _server(num_classes=5, feature_dim=16)
    diagnostics = first.update(participants, 3, torch_generator(0, "server", 3))
    second.update(dict(reversed(list(participants.items()))), 3, torch_generator(0, "server", 3))
    assert diagnostics["server_pairs"] == 6
    torch.testing.assert_close(first.download()["protos"], second.download()["protos"], rtol=0, atol=0)
    third = _server(num_classes=5, feature_dim=16)
    third.update(uploads, 3, torch_generator(0, "server", 3))
    assert not torch.equal(first.download()["protos"], third.download()["protos"])


def test_fig1_diagnostics():
    """Client margins by hand (3-4-5 triangles, so every distance is exact): client 0 holds (0, 0)
    and (3, 4), margins 5 and 5; client 1 holds (0, 0), (6, 8), (6, 0), margins 6, 8 and 6.
    The per-class maximum over clients is 6, 8, 6 and none for class 3, which nobody holds."""
    server = _server(num_classes=4, feature_dim=2, server_epochs=1)
    uploads = {0: _upload([0, 1], [[0.0, 0.0], [3.0, 4.0]]),
               1: _upload([0, 1, 2], [[0.0, 0.0], [6.0, 8.0], [6.0, 0.0]])}
    diagnostics = server.update(uploads, 0, torch_generator(0, "s"))
    assert diagnostics["class_margin_client_max"] == [6.0, 8.0, 6.0, None]
    assert len(diagnostics["class_margin_global"]) == 4


def test_global_prototype_diagnostics_of_set_prototypes():
    """P̂ set by hand (no F): (0, 0), (3, 4), (6, −8), (6, 8). Nearest other prototype: 5, 5, 10
    (to (0, 0)), 5, so the smallest margin is 5. The uploads (0, 0), (3, 4), (6, 8), (6, 0) of
    classes 0, 1, 1, 2 sit at 0, 0, 5 and 8 from their own class's P̂ (mean 13/4); (6, 8) is
    nearest P̂^3 and (6, 0) nearest P̂^1 (at 5), so 2 of 4 are nearest their own. Every number is
    exact in float32, so the comparisons are too."""
    server = _server(num_classes=4, feature_dim=2, use_mapping=False)
    with torch.no_grad():
        server.tgp.vectors.weight.copy_(torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, -8.0], [6.0, 8.0]]))
    server.trained = True
    uploads = {0: _upload([0, 1], [[0.0, 0.0], [3.0, 4.0]]), 1: _upload([1, 2], [[6.0, 8.0], [6.0, 0.0]])}
    pairs, labels = server._pairs(uploads)
    nothing = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}
    diagnostics = server.diagnostics(uploads, pairs, labels, previous=nothing)
    assert diagnostics["class_margin_global"] == [5.0, 5.0, 10.0, 5.0]
    assert diagnostics["proto_min_dist"] == 5.0
    assert diagnostics["upload_to_global"] == 13 / 4
    assert diagnostics["upload_nearest_own"] == 2 / 4
    assert "proto_drift" not in diagnostics  # no previous round


@pytest.mark.parametrize("use_mapping,expected", [
    # F: v → Linear(2, 3) → ReLU → Linear(3, 2) (hidden_dim = 3), weights below:
    # v0 = (−1, 2) → (−1, 2, 0) → ReLU (0, 2, 0) → (0.5, 2); without the ReLU it would be (−0.5, 2)
    # v1 = (3, −4) → (3, −4, −2) → ReLU (3, 0, 0) → (3.5, 0); without the ReLU (1.5, −6)
    (True, [[0.5, 2.0], [3.5, 0.0]]),
    (False, [[-1.0, 2.0], [3.0, -4.0]]),  # "w/o F": the vectors themselves
])
def test_global_prototypes_are_f_of_the_class_vectors_by_hand(use_mapping, expected):
    server = _server(num_classes=2, feature_dim=2, use_mapping=use_mapping, hidden_dim=3)
    with torch.no_grad():
        server.tgp.vectors.weight.copy_(torch.tensor([[-1.0, 2.0], [3.0, -4.0]]))
        if use_mapping:
            first, second = (layer for layer in server.tgp.mapping if isinstance(layer, torch.nn.Linear))
            assert first.weight.shape == (3, 2)  # hidden_dim = H
            first.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
            first.bias.copy_(torch.tensor([0.0, 0.0, -1.0]))
            second.weight.copy_(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]))
            second.bias.copy_(torch.tensor([0.5, 0.0]))
    server.trained = True
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(download["protos"], torch.tensor(expected), rtol=0, atol=0)


def test_options_are_validated():
    with pytest.raises(ConfigError, match="fixed_margin"):
        _server(margin="fixed")
    with pytest.raises(ConfigError, match=r"algo\.margin"):
        _server(margin="huge")
    with pytest.raises(ConfigError, match="server_epochs"):
        _server(server_epochs=0)


def test_margin_with_a_single_class_is_tau_like_the_reference():
    centres = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert adaptive_margin(centres, torch.tensor([True, False]), tau=100.0) == 100.0


@pytest.mark.parametrize("use_mapping", [True, False])
def test_drift_is_the_move_of_the_global_prototypes_between_rounds(use_mapping):
    """Without F the prototypes are the trained parameters themselves: the previous round's
    copy must not move with them (drift would read 0)."""
    server = _server(num_classes=5, feature_dim=16, use_mapping=use_mapping, server_epochs=3)
    uploads = _clustered_uploads()
    first = server.update(uploads, 0, torch_generator(0, "server", 0))
    assert "proto_drift" not in first and 0.0 <= first["upload_nearest_own"] <= 1.0
    before = server.global_prototypes().clone()
    second = server.update(uploads, 1, torch_generator(0, "server", 1))
    expected = (server.global_prototypes() - before).norm(dim=1).mean()
    assert second["proto_drift"] == pytest.approx(float(expected)) and second["proto_drift"] > 0


# ------------------------------------------------------ edges found by a mutmut pass (issue 12)


@pytest.mark.parametrize("options,message", [
    ({"margin": "huge"}, r"^config key 'algo.margin' is 'huge'; allowed: adaptive, fixed, none$"),
    ({"margin": "fixed", "fixed_margin": -0.5},
     r"^algo.margin=fixed needs algo.fixed_margin=VALUE \(>= 0\); the paper gives no default$"),
    ({"tau": -1.0}, r"^config key 'algo.tau' must be >= 0, got -1.0$"),
    ({"server_lr": 0.0}, r"^config key 'algo.server_lr' must be > 0, got 0.0$"),
    ({"hidden_dim": 0}, r"^config key 'algo.hidden_dim' must be >= 1, got 0$"),
    ({"server_batch_size": 0}, r"^config key 'algo.server_batch_size' must be >= 1, got 0$"),
])
def test_option_errors_are_one_exact_line(options, message):
    with pytest.raises(ConfigError, match=message):
        _server(**options)


def test_option_edges_that_are_allowed():
    """δ = 0 is a valid fixed margin (the standard contrastive loss by another name), τ = 0
    caps the adaptive margin at 0, and a hidden layer or server batch of 1 is legal."""
    _server(margin="fixed", fixed_margin=0.0)
    _server(margin="fixed", fixed_margin=0.5)
    _server(tau=0.0)
    _server(tau=0.5)
    _server(hidden_dim=1, server_batch_size=1)


def test_class_margins_by_hand():
    from htfl_dist.algorithms.fedtgp import class_margins

    assert class_margins(torch.empty(0, 3)).shape == (0,)
    single = class_margins(torch.tensor([[1.0, 2.0, 3.0]]))
    assert single.shape == (1,) and math.isnan(float(single[0]))  # no other row: no margin
    two = class_margins(torch.tensor([[0.0, 0.0], [3.0, 4.0]]))
    assert two.tolist() == [5.0, 5.0]
    one_wide = class_margins(torch.tensor([[0.0], [2.0], [7.0]]))  # K = 1 works too
    assert one_wide.tolist() == [2.0, 2.0, 5.0]


def test_a_single_uploaded_pair_trains_and_empty_uploads_do_not():
    server = _server(server_epochs=1)
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}
    assert server.update({0: empty}, 0, torch_generator(0, "s")) == {}
    assert server.download()["class_ids"].numel() == 0  # still untrained: nothing goes down
    metrics = server.update({0: _upload([2], [[1.0, 1.0]])}, 0, torch_generator(0, "s"))
    assert metrics["server_pairs"] == 1 and server.download()["class_ids"].tolist() == [0, 1, 2, 3]


def test_untrained_server_downloads_no_rows_of_width_k():
    download = _server(feature_dim=3).download()
    assert download["class_ids"].dtype == torch.int64
    assert download["class_ids"].shape == (0,) and download["protos"].shape == (0, 3)


def test_server_state_survives_a_state_dict_round_trip():
    server = _server(server_epochs=2)
    server.update({0: _upload([0, 1], [[0.0, 1.0], [1.0, 0.0]])}, 0, torch_generator(0, "s"))
    fresh = _server(seed=9)
    fresh.load_state_dict(server.state_dict())
    assert fresh.trained and server.state_dict()["trained"].item() is True
    torch.testing.assert_close(fresh.download()["protos"], server.download()["protos"])
    assert not _server().state_dict()["trained"].item()


def test_htfllib_init_draws_the_trainable_prototypes_as_htfllib_does():
    """model.init=htfllib: P̃ and F are TsingZ0/HtFLlib servertgp.py's first draws after its
    clientTGP's torch.manual_seed(0) (the run seed standing for 0): FedTGP's P̂ = F(P̃) starts
    where the reference's does; the global RNG is left alone. Other inits draw from the global
    RNG the runtime seeded, as before."""
    entry = get_algorithm("fedtgp")
    context = AlgorithmContext(num_classes=3, feature_dim=4, seed=9, train=TrainConfig(),
                               options=parse_options(entry, {}), model_init="htfllib")
    expected = trainable_prototypes(9, 3, 4)
    torch.manual_seed(2)
    before = torch.get_rng_state()
    server = entry.server(context)
    assert torch.equal(torch.get_rng_state(), before)
    torch.testing.assert_close(server.global_prototypes(), expected, rtol=0, atol=0)
    assert server.download()["class_ids"].numel() == 0  # nothing goes down before the first update
    torch.manual_seed(2)
    per_client = entry.server(dataclasses.replace(context, model_init="per_client")).global_prototypes()
    assert torch.equal(per_client, trainable_prototypes(2, 3, 4))


def test_full_batch_prototypes_as_htfllib_collects_them():
    """proto_samples=full_batches (the paper-table configs): 12 samples, batch 10, HtFLlib's
    drop_last loader sees the first 10, so class 1 (samples 11 and 12 only) is not uploaded and
    class 0's mean is over samples 1-10; pre_update takes them from the model the round began
    with (an identity extractor here: the means of x). The paper's default covers every sample."""
    from helpers import tiny_identity_client

    x = [[float(i), 1.0] for i in range(10)] + [[50.0, 50.0], [60.0, 60.0]]
    y = [0] * 10 + [1, 1]
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}
    entry = get_algorithm("fedtgp")
    uploads = {}
    for samples in ("full_batches", "all"):
        context = AlgorithmContext(num_classes=2, feature_dim=2, seed=0, train=TrainConfig(batch_size=10),
                                   options=parse_options(entry, {"proto_from": "pre_update", "proto_samples": samples}))
        client = tiny_identity_client(x, y)
        uploads[samples] = entry.client(context).train(client, empty, 0, torch_generator(0, "t")).upload
    assert uploads["full_batches"]["class_ids"].tolist() == [0]
    torch.testing.assert_close(uploads["full_batches"]["protos"], torch.tensor([[4.5, 1.0]]))
    assert uploads["all"]["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(uploads["all"]["protos"], torch.tensor([[4.5, 1.0], [55.0, 55.0]]))
    with pytest.raises(ConfigError, match="proto_samples=full_batches takes"):
        parse_options(entry, {"proto_from": "during_training", "proto_samples": "full_batches"})
