"""FedOC: the orthogonality-constraint loss and the client's 1 − cos alignment on examples worked out
by hand, the options (paper defaults, htfllib values), the server's wiring (1 epoch, batch, only the
uploads it gets, arrival order), its cosine diagnostics, and real runs: 1 process vs 3 torchrun
ranks vs mpirun -n 3 (stopped after round 1 and resumed) with partial participation."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from reference_starts import trainable_prototypes
from torch import nn

from conftest import SMOKE, launch, maths_only, read_metrics, run_smoke
from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms import fedtgp as fedtgp_module
from htfl_dist.algorithms.fedoc import cosine_alignment, cosine_diagnostics, orthogonality_loss
from htfl_dist.config import TrainConfig, load_config
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

# --------------------------------------------------------------------------- hand-computed maths

# Global prototypes, C = 3, K = 2: P̂^0 = (1, 0), P̂^1 = (0, 2) (direction (0, 1)), P̂^2 = (−4, 3)
# (direction (−0.8, 0.6)). Nobody uploads class 2.
PROTOS = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-4.0, 3.0]])
# Uploads: a = (3, 4) of class 0 (direction (0.6, 0.8)), b = (0, −2) of class 1 (direction (0, −1)).
#   cos(a, ·) = [0.6, 0.8, −0.48 + 0.48 = 0]     cos(b, ·) = [0, −1, −0.6]
#   s = (0.6 + (−1)) / 2 = −0.2                  Σ_{c̄≠c} |cos| = (0.8 + 0) + (0 + 0.6) = 1.4
#   paper:  d = 1.4 / (|B|·|C|) = 1.4 / 6        code: d = 1.4 / (|B|·(C − 1)) = 1.4 / 4 = 0.35
PAIRS = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
LABELS = torch.tensor([0, 1])


@pytest.mark.parametrize("intra,inter,norm,expected", [
    (1.0, 10.0, "all_classes", 1.2 + 10 * 1.4 / 6),  # λ_s·(1 − s) + γ·d = 1.2 + 2.333…
    (1.0, 10.0, "other_classes", 1.2 + 10 * 0.35),  # = 4.7
    (2.0, 0.5, "all_classes", 2 * 1.2 + 0.5 * 1.4 / 6),
    (0.0, 1.0, "other_classes", 0.35),  # d alone: the |·| counts b's −0.6 towards the class nobody holds
])
def test_orthogonality_loss_by_hand(intra, inter, norm, expected):
    value = orthogonality_loss(PAIRS, LABELS, PROTOS, intra, inter, norm)
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_orthogonality_loss_is_scale_free_and_pushes_the_unheld_class():
    """Cosines ignore lengths; the unheld class's prototype gets a gradient from d alone."""
    scaled = orthogonality_loss(PAIRS * 7.0, LABELS, PROTOS * 0.1, 1.0, 10.0, "all_classes")
    assert scaled.item() == pytest.approx(1.2 + 10 * 1.4 / 6, rel=1e-6)
    protos = PROTOS.clone().requires_grad_(True)
    orthogonality_loss(PAIRS, LABELS, protos, 1.0, 0.0, "all_classes").backward()
    assert torch.equal(protos.grad[2], torch.zeros(2))  # λ_s term: only the held classes
    protos.grad = None
    orthogonality_loss(PAIRS, LABELS, protos, 0.0, 1.0, "all_classes").backward()
    assert protos.grad[2].abs().sum() > 0


# Client: r_1 = (3, 4) of class 0, r_2 = (1, 1) of class 1, against P̂^0 = (1, 0), P̂^1 = (0, 2):
#   cos = 0.6 and 1/√2;  L_R = 1 − (0.6 + 1/√2)/2 = 0.346446…
L_R = 1 - (0.6 + 1 / math.sqrt(2)) / 2


def test_cosine_alignment_by_hand():
    features = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    table, available = PROTOS[:2], torch.tensor([True, True])
    assert cosine_alignment(features, torch.tensor([0, 1]), table, available).item() == pytest.approx(L_R, rel=1e-6)
    # a row whose class has no prototype adds nothing but counts in |B|: (1 − 0.6)/2
    partial = torch.tensor([True, False])
    assert cosine_alignment(features, torch.tensor([0, 1]), table, partial).item() == pytest.approx(0.2, rel=1e-6)


def _context(num_classes=2, feature_dim=2, batch_size=2, **options):
    entry = get_algorithm("fedoc")
    context = AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=0,
                               train=TrainConfig(batch_size=batch_size, lr=0.0), options=parse_options(entry, options))
    return entry, context


