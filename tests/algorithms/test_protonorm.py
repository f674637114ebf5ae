"""ProtoNorm maths by hand: the repulsion, one and two alignment steps, the early stop, the
server's normalise → align → upscale, the client's loss against what the server sends, the
reference's full-batch prototypes, and the options."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_identity_client
from torch import nn

from htfl_dist import testing
from htfl_dist.algorithms import AlgorithmContext, get_algorithm, parse_options
from htfl_dist.algorithms.protonorm import ForceStall, align_on_sphere, repulsion_forces
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.seeding import torch_generator

ROOT_HALF = 1 / math.sqrt(2)
DEFAULT_STEPS = {"iterations": 500, "lr": 0.1, "momentum": 0.9, "early_stop": 10, "patience": 10}


def _context(num_classes=2, feature_dim=2, batch_size=10, **options):
    entry = get_algorithm("protonorm")
    return entry, AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=0,
                                   train=TrainConfig(batch_size=batch_size), options=parse_options(entry, options))


def _update(uploads, **options):
    entry, context = _context(**options)
    server = entry.server(context)
    metrics = server.update(uploads, 0, torch_generator(0, "s"))
    return server, metrics


def _upload(class_ids, protos):
    return {"class_ids": torch.tensor(class_ids), "protos": torch.tensor(protos)}


# ------------------------------------------------------------------------------ the alignment

def test_repulsion_by_hand():
    """u_1 = (1, 0), u_2 = (0, 1): u_1 − u_2 = (1, −1), ‖·‖² = 2, so F_1 = (1, −1)/2 and F_2 = −F_1.
    A third point at (−1, 0) adds (2, 0)/4 to F_1 and pushes itself away from both."""
    forces = repulsion_forces(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    torch.testing.assert_close(forces, torch.tensor([[0.5, -0.5], [-0.5, 0.5]]))
    forces = repulsion_forces(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    torch.testing.assert_close(forces[0], torch.tensor([0.5 + 0.5, -0.5]))
    torch.testing.assert_close(forces[2], torch.tensor([-0.5 - 0.5, -0.5]))


def test_one_alignment_step_by_hand():
    """From (2, 0) and (0, 3): normalised to (1, 0) and (0, 1) first (the raw lengths play no part),
    v_1 = η·F_1 = 0.1·(0.5, −0.5), then u_1 = (1.05, −0.05)/√1.105 back on the sphere."""
    units, iterations = align_on_sphere(torch.tensor([[2.0, 0.0], [0.0, 3.0]]), 1, 0.1, 0.9, 10, 10)
    assert iterations == 1
    expected = torch.tensor([[1.05, -0.05], [-0.05, 1.05]]) / math.sqrt(1.105)
    torch.testing.assert_close(units, expected)


def test_two_alignment_steps_keep_momentum_and_decay_the_step():
    """Step 2 by hand, by the mirror symmetry u_2 = (b, a): u_1 = (a, b) after step 1 with
    a = 1.05/√1.105, b = −0.05/√1.105; F_1 = (1, −1)/(2(a − b)); the step size is now
    0.1·0.95 (decayed after iteration 0) and the velocity keeps 0.9 of step 1's (0.05, −0.05):
    v_1 = (c, −c), c = 0.9·0.05 + 0.095/(2(a − b)); u_1 = (a + c, b − c)/‖·‖."""
    a, b = 1.05 / math.sqrt(1.105), -0.05 / math.sqrt(1.105)
    c = 0.9 * 0.05 + 0.095 / (2 * (a - b))
    norm = math.hypot(a + c, b - c)
    units, _ = align_on_sphere(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 2, 0.1, 0.9, 10, 10)
    torch.testing.assert_close(units[0], torch.tensor([(a + c) / norm, (b - c) / norm]))
    torch.testing.assert_close(units[1], torch.tensor([(b - c) / norm, (a + c) / norm]))


@pytest.mark.parametrize("protos,cosine", [
    ([[2.0, 0.0], [0.0, 3.0]], -1.0),  # two points: antipodal
    ([[1.0, 0.0], [1.0, 0.2], [0.5, 1.0]], -0.5),  # three on a circle: 120° apart
])
def test_alignment_spreads_to_the_known_optimum(protos, cosine):
    """Two points end antipodal, three in the plane 120° apart; every row stays on the sphere.
    The early stop leaves them a little short of the optimum (2e-2 in cosine)."""
    units, iterations = align_on_sphere(torch.tensor(protos), **DEFAULT_STEPS)
    assert iterations < 500  # the early stop ended it
    torch.testing.assert_close(units.norm(dim=1), torch.ones(len(protos)))
    cosines = units @ units.t()
    off_diagonal = cosines[~torch.eye(len(protos), dtype=torch.bool)]
    torch.testing.assert_close(off_diagonal, torch.full_like(off_diagonal, cosine), atol=2e-2, rtol=0)


def test_four_points_reach_the_tetrahedron_without_the_early_stop():
    """4 points in 3-d: the regular tetrahedron, cos = −1/3 for every pair, after the 500 steps."""
    protos = torch.tensor([[1.0, 0.1, 0.0], [0.0, 1.0, 0.2], [0.3, 0.0, 1.0], [1.0, 1.0, 1.0]])
    units, iterations = align_on_sphere(protos, **{**DEFAULT_STEPS, "early_stop": None})
    assert iterations == 500
    cosines = (units @ units.t())[~torch.eye(4, dtype=torch.bool)]
    torch.testing.assert_close(cosines, torch.full_like(cosines, -1 / 3), atol=1e-4, rtol=0)


def test_early_stop_counts_repeats_from_its_start_and_restarts_on_a_change():
    """start 2, patience 2: levels before t = 2 are not looked at; t = 3 repeats t = 2 (1), t = 4
    differs (0 again), t = 5 and t = 6 repeat it (1, 2): the loop ends after t = 6."""
    stall = ForceStall(2, 2)
    levels = [0.5, 0.5, 0.1, 0.1, 0.2, 0.2, 0.2]
    assert [stall.stop(t, level) for t, level in enumerate(levels)] == [False] * 6 + [True]
    never = ForceStall(None, 1)
    assert not any(never.stop(t, 0.5) for t in range(5))


def test_an_antipodal_pair_does_not_move_and_stops_after_start_plus_patience():
    """(1, 0) and (−1, 0): F_1 = (2, 0)/4 is radial, so every step lands back on (1, 0); the mean
    force norm is 0.5 at every step, so from t = 10 on it repeats and the 10th repeat (t = 20) ends
    the loop: 21 iterations. Without the early stop all T run."""
    protos = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    units, iterations = align_on_sphere(protos, **DEFAULT_STEPS)
    assert iterations == 21
    torch.testing.assert_close(units, protos)
    assert align_on_sphere(protos, **{**DEFAULT_STEPS, "early_stop": 0, "patience": 3})[1] == 4
    assert align_on_sphere(protos, **{**DEFAULT_STEPS, "early_stop": None, "iterations": 37})[1] == 37


# ------------------------------------------------------------------------------ the server

def test_server_means_normalises_aligns_and_upscales():
    """Class 0: (4, 0) and (0, 0) → mean (2, 0); class 1: (0, 1) from one client. On the sphere:
    (1, 0) and (0, 1), pushed apart symmetrically about (1, 1) until antipodal:
    ±(1, −1)/√2, times s = 80 → ±(56.57, −56.57)."""
    uploads = {3: _upload([0, 1], [[4.0, 0.0], [0.0, 1.0]]), 1: _upload([0], [[0.0, 0.0]])}
    server, metrics = _update(uploads)
    download = server.download()
    assert download["class_ids"].tolist() == [0, 1]
    expected = 80 * ROOT_HALF * torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
    torch.testing.assert_close(download["protos"], expected, atol=0.05, rtol=0)
    torch.testing.assert_close(download["protos"].norm(dim=1), torch.full((2,), 80.0))
    assert metrics["global_classes"] == 2 and 10 < metrics["thomson_iterations"] < 500
    assert metrics["proto_max_cos"] == pytest.approx(-1.0, abs=1e-5)


def test_server_without_alignment_only_normalises_and_upscales():
    uploads = {0: _upload([0, 1], [[4.0, 0.0], [3.0, 4.0]])}
    server, metrics = _update(uploads, alignment=False)
    torch.testing.assert_close(server.download()["protos"], torch.tensor([[80.0, 0.0], [48.0, 64.0]]))
    assert metrics["thomson_iterations"] == 0 and metrics["proto_max_cos"] == pytest.approx(0.6)
    server, _ = _update(uploads, alignment=False, scale_factor=1.0)  # no upscaling: unit rows
    torch.testing.assert_close(server.download()["protos"], torch.tensor([[1.0, 0.0], [0.6, 0.8]]))


def test_server_aligns_only_the_classes_uploaded():
    """C = 4, classes 1 and 3 uploaded: only those two repel each other; 0 and 2 stay absent."""
    server, _ = _update({0: _upload([1, 3], [[2.0, 0.0], [0.0, 5.0]])}, num_classes=4)
    download = server.download()
    assert download["class_ids"].tolist() == [1, 3]
    torch.testing.assert_close(download["protos"], 80 * ROOT_HALF * torch.tensor([[1.0, -1.0], [-1.0, 1.0]]),
                               atol=0.05, rtol=0)


def test_server_with_a_zero_mean_or_a_single_class_stays_finite():
    server, metrics = _update({0: _upload([0, 1], [[0.0, 0.0], [3.0, 4.0]])})
    assert torch.isfinite(server.download()["protos"]).all()
    server, metrics = _update({0: _upload([1], [[3.0, 4.0]])})
    torch.testing.assert_close(server.download()["protos"], torch.tensor([[48.0, 64.0]]))
    assert "proto_max_cos" not in metrics  # one class: no pair


def test_state_round_trips():
    entry, context = _context()
    server = entry.server(context)
    server.update({0: _upload([0, 1], [[1.0, 0.0], [0.0, 1.0]])}, 1, torch_generator(0, "s"))
    before = server.download()
    torch.testing.assert_close(server.download()["protos"], before["protos"], rtol=0, atol=0)
    fresh = entry.server(context)
    fresh.load_state_dict(server.state_dict())
    torch.testing.assert_close(fresh.download()["protos"], before["protos"], rtol=0, atol=0)


# ------------------------------------------------------------------------------ the client

def test_client_loss_is_ce_plus_ten_times_the_mse_to_what_the_server_sends():
    """The server sends 80·(1, 0) and 80·(0, 1) (alignment off, so exact). Features (3, 4) of
    class 0 and (0, 1) of class 1: squared errors 77² + 4² = 5945 and 0² + 79² = 6241 over
    2·K = 4 entries, times λ = 10, plus CE = ln 2."""
    server, _ = _update({0: _upload([0, 1], [[5.0, 0.0], [0.0, 2.0]])}, alignment=False)
    entry, context = _context()
    assert (context.options.client_reg, context.options.reg_weight) == ("htfllib", 10.0)
    client = tiny_identity_client([[3.0, 4.0], [0.0, 1.0]], [0, 1])
    result = entry.client(context).train(client, server.download(), 1, torch_generator(0, "t"))
    assert result.samples == 2
    assert result.loss_sum / 2 == pytest.approx(math.log(2) + 10 * (5945 + 6241) / 4, rel=1e-6)


def test_client_classifies_by_the_nearest_upscaled_prototype():
    """Equal lengths s: the nearest s·u^c is the one of largest f·u^c, as the reference's MSE to u^c."""
    entry, context = _context()
    knowledge = _upload([0, 1], [[80.0, 0.0], [0.0, 80.0]])
    predicted = entry.client(context).predict(None, knowledge, torch.tensor([[10.0, 1.0], [-1.0, 3.0]]),
                                              torch.zeros(2, 2))
    assert predicted.tolist() == [0, 1]