def _linear_client() -> ClientState:
    """features = x; a zero head, so the logits are 0 and CE = ln 2 for C = 2."""
    head = nn.Linear(2, 2)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = SplitModel(nn.Identity(), head, feature_dim=2)
    x = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    y = torch.tensor([0, 1])
    return ClientState(0, "linear", model, torch.optim.SGD(model.parameters(), lr=0.0), x, y, x, y,
                       torch.device("cpu"))


@pytest.mark.parametrize("options,weight", [({}, 100.0), ({"compat": "reference"}, 10.0), ({"reg_weight": 3.0}, 3.0)])
def test_client_loss_is_ce_plus_lambda_c_times_one_minus_cos(options, weight):
    entry, context = _context(**options)
    client = _linear_client()
    knowledge = {"class_ids": torch.tensor([0, 1]), "protos": PROTOS[:2]}
    result = entry.client(context).train(client, knowledge, 1, torch_generator(0, "b"))
    assert result.samples == 2
    assert result.loss_sum / result.samples == pytest.approx(math.log(2) + weight * L_R, rel=1e-6)
    # the upload: each held class's mean feature (eval mode, after training), K·|C_i| floats
    assert result.upload["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(result.upload["protos"], torch.tensor([[3.0, 4.0], [1.0, 1.0]]))
    assert entry.client(context).theory_upload_floats(client) == 2 * 2


def test_upload_is_the_class_means_after_training():
    """A trainable extractor (Linear, starting as the identity): λ_c·(1 − cos) moves the features,
    and what goes up is the class means of the trained extractor, not of the initial one."""
    entry, context = _context(reg_weight=1.0)
    client = _linear_client()
    extractor = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        extractor.weight.copy_(torch.eye(2))
    client.model = SplitModel(extractor, client.model.head, feature_dim=2)
    client.optimizer = torch.optim.SGD(client.model.parameters(), lr=0.5)
    knowledge = {"class_ids": torch.tensor([0, 1]), "protos": PROTOS[:2]}
    result = entry.client(context).train(client, knowledge, 1, torch_generator(0, "b"))
    with torch.no_grad():
        after = client.model.features(client.train_x)  # one sample per class: the means are the rows
    assert not torch.allclose(after, client.train_x)  # training moved the features
    torch.testing.assert_close(result.upload["protos"], after)


def test_round_zero_trains_with_ce_only():
    entry, context = _context()
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}
    result = entry.client(context).train(_linear_client(), empty, 0, torch_generator(0, "b"))
    assert result.loss_sum / result.samples == pytest.approx(math.log(2), rel=1e-6)


def test_inference_is_the_own_heads_argmax_not_the_nearest_prototype():
    entry, context = _context()
    knowledge = {"class_ids": torch.tensor([0, 1]), "protos": PROTOS[:2]}
    features = torch.tensor([[1.0, 0.0]])  # nearest (and most aligned) prototype: class 0
    logits = torch.tensor([[0.0, 5.0]])
    assert entry.client(context).predict(_linear_client(), knowledge, features, logits).tolist() == [1]


# --------------------------------------------------------------------------- options


def test_paper_defaults_and_the_htfllib_values():
    _, context = _context()
    o = context.options
    assert (o.reg_weight, o.intra_weight, o.inter_weight, o.inter_norm) == (100.0, 1.0, 10.0, "all_classes")
    assert (o.server_batch_size, o.server_epochs, o.server_lr, o.hidden_dim) == (32, 1, 0.01, None)
    assert o.first_round == "initial_prototypes"  # Algorithm 1 sends P̂ in round 1 too
    _, context = _context(compat="reference")
    o = context.options
    assert (o.reg_weight, o.intra_weight, o.inter_weight, o.inter_norm) == (10.0, 1.0, 10.0, "other_classes")
    assert (o.server_batch_size, o.server_epochs, o.server_lr) == (None, 1, 0.01)  # None: the client batch
    assert o.first_round == "ce_only"
    _, context = _context(compat="reference", reg_weight=100.0, inter_norm="all_classes", server_batch_size=8,
                          first_round="initial_prototypes")
    o = context.options
    assert (o.reg_weight, o.inter_norm, o.server_batch_size, o.first_round) == (
        100.0, "all_classes", 8, "initial_prototypes")  # knobs win


@pytest.mark.parametrize("options,key", [
    ({"compat": "fedml"}, "algo.compat"),
    ({"inter_norm": "batch"}, "algo.inter_norm"),
    ({"reg_weight": -1.0}, "algo.reg_weight"),
    ({"inter_weight": -1.0}, "algo.inter_weight"),
    ({"server_epochs": 0}, "algo.server_epochs"),
    ({"server_lr": 0.0}, "algo.server_lr"),
    ({"server_batch_size": 0}, "algo.server_batch_size"),
    ({"first_round": "none"}, "algo.first_round"),
])
def test_bad_options_are_one_line_errors(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _context(**options)


# --------------------------------------------------------------------------- server


def _server(num_classes=5, feature_dim=16, batch_size=10, **options):
    entry, context = _context(num_classes, feature_dim, batch_size, **options)
    torch.manual_seed(0)
    return entry.server(context)


def _uploads(num_classes=5, clients=6, dim=16, seed=1):
    """Non-negative rows (as ReLU features are) near class-specific directions; each client
    holds 3 classes, nobody holds class num_classes − 1 when clients < num_classes."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.eye(num_classes - 1, dim) * 6.0 + 1.0
    uploads = {}
    for client in range(clients):
        held = sorted({(client + j) % (num_classes - 1) for j in range(3)})
        rows = centres[held] + 0.3 * torch.rand(len(held), dim, generator=generator)
        uploads[client] = {"class_ids": torch.tensor(held), "protos": rows}
    return uploads


@pytest.mark.parametrize("options,epochs,batch", [({}, 1, 32), ({"compat": "reference"}, 1, 10),
                                                  ({"server_epochs": 3, "server_batch_size": 4}, 3, 4)])
def test_server_trains_one_epoch_of_oc_with_the_configured_batch(monkeypatch, options, epochs, batch):
    seen = {}
    original = fedtgp_module.train_on_pairs

    def spy(rows, labels, loss_fn, optimizer, **kwargs):
        seen.update(kwargs, pairs=rows.shape[0], lr=optimizer.param_groups[0]["lr"],
                    momentum=optimizer.param_groups[0]["momentum"])
        protos = server.tgp()
        expected = orthogonality_loss(rows, labels, protos, 1.0, 10.0, server.options.inter_norm)
        assert torch.equal(loss_fn(rows, labels), expected)  # the OC loss on all C prototypes
        return original(rows, labels, loss_fn, optimizer, **kwargs)

    monkeypatch.setattr(fedtgp_module, "train_on_pairs", spy)
    server = _server(**options)
    server.update(_uploads(), 0, torch_generator(0, "server", 0))
    assert (seen["epochs"], seen["batch_size"], seen["pairs"]) == (epochs, batch, 18)
    assert (seen["lr"], seen["momentum"]) == (0.01, 0)


def test_server_loss_falls_and_prototypes_separate():
    """Uploads are non-negative (|cos| ≈ 0.5 between classes); L_OC pulls each global prototype
    towards its class (cos 0.42 → 0.79) and pushes the global prototypes apart (|cos| 0.43 → 0.16)."""
    server = _server(server_epochs=100, server_lr=0.1, server_batch_size=6)
    uploads = _uploads()
    pairs, labels = server._pairs(uploads)
    with torch.no_grad():
        before = float(orthogonality_loss(pairs, labels, server.tgp(), 1.0, 10.0, "all_classes"))
        start = cosine_diagnostics(pairs, labels, server.tgp())
    result = server.update(uploads, 0, torch_generator(0, "server", 0))
    with torch.no_grad():
        after = float(orthogonality_loss(pairs, labels, server.tgp(), 1.0, 10.0, "all_classes"))
    assert after < 0.2 * before and result["server_loss"] < 0.2 * before
    assert result["global_intra_cos"] > max(0.7, start["global_intra_cos"])
    assert result["global_inter_abs_cos"] < 0.5 * start["global_inter_abs_cos"]
    assert result["global_inter_abs_cos"] < 0.5 * result["upload_inter_abs_cos"]
    download = server.download()
    assert download["class_ids"].tolist() == list(range(5))  # the unheld class 4 goes down too
    assert download["protos"].shape == (5, 16)
    assert server.theory_download_floats() == 5 * 16


def test_round_one_gets_the_untrained_prototypes_by_default():
    """Paper Algorithm 1: P̂ goes down at the start of every round, round 1 included, so round 1's
    clients align to F(P̃) of the untrained generator, all C classes, and an empty round keeps them."""
    server = _server()
    with torch.no_grad():
        untrained = server.tgp.mapping(server.tgp.vectors.weight)  # F(P̃), every class
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(download["protos"], untrained, rtol=0, atol=0)
    torch.testing.assert_close(server.download()["protos"], untrained, rtol=0, atol=0)
    server.update(_uploads(), 1, torch_generator(0, "s", 1))
    assert not torch.allclose(server.download()["protos"], untrained)  # trained after the first update


def test_round_one_client_aligns_to_the_downloaded_untrained_prototypes():
    """The client side of it: with P̂ downloaded in round 1 the loss is CE + λ_c·L_R, not CE alone
    (the hand-computed L_R of PROTOS[:2] above)."""
    entry, context = _context()
    knowledge = {"class_ids": torch.tensor([0, 1]), "protos": PROTOS[:2]}
    result = entry.client(context).train(_linear_client(), knowledge, 0, torch_generator(0, "b"))
    assert result.loss_sum / result.samples == pytest.approx(math.log(2) + 100.0 * L_R, rel=1e-6)


def test_round_zero_downloads_nothing_of_the_server():
    server = _server(first_round="ce_only")  # the reference code's round 1: CE only
    assert server.download()["class_ids"].numel() == 0
    assert server.download()["class_ids"].numel() == 0
    server.update(_uploads(), 1, torch_generator(0, "s", 1))
    before = server.download()
    torch.testing.assert_close(server.download()["protos"], before["protos"], rtol=0, atol=0)


def test_same_uploads_give_the_same_server_whatever_the_arrival_order():
    uploads = _uploads()
    forward, backward = _server(), _server()
    first = forward.update(dict(uploads), 2, torch_generator(0, "server", 2))
    second = backward.update(dict(reversed(list(uploads.items()))), 2, torch_generator(0, "server", 2))
    assert first == second
    torch.testing.assert_close(forward.download()["protos"], backward.download()["protos"], rtol=0, atol=0)
    for key, value in forward.state_dict()["tgp"].items():
        assert torch.equal(value, backward.state_dict()["tgp"][key]), key


def test_partial_participation_trains_on_the_participants_uploads_only():
    uploads = _uploads()
    participants = {cid: uploads[cid] for cid in (1, 4)}
    alone, everyone = _server(), _server()
    diagnostics = alone.update(participants, 3, torch_generator(0, "server", 3))
    everyone.update(uploads, 3, torch_generator(0, "server", 3))
    assert diagnostics["server_pairs"] == 6
    assert not torch.equal(alone.download()["protos"], everyone.download()["protos"])
    pairs, labels = alone._pairs(participants)
    assert diagnostics == {"server_loss": diagnostics["server_loss"], "server_pairs": 6,
                           **cosine_diagnostics(pairs, labels, alone.global_prototypes())}


def test_cosine_diagnostics_by_hand():
    # uploads a = (3,4) class 0, b = (0,−2) class 1, c = (4,3) class 0 (another client), against PROTOS
    pairs = torch.tensor([[3.0, 4.0], [0.0, -2.0], [4.0, 3.0]])
    labels = torch.tensor([0, 1, 0])
    result = cosine_diagnostics(pairs, labels, PROTOS)
    # cos(a, P̂^0) = 0.6, cos(b, P̂^1) = −1, cos(c, P̂^0) = 0.8
    assert result["global_intra_cos"] == pytest.approx((0.6 - 1 + 0.8) / 3, rel=1e-6)
    # |cos| between global prototypes: (0,1) 0, (0,2) 0.8, (1,2) 0.6
    assert result["global_inter_abs_cos"] == pytest.approx((0 + 0.8 + 0.6) / 3, rel=1e-6)
    # same class: (a, c) = 0.48 + 0.48; different classes: |cos(a, b)| = 0.8, |cos(b, c)| = 0.6
    assert result["upload_intra_cos"] == pytest.approx(0.96, rel=1e-6)
    assert result["upload_inter_abs_cos"] == pytest.approx(0.7, rel=1e-6)
    alone = cosine_diagnostics(pairs[:2], labels[:2], PROTOS)
    assert "upload_intra_cos" not in alone  # no class uploaded twice: nothing to average
    assert all(isinstance(v, float) for v in alone.values())


# --------------------------------------------------------------------------- real runs

PARTIAL = ("algorithm=fedoc", "rounds=2", "join_ratio=0.5")


def _run(launcher, nproc, out, cache_dir, *overrides):
    return run_smoke(launcher, nproc, out, cache_dir, *PARTIAL, *overrides)


@pytest.fixture(scope="module")
def single(single_run):
    """The session's one-process run of PARTIAL (the conformance test compares the same with 3 ranks)."""
    return single_run(*PARTIAL)[1]


def test_real_run_with_partial_participation(single, cache_dir):
    from htfl_dist.data import prepare_partition
    from htfl_dist.runtime.placement import sample_participants

    config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", *PARTIAL])
    counts = prepare_partition(config.data, config.num_clients, config.seed).class_counts
    assert [r["round"] for r in single] == [1, 2]
    for row in single:
        participants = sample_participants(config.seed, row["round"] - 1, config.num_clients, 0.5)
        assert len(participants) == 3
        assert row["server_pairs"] == int(np.count_nonzero(counts[participants]))  # the participants' pairs only
        assert row["bytes_theory_up"] == row["server_pairs"] * 512 * 4
        assert 1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.05
        assert row["test_acc"] == row["test_acc_head"] > 0.2  # own head; 10 classes, chance 0.1
        for key in ("global_intra_cos", "global_inter_abs_cos", "upload_intra_cos", "upload_inter_abs_cos"):
            assert -1.0 <= row[key] <= 1.0, key
    assert single[1]["bytes_theory_down"] > 0


@pytest.mark.launch
def test_mpirun_three_ranks_and_a_resume_equal_one_uninterrupted_process(single, tmp_path, cache_dir):
    """Round 1 on mpirun -n 3 with a checkpoint, then round 2 resumed from it on mpirun -n 3: the
    same rows as one process running both rounds (clients' models and optimizers, the server's
    generator and its ``trained`` flag all come back from the checkpoint)."""
    first = _run("mpirun", 3, tmp_path, cache_dir, "rounds=1", "checkpoint_every=1")
    assert maths_only(first) == maths_only(single[:1])
    resumed = launch("mpirun", 3, ["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                                   *PARTIAL, "checkpoint_every=1", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert maths_only(read_metrics(tmp_path)) == maths_only(single)


# --------------------------------------------------------------------------- edges found by a mutmut pass


def test_other_classes_norm_with_two_classes_divides_by_one_other_class():
    # C = 2: P̂^0 = (1, 0), P̂^1 = (0, 2); a = (3, 4) class 0, b = (0, −2) class 1
    # cos(a, ·) = [0.6, 0.8], cos(b, ·) = [0, −1]; Σ_{c̄≠c} |cos| = 0.8 + 0 = 0.8
    # other_classes: d = 0.8 / (|B|·(C − 1)) = 0.8 / 2 = 0.4;  all_classes: 0.8 / 4 = 0.2
    protos = PROTOS[:2]
    assert orthogonality_loss(PAIRS, LABELS, protos, 0.0, 1.0, "other_classes").item() == pytest.approx(0.4)
    assert orthogonality_loss(PAIRS, LABELS, protos, 0.0, 1.0, "all_classes").item() == pytest.approx(0.2)


@pytest.mark.parametrize("key", ["reg_weight", "intra_weight", "inter_weight"])
def test_weights_may_be_zero_or_below_one_and_negative_ones_have_an_exact_message(key):
    for value in (0.0, 0.5):
        assert getattr(_context(**{key: value})[1].options, key) == value
    with pytest.raises(ConfigError) as info:
        _context(**{key: -2.0})
    assert str(info.value) == f"config key 'algo.{key}' must be >= 0, got -2.0"


def test_one_downloaded_prototype_is_enough_to_align():
    """Only class 0 has a global prototype: L_R = (1 − 0.6)/2 = 0.2 (r_2's class adds nothing)."""
    entry, context = _context(reg_weight=3.0)
    knowledge = {"class_ids": torch.tensor([0]), "protos": PROTOS[:1]}
    generator = torch_generator(0, "b")
    before = generator.get_state().clone()
    result = entry.client(context).train(_linear_client(), knowledge, 1, generator)
    assert result.loss_sum / result.samples == pytest.approx(math.log(2) + 3.0 * 0.2, rel=1e-6)
    assert not torch.equal(generator.get_state(), before)  # batches drawn from the round's stream


def test_htfllib_init_draws_the_trainable_prototypes_and_round_1s_download_as_the_reference_does():
    """model.init=htfllib: P̃ and F are wisheverybodyhapi/FedORGP@85ae3b6's (FedOC version) first
    draws after its clients' torch.manual_seed(0) (the run seed standing for 0), so the untrained P̂
    sent in round 1 (first_round=initial_prototypes) is the reference's; the global RNG is left
    alone. Other inits draw from the global RNG the runtime seeded, as before."""
    entry, context = _context(num_classes=3, feature_dim=4)
    context = dataclasses.replace(context, seed=5, model_init="htfllib")
    expected = trainable_prototypes(5, 3, 4)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    download = entry.server(context).download()
    assert download["class_ids"].tolist() == [0, 1, 2]
    torch.testing.assert_close(download["protos"], expected, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(11)
    per_client = entry.server(dataclasses.replace(context, model_init="per_client")).download()["protos"]
    assert torch.equal(per_client, trainable_prototypes(11, 3, 4))