def test_full_batches_leave_the_last_partial_batch_out_of_the_prototypes():
    """12 samples, batch 10: the reference's drop_last loader sees the first 10 only, so class 1,
    held only by samples 11 and 12, is not uploaded, and class 0's mean is over samples 1–10.
    A client of 8 samples has no full batch and uploads nothing (the reference's empty loader)."""
    x = [[float(i), 1.0] for i in range(10)] + [[50.0, 50.0], [60.0, 60.0]]
    y = [0] * 10 + [1, 1]
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}
    entry, context = _context(proto_samples="full_batches")
    result = entry.client(context).train(tiny_identity_client(x, y), empty, 0, torch_generator(0, "t"))
    assert result.upload["class_ids"].tolist() == [0]
    torch.testing.assert_close(result.upload["protos"], torch.tensor([[4.5, 1.0]]))
    short = entry.client(context).train(tiny_identity_client(x[:8], y[:8]), empty, 0, torch_generator(0, "t"))
    assert short.upload["class_ids"].numel() == 0 and short.upload["protos"].shape == (0, 2)  # no full batch
    entry, context = _context(proto_samples="all")  # every sample (FedProto's definition)
    result = entry.client(context).train(tiny_identity_client(x, y), empty, 0, torch_generator(0, "t"))
    assert result.upload["class_ids"].tolist() == [0, 1]
    torch.testing.assert_close(result.upload["protos"], torch.tensor([[4.5, 1.0], [55.0, 55.0]]))


def test_full_batches_before_training_are_the_reference_codes_prototypes():
    """proto_from=pre_update with full_batches (what the reference uploads): the means of the
    model the round started from (an identity Linear here, so those of x) over the first 10
    samples, although the regulariser (towards P̂^0 = (0, 0), lr 0.001) shrinks the extractor
    during the round, W ← W(I − 0.001·Σ x xᵀ) on the first batch; taken after training they are
    shorter."""
    x = [[float(i), 1.0] for i in range(10)] + [[50.0, 50.0], [60.0, 60.0]]
    y = [0] * 10 + [1, 1]
    knowledge = _upload([0], [[0.0, 0.0]])
    uploads = {}
    for proto_from in ("pre_update", "post_update"):
        extractor = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            extractor.weight.copy_(torch.eye(2))
        entry, context = _context(proto_samples="full_batches", proto_from=proto_from)
        client = tiny_identity_client(x, y, extractor=extractor, lr=0.001)
        uploads[proto_from] = entry.client(context).train(client, knowledge, 1, torch_generator(0, "t")).upload
    assert uploads["pre_update"]["class_ids"].tolist() == uploads["post_update"]["class_ids"].tolist() == [0]
    torch.testing.assert_close(uploads["pre_update"]["protos"], torch.tensor([[4.5, 1.0]]))
    assert float(uploads["post_update"]["protos"].norm()) < float(torch.tensor([4.5, 1.0]).norm()) - 0.1


# ------------------------------------------------------------------------------ options and a run

def test_defaults_are_the_reference_codes():
    """Every default is regulationLee/ProtoNorm@e816cef's, the prototypes included (issue 47):
    collect_protos reads the model the round started from, through a drop_last loader."""
    options = _context()[1].options
    assert (options.scale_factor, options.thomson_iterations, options.thomson_lr, options.thomson_momentum,
            options.thomson_early_stop, options.thomson_patience) == (80.0, 500, 0.1, 0.9, 10, 10)
    assert (options.alignment, options.weighted, options.proto_from, options.proto_samples) == (
        True, False, "pre_update", "full_batches")
    assert _context(client_reg="paper")[1].options.reg_weight == 0.1  # FedProto's paper form keeps its λ


@pytest.mark.parametrize("options,message", [
    ({"scale_factor": 0.0}, r"^config key 'algo.scale_factor' must be > 0, got 0.0$"),
    ({"thomson_momentum": 1.0}, r"^config key 'algo.thomson_momentum' must be in \[0, 1\), got 1.0$"),
    ({"thomson_iterations": 0}, r"^config key 'algo.thomson_iterations' must be >= 1, got 0$"),
    ({"proto_from": "during_training"},
     r"^algo.proto_samples=full_batches takes .* set algo.proto_samples=all$"),
])
def test_option_errors_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        _context(**options)


def test_real_run(single_run):
    """Two rounds on the smoke config (the run the conformance checks share): it learns, sends
    FedProto's bytes, and reports the alignment: all 10 classes spread to pairwise cosines below
    0.5 (a regular simplex of 10 points has −1/9). Round 1 is evaluated against prototypes the
    alignment has turned away from the class means, which no client has trained towards yet
    (≈ 20 % here), so the learning check is on round 2 (≈ 46 %)."""
    _, rows = single_run(*testing.run_overrides("protonorm"))
    assert [row["round"] for row in rows] == [1, 2]
    assert rows[1]["test_acc"] > max(0.3, rows[0]["test_acc"])  # 10 classes: chance is 0.1
    for row in rows:
        assert 1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.05, row
        assert row["global_classes"] == 10 and 0 < row["thomson_iterations"] <= 500
        assert row["proto_max_cos"] < 0.5
