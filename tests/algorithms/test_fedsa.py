"""FedSA on examples small enough to work out by hand: the margins and the client margin, the
anchor regulariser, the margin-enhanced contrastive loss, the classifier calibration, the whole
client objective, the EMA of the anchors present, the seeded anchors, the server's diagnostics,
inference; then real runs: partial participation, 1 process = 3 torchrun ranks = mpirun -n 3,
and checkpoint → resume."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference_starts import fedsa_anchors
from torch import nn

from conftest import SMOKE, read_metrics, run_program, run_smoke
from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.fedsa import (
    MEMORY,
    anchor_contrastive_loss,
    anchor_regulariser,
    build_anchors,
    calibration_loss,
    client_margin,
    ema_update,
    mean_margin,
)
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

# Three anchors in the plane: pairwise distances 3 (A0–A1), 4 (A0–A2), 5 (A1–A2).
TRIANGLE = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])


def _context(num_classes=3, feature_dim=2, seed=0, batch_size=10, lr=0.0, **options):
    entry = get_algorithm("fedsa")
    return entry, AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=seed,
                                   train=TrainConfig(batch_size=batch_size, lr=lr),
                                   options=parse_options(entry, options))


# --------------------------------------------------------------------------- options


def test_defaults_follow_the_paper_and_compat_selects_the_code():
    _, paper = _context()
    o = paper.options
    assert (o.reg_distance, o.reg_weight, o.mcl_weight, o.cc_weight) == ("euclid", 0.1, 1.0, 1.0)
    assert (o.contrast_on, o.margin_rule, o.proto_from, o.weighted) == ("prototypes", "pairwise", "post_update", True)
    assert (o.ema_decay, o.anchor_projection, o.inference) == (0.9999, "mlp", "proto_last")
    _, code = _context(compat="reference")
    o = code.options
    assert (o.reg_distance, o.reg_weight, o.mcl_weight, o.cc_weight) == ("mse", 10.0, 1.0, 1.0)
    assert (o.contrast_on, o.margin_rule, o.proto_from, o.weighted) == ("samples", "nearest", "during_training", False)
    assert (o.ema_decay, o.inference) == (0.9999, "proto_last")
    _, mixed = _context(compat="reference", reg_distance="euclid", weighted=True)  # a knob set by hand wins
    assert (mixed.options.reg_distance, mixed.options.reg_weight, mixed.options.weighted) == ("euclid", 0.1, True)


@pytest.mark.parametrize("options,key", [
    ({"ema_decay": 1.5}, "algo.ema_decay"),
    ({"reg_weight": -1}, "algo.reg_weight"),
    ({"mcl_weight": -0.1}, "algo.mcl_weight"),
    ({"cc_weight": -2}, "algo.cc_weight"),
    ({"margin_rule": "max"}, "algo.margin_rule"),
    ({"inference": "nearest"}, "algo.inference"),
    ({"compat": "fedsa"}, "algo.compat"),
])
def test_bad_options_are_one_line_errors(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        _context(**options)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- margins


def test_margins_by_hand():
    # pairwise (Eq. 6): mean over the 6 ordered pairs of (3, 4, 5) = 4; nearest: A0→3, A1→3, A2→4
    assert mean_margin(TRIANGLE, "pairwise") == pytest.approx(4.0)
    assert mean_margin(TRIANGLE, "nearest") == pytest.approx(10.0 / 3.0)
    assert mean_margin(TRIANGLE[:1], "pairwise") is None  # one prototype has no margin
    assert mean_margin(torch.empty(0, 2), "nearest") is None
    assert client_margin(4.0, 6.0) == 6.0  # the larger of the two (Eq. 7's d_i*)
    assert client_margin(4.0, 1.0) == 4.0
    assert client_margin(4.0, None) == 4.0  # no local prototypes yet: the global margin


def test_client_margin_uses_the_prototypes_of_its_last_upload():
    entry, context = _context()
    algorithm = entry.client(context)
    client = _linear_client(context)
    assert algorithm.margins(client, TRIANGLE) == (pytest.approx(4.0), None)
    client.modules[MEMORY].store(torch.tensor([0, 2]), torch.tensor([[0.0, 0.0], [6.0, 8.0]]))
    assert algorithm.margins(client, TRIANGLE) == (pytest.approx(4.0), pytest.approx(10.0))
    client.modules[MEMORY].store(torch.tensor([1]), torch.tensor([[1.0, 1.0]]))  # replaced, not merged
    assert algorithm.margins(client, TRIANGLE)[1] is None


# --------------------------------------------------------------------------- client losses


def test_anchor_regulariser_by_hand():
    anchors = torch.tensor([[0.0, 0.0], [2.0, 1.0], [7.0, 7.0]])
    features = torch.tensor([[3.0, 4.0], [1.0, 0.0], [5.0, 5.0]])
    labels = torch.tensor([0, 0, 1])  # class 2 is not in the batch: adds nothing
    # Eq. 5: class 0's batch mean (2, 2) is √8 from A0; class 1's (5, 5) is ‖(3, 4)‖ = 5 from A1; a sum
    euclid = anchor_regulariser(features, labels, anchors, "euclid")
    assert euclid.item() == pytest.approx(math.sqrt(8.0) + 5.0, rel=1e-6)
    # code: per-sample MSE over B·K = ((9 + 16) + (1 + 0) + (9 + 16)) / 6
    assert anchor_regulariser(features, labels, anchors, "mse").item() == pytest.approx(51.0 / 6.0, rel=1e-6)


def test_contrastive_loss_by_hand():
    anchors = TRIANGLE[1:]  # A0 = (3, 0), A1 = (0, 4), 5 apart
    # at the origin, label 0, margin 1: logits −(3 + 1) and −4 are equal, so CE = ln 2
    origin = torch.zeros(1, 2)
    for on in ("samples", "prototypes"):
        value = anchor_contrastive_loss(origin, torch.tensor([0]), anchors, 1.0, on)
        assert value.item() == pytest.approx(math.log(2.0), rel=1e-6)
    # the margin is added to the own class's distance: margin 0 gives log(1 + e^{−1}), margin 3 log(1 + e^{2})
    assert anchor_contrastive_loss(origin, torch.tensor([0]), anchors, 0.0, "samples").item() == \
        pytest.approx(math.log(1 + math.exp(-1.0)), rel=1e-6)
    assert anchor_contrastive_loss(origin, torch.tensor([0]), anchors, 3.0, "samples").item() == \
        pytest.approx(math.log(1 + math.exp(2.0)), rel=1e-6)
    # two class-0 samples at (±1, 0): their class mean is the origin, so the prototype form gives ln 2;
    # per sample, (−1, 0) has logits −(4 + 1), −√17 and (1, 0) has −(2 + 1), −√17
    pair, zeros = torch.tensor([[-1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 0])
    assert anchor_contrastive_loss(pair, zeros, anchors, 1.0, "prototypes").item() == \
        pytest.approx(math.log(2.0), rel=1e-6)
    root17 = math.sqrt(17.0)
    per_sample = (math.log(1 + math.exp(5 - root17)) + math.log(1 + math.exp(3 - root17))) / 2
    assert anchor_contrastive_loss(pair, zeros, anchors, 1.0, "samples").item() == pytest.approx(per_sample, rel=1e-6)
    # the prototype form averages over the batch's classes: class 0 (ln 2) and a class-1 sample at
    # A1 itself (logits −5, −(0 + 1): log(1 + e^{−4})), whatever the class counts
    mixed, labels = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 4.0]]), torch.tensor([0, 0, 1])
    expected = (math.log(2.0) + math.log(1 + math.exp(-4.0))) / 2
    value = anchor_contrastive_loss(mixed, labels, anchors, 1.0, "prototypes")
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_calibration_by_hand_reaches_the_head_only():
    head = nn.Linear(2, 2)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
        head.bias.copy_(torch.tensor([0.0, math.log(2.0)]))
    anchors = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    # anchor 0: logits [ln 3, ln 2] → −log(3/5); anchor 1: logits [0, ln 2] → −log(2/3); mean over C
    value = calibration_loss(head, anchors)
    assert value.item() == pytest.approx((math.log(5 / 3) + math.log(3 / 2)) / 2, rel=1e-6)
    value.backward()
    assert head.weight.grad is not None and head.bias.grad.abs().sum() > 0
    assert not anchors.requires_grad


def _linear_client(context, x=((0.0, 0.0),), y=(0,)) -> ClientState:
    """features = x (identity extractor), head Linear(2, C) with zero weights: every logit is 0."""
    head = nn.Linear(2, context.num_classes, bias=False)
    nn.init.zeros_(head.weight)
    model = SplitModel(nn.Identity(), head, feature_dim=2)
    x, y = torch.tensor(x), torch.tensor(y)
    client = ClientState(0, "linear", model, torch.optim.SGD(model.parameters(), lr=context.train.lr),
                         x, y, x, y, torch.device("cpu"))
    get_algorithm("fedsa").client(context).init_client(client)
    return client


def _knowledge(anchors: torch.Tensor) -> dict:
    count = anchors.shape[0]
    return {"class_ids": torch.arange(count), "anchors": anchors, "protos": torch.zeros_like(anchors),
            "proto_present": torch.zeros(count, dtype=torch.bool)}


@pytest.mark.parametrize("compat", ["paper", "reference"])
def test_client_objective_by_hand(compat):
    """One sample at the origin, label 0; C = 2 anchors A0 = (3, 0), A1 = (0, 4) (so d_global = 5
    under both rules); zero head, lr = 0, so the model never moves and the loss is
        CE = ln 2 (zero logits) + λ1·L_R + λ2·L_MCL + λ3·L_CC (= ln 2: zero logits on the anchors),
    L_R = ‖0 − A0‖ = 3 (euclid, λ1 = 0.1) or (9 + 0)/2 = 4.5 (mse, λ1 = 10),
    L_MCL = −log softmax_0(−(3 + d*), −4) = log(1 + e^{d* − 1}), d* = max(5, d_i)."""
    entry, context = _context(num_classes=2, compat=compat)
    algorithm, client = entry.client(context), _linear_client(context)
    regulariser = 0.1 * 3.0 if compat == "paper" else 10.0 * 4.5
    knowledge = _knowledge(TRIANGLE[1:])

    def expected(margin: float) -> float:
        return math.log(2.0) + regulariser + math.log(1 + math.exp(margin - 1.0)) + math.log(2.0)

    result = algorithm.train(client, knowledge, 0, torch_generator(0, "b"))
    assert result.samples == 1
    assert result.loss_sum == pytest.approx(expected(5.0), rel=1e-5)  # no prototypes yet: d* = d_global
    assert result.upload["class_ids"].tolist() == [0]
    torch.testing.assert_close(result.upload["protos"], torch.zeros(1, 2))
    assert ("counts" in result.upload) == (compat == "paper")  # the paper's weighted mean needs counts
    memory = client.modules[MEMORY]
    assert memory.present.tolist() == [True, False]
    memory.store(torch.tensor([0, 1]), torch.tensor([[0.0, 0.0], [0.0, 7.0]]))  # d_i = 7 > 5
    result = algorithm.train(client, knowledge, 1, torch_generator(0, "b"))
    assert result.loss_sum == pytest.approx(expected(7.0), rel=1e-5)
    memory.store(torch.tensor([0, 1]), torch.tensor([[0.0, 0.0], [0.0, 1.0]]))  # d_i = 1 < 5
    result = algorithm.train(client, knowledge, 2, torch_generator(0, "b"))
    assert result.loss_sum == pytest.approx(expected(5.0), rel=1e-5)
    assert algorithm.theory_upload_floats(client) == 2 * 1  # K·|C_i|


def test_loss_weights_switch_terms_off():
    entry, context = _context(num_classes=2, reg_weight=0.0, mcl_weight=0.0, cc_weight=0.0)
    client = _linear_client(context)
    result = entry.client(context).train(client, _knowledge(TRIANGLE[1:]), 0, torch_generator(0, "b"))
    assert result.loss_sum == pytest.approx(math.log(2.0), rel=1e-6)  # CE alone



def test_loss_weights_scale_their_terms_and_the_head_calibrates_on_the_anchors():
    """λ2 = 0.5, λ3 = 2, identity head (no bias), lr = 0, one sample at the origin, label 0:
    CE = ln 2; L_MCL = log(1 + e^{5 − 1}) (d* = d_global = 5); the head maps A0 = (3, 0) to logits
    (3, 0) and A1 = (0, 4) to (0, 4), so L_CC = (log(1 + e^−3) + log(1 + e^−4)) / 2."""
    entry, context = _context(num_classes=2, reg_weight=0.0, mcl_weight=0.5, cc_weight=2.0)
    client = _linear_client(context)
    with torch.no_grad():
        client.model.head.weight.copy_(torch.eye(2))
    result = entry.client(context).train(client, _knowledge(TRIANGLE[1:]), 0, torch_generator(0, "b"))
    calibration = (math.log(1 + math.exp(-3.0)) + math.log(1 + math.exp(-4.0))) / 2
    expected = math.log(2.0) + 0.5 * math.log(1 + math.exp(4.0)) + 2.0 * calibration
    assert result.loss_sum == pytest.approx(expected, rel=1e-5)


# --------------------------------------------------------------------------- anchors and the server


def test_anchors_depend_on_the_run_seed_only():
    _, context = _context(num_classes=10, feature_dim=64, seed=3)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    first = build_anchors(context)
    assert torch.equal(torch.get_rng_state(), state)  # torch's global stream is not touched
    torch.manual_seed(99)  # whatever the global stream, the same anchors
    assert torch.equal(build_anchors(context), first)
    entry, same = _context(num_classes=10, feature_dim=64, seed=3)
    assert torch.equal(entry.server(same).download()["anchors"], first)
    _, other = _context(num_classes=10, feature_dim=64, seed=4)
    assert not torch.equal(build_anchors(other), first)
    # Linear–BN–ReLU output: non-negative, about half the entries 0, each dimension standardised over C
    assert first.shape == (10, 64) and bool((first >= 0).all())
    assert 0.3 < float((first == 0).float().mean()) < 0.7
    # BatchNorm in train mode standardises every dimension over the C anchors before the ReLU, so
    # each column has entries below the mean (now 0) and above it (positive)
    assert bool(((first == 0).any(dim=0) & (first > 0).any(dim=0)).all())
    _, raw = _context(num_classes=10, feature_dim=64, seed=3, anchor_projection="none")
    assert bool((build_anchors(raw) < 0).any())  # the raw Gaussian table (Table 4, w/o ER)


def test_htfllib_init_draws_the_anchors_as_the_reference_does():
    """model.init=htfllib: A and h_ψ are lokinko/FedSA@75bf106's first draws after its clients'
    torch.manual_seed(0) (the run seed standing for 0): the projection's two Linears first, then
    randn(C, K); the server's initial anchors are the reference's semantic_anchors (and, with
    anchor_projection=none, its random_center); the global RNG is left alone."""
    import dataclasses

    entry, context = _context(num_classes=5, feature_dim=4, seed=6)
    context = dataclasses.replace(context, model_init="htfllib")
    raw, projected = fedsa_anchors(6, 5, 4)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    torch.testing.assert_close(entry.server(context).download()["anchors"], projected, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), before)
    _, plain = _context(num_classes=5, feature_dim=4, seed=6, anchor_projection="none")
    torch.testing.assert_close(build_anchors(dataclasses.replace(plain, model_init="htfllib")), raw, rtol=0, atol=0)
    assert not torch.equal(build_anchors(dataclasses.replace(context, model_init="per_client")), projected)


def test_ema_moves_only_the_classes_present():
    anchors = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    moved = ema_update(anchors, torch.tensor([0, 2]), torch.tensor([[11.0, 1.0], [3.0, 13.0]]), 0.9)
    # 0.9·Ā + 0.1·P̄ for classes 0 and 2; class 1 (nobody uploaded it) is kept exactly
    torch.testing.assert_close(moved, torch.tensor([[2.0, 1.0], [2.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(moved[1], anchors[1])
    assert torch.equal(anchors, torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))  # input untouched


def _server(**options):
    entry, context = _context(**options)
    server = entry.server(context)
    server.anchors = TRIANGLE.clone()
    return server


def test_server_ema_with_the_paper_alpha_on_the_weighted_mean():
    server = _server()  # paper: α = 0.9999, class-count weighted P̄
    uploads = {
        3: {"class_ids": torch.tensor([1]), "protos": torch.tensor([[7.0, 0.0]]), "counts": torch.tensor([3])},
        1: {"class_ids": torch.tensor([1]), "protos": torch.tensor([[3.0, 4.0]]), "counts": torch.tensor([1])},
    }
    server.update(uploads, 0, torch_generator(0, "s"))
    # P̄^1 = (3·(7, 0) + 1·(3, 4)) / 4 = (6, 1);  Ā^1 = 0.9999·(3, 0) + 0.0001·(6, 1)
    down = server.download()
    torch.testing.assert_close(down["anchors"][1], torch.tensor([3.0003, 0.0001]))
    assert torch.equal(down["anchors"][0], TRIANGLE[0]) and torch.equal(down["anchors"][2], TRIANGLE[2])
    assert down["class_ids"].tolist() == [0, 1, 2]
    assert down["proto_present"].tolist() == [False, True, False]
    torch.testing.assert_close(down["protos"][1], torch.tensor([6.0, 1.0]))
    assert server.theory_download_floats() == 2 * 2 * 3  # Ā and P̄: 2 tables of K·C


def test_server_diagnostics_by_hand():
    server = _server(compat="reference", margin_rule="pairwise", ema_decay=0.5)
    uploads = {
        0: {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[0.0, 0.0], [6.0, 0.0]])},
        1: {"class_ids": torch.tensor([2]), "protos": torch.tensor([[0.0, 8.0]])},
    }
    got = server.update(uploads, 0, torch_generator(0, "s"))
    # new anchors (α = ½): (0, 0), (4.5, 0), (0, 6): pairwise distances 4.5, 6, 7.5 → d_global = 6
    assert got["global_margin"] == pytest.approx(6.0)
    assert got["local_margin_mean"] == pytest.approx(6.0)  # client 0's two prototypes; client 1 has one
    assert got["local_margin_above_global"] == 0.0  # 6 is not above 6
    assert got["anchor_drift"] == pytest.approx((0.0 + 1.5 + 2.0) / 3)
    assert got["upload_to_anchor"] == pytest.approx((0.0 + 3.0 + 4.0) / 3)  # against the anchors before
    assert got["upload_nearest_anchor"] == pytest.approx(1.0)
    assert got["global_classes"] == 3.0
    assert all(isinstance(v, float) for v in got.values())  # numbers only


def test_partial_participation_server_learns_from_the_uploads_only():
    """The server sees only the round's participants: classes nobody uploaded keep their anchor
    and have no P̄; a round with no upload keeps everything."""
    server = _server(compat="reference", ema_decay=0.5)
    got = server.update({4: {"class_ids": torch.tensor([2]), "protos": torch.tensor([[0.0, 8.0]])}}, 0,
                        torch_generator(0, "s"))
    down = server.download()
    torch.testing.assert_close(down["anchors"], torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 6.0]]))
    assert got["anchor_drift"] == pytest.approx(2.0)  # over the one class moved, not all three
    assert down["proto_present"].tolist() == [False, False, True]
    before = {k: v.clone() for k, v in down.items()}
    assert all(torch.equal(server.download()[k], v) for k, v in before.items())


def test_server_state_round_trips():
    """The anchors (moved by the EMA) and P̄ are the server's state; a fresh server loads them."""
    server = _server(ema_decay=0.5)
    server.update({0: {"class_ids": torch.tensor([1]), "protos": torch.ones(1, 2), "counts": torch.tensor([2])}},
                  0, torch_generator(0, "s"))
    fresh = _server()
    fresh.load_state_dict(server.state_dict())
    assert all(torch.equal(fresh.download()[k], v) for k, v in server.download().items())
    assert not torch.equal(fresh.download()["anchors"], TRIANGLE)


def test_inference_rules():
    features = torch.tensor([[0.2, 0.1], [2.5, 0.5], [0.1, 3.0]])
    logits = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    knowledge = _knowledge(TRIANGLE)
    entry, context = _context()
    # proto_last: before any aggregation nothing is predicted (the code reports 0 accuracy)
    assert entry.client(context).predict(None, knowledge, features, logits).tolist() == [-1, -1, -1]
    knowledge["protos"][1] = torch.tensor([3.0, 0.0])
    knowledge["protos"][2] = torch.tensor([0.0, 4.0])
    knowledge["proto_present"][1:] = True  # class 0 absent from the last round: never predicted
    assert entry.client(context).predict(None, knowledge, features, logits).tolist() == [1, 1, 2]
    entry, context = _context(inference="anchor")
    assert entry.client(context).predict(None, knowledge, features, logits).tolist() == [0, 1, 2]
    assert [f.name for f in entry.server.download_fields(context)] == ["class_ids", "anchors"]
    assert entry.server(context).theory_download_floats() == 2 * 3  # Ā only
    entry, context = _context(inference="head")
    assert entry.client(context).predict(None, knowledge, features, logits).tolist() == [2, 0, 1]


# --------------------------------------------------------------------------- real runs

RUN = ("algorithm=fedsa", "algo.compat=reference", "join_ratio=0.5", "rounds=2")
"""The reference code's options (the conformance tests run the paper's), 3 of 6 clients a round."""


def _run(launcher, nproc, out, cache_dir, *overrides):
    return run_smoke(launcher, nproc, out, cache_dir, *RUN, *overrides)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    return _run("single", 1, tmp_path_factory.mktemp("fedsa-ws1"), cache_dir)


def test_partial_participation_real_run(reference, cache_dir):
    """Each round the server averages exactly the participants' classes, and the count of floats
    uploaded is theirs."""
    from htfl_dist.config import load_config
    from htfl_dist.data import prepare_partition
    from htfl_dist.runtime.placement import sample_participants

    config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", *RUN])
    counts = prepare_partition(config.data, config.num_clients, config.seed).class_counts
    assert [r["round"] for r in reference] == [1, 2]
    for row in reference:
        participants = sample_participants(config.seed, row["round"] - 1, config.num_clients, 0.5)
        assert len(participants) == 3
        held = counts[participants] > 0
        assert row["global_classes"] == int(np.count_nonzero(held.any(axis=0)))
        assert row["bytes_theory_up"] == int(np.count_nonzero(held)) * 512 * 4
        assert 1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.05
        assert row["test_acc"] > 0.2 and 15.0 < row["global_margin"] < 25.0
        assert 0.0 < row["anchor_drift"] < 0.01  # α = 0.9999: the anchors barely move


@pytest.mark.launch
def test_three_ranks_give_the_metrics_of_one_process(reference, tmp_path, cache_dir):
    """The reference code's options with partial participation on mpirun -n 3 (torchrun -n 3
    gets the same comparison, with the paper's options, in tests/e2e/test_conformance.py)."""
    rows = _run("mpirun", 3, tmp_path, cache_dir)
    for key in ("test_acc", "test_acc_head", "train_loss", "bytes_theory_up", "bytes_theory_down", "global_margin",
                "local_margin_mean", "anchor_drift", "upload_to_anchor", "proto_drift"):
        assert [r.get(key) for r in rows] == [r.get(key) for r in reference], key


@pytest.mark.integration
def test_resume_matches_the_uninterrupted_run(reference, tmp_path, cache_dir):
    """Anchors and P̄ (server), each client's last prototypes (its local margin) are checkpointed."""
    first = _run("single", 1, tmp_path, cache_dir, "rounds=1", "checkpoint_every=1")
    assert len(first) == 1
    resumed = run_program(["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                          *RUN, "checkpoint_every=1", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = read_metrics(tmp_path)
    assert [r["round"] for r in rows] == [1, 2]
    for key in ("test_acc", "test_acc_head", "train_loss", "global_margin", "local_margin_mean", "anchor_drift",
                "upload_to_anchor", "proto_drift", "bytes_theory_up"):
        assert rows[1].get(key) == reference[1].get(key), key


# --------------------------------------------------------------------------- edges found by a mutmut pass


def test_ema_decay_bounds_are_inclusive_and_the_message_exact():
    for value in (0.0, 1.0):
        assert _context(ema_decay=value)[1].options.ema_decay == value
    with pytest.raises(ConfigError) as info:
        _context(ema_decay=1.5)
    assert str(info.value) == "config key 'algo.ema_decay' must be in [0, 1], got 1.5"


def test_anchors_come_from_the_documented_streams():
    """build_anchors' docstring: A ~ N(0, I) from the stream (seed, "fedsa-anchors"); h_ψ =
    (Linear → BatchNorm → ReLU) × 2 initialised from torch seeded by (seed, "fedsa-projection"),
    applied once in train mode."""
    from htfl_dist.seeding import derive_seed

    _, context = _context(num_classes=4, feature_dim=3, seed=5)
    table = torch.randn(4, 3, generator=torch_generator(5, "fedsa-anchors"))
    _, raw = _context(num_classes=4, feature_dim=3, seed=5, anchor_projection="none")
    assert torch.equal(build_anchors(raw), table)
    torch.manual_seed(derive_seed(5, "fedsa-projection"))
    first, norm1 = nn.Linear(3, 3), nn.BatchNorm1d(3)
    second, norm2 = nn.Linear(3, 3), nn.BatchNorm1d(3)
    with torch.no_grad():
        expected = torch.relu(norm2(second(torch.relu(norm1(first(table))))))
    torch.testing.assert_close(build_anchors(context), expected)


def test_batch_class_means_keep_the_feature_dtype():
    from htfl_dist.algorithms.class_rows import batch_class_means

    features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    means, counts = batch_class_means(features, torch.tensor([0, 0, 2]), 3)
    assert means.dtype == torch.float64
    torch.testing.assert_close(means, torch.tensor([[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]], dtype=torch.float64))
    assert counts.tolist() == [2.0, 0.0, 1.0]
    # padding rows weigh 0, a class left out is absent: (3·1 + 5·0) / 1 for class 0, class 2 dropped
    means, counts = batch_class_means(features, torch.tensor([0, 0, 2]), 3,
                                      row_weights=torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64),
                                      kept_classes=torch.tensor([True, True, False]))
    torch.testing.assert_close(means, torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64))
    assert counts.tolist() == [1.0, 0.0, 0.0]


def test_losses_with_more_classes_than_feature_dimensions():
    """C = 3 anchors in the plane (TRIANGLE). One sample at A2 = (0, 4), label 2, margin 0:
    distances 4, 5, 0 → L_MCL = log(1 + e^{−4} + e^{−5}). A zero head gives 3 equal logits per
    anchor: L_CC = ln 3."""
    sample, label = torch.tensor([[0.0, 4.0]]), torch.tensor([2])
    expected = math.log(1 + math.exp(-4.0) + math.exp(-5.0))
    for on in ("prototypes", "samples"):
        value = anchor_contrastive_loss(sample, label, TRIANGLE, 0.0, on)
        assert value.item() == pytest.approx(expected, rel=1e-5)  # float32 distances
    head = nn.Linear(2, 3)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    assert calibration_loss(head, TRIANGLE).item() == pytest.approx(math.log(3.0), rel=1e-6)


def test_client_margins_follow_the_margin_rule():
    """nearest: TRIANGLE's nearest distances 3, 3, 4 → 10/3 for the anchors and for stored prototypes
    at the same points (pairwise would give 4)."""
    entry, context = _context(margin_rule="nearest")
    algorithm = entry.client(context)
    client = _linear_client(context)
    assert algorithm.margins(client, TRIANGLE) == (pytest.approx(10 / 3), None)
    client.modules[MEMORY].store(torch.tensor([0, 1, 2]), TRIANGLE)
    assert algorithm.margins(client, TRIANGLE) == (pytest.approx(10 / 3), pytest.approx(10 / 3))
    with pytest.raises(AssertionError, match=r"^C >= 2 anchors$"):
        algorithm.margins(client, TRIANGLE[:1])


def test_contrast_on_samples_in_the_client_objective():
    """contrast_on=samples, only L_MCL (λ1 = λ3 = 0), zero head, lr = 0; two class-0 samples at
    (−1, 0) and (1, 0), anchors A0 = (3, 0), A1 = (0, 4), d* = d_global = 5:
    per sample −log softmax_0(−(d0 + 5), −√17) with d0 = 4 and 2, averaged; CE = ln 2; one batch of 2."""
    entry, context = _context(num_classes=2, reg_weight=0.0, cc_weight=0.0, contrast_on="samples")
    client = _linear_client(context, x=((-1.0, 0.0), (1.0, 0.0)), y=(0, 0))
    result = entry.client(context).train(client, _knowledge(TRIANGLE[1:]), 0, torch_generator(0, "b"))
    root17 = math.sqrt(17.0)
    mcl = (math.log(1 + math.exp(9 - root17)) + math.log(1 + math.exp(7 - root17))) / 2
    assert result.loss_sum == pytest.approx(2 * (math.log(2.0) + mcl), rel=1e-5)


def test_client_batches_come_from_the_round_generator():
    """lr > 0 and batches of one: the loss depends on the order, which only the generator decides."""
    x = ((0.0, 1.0), (2.0, 0.0), (1.0, 3.0), (4.0, 1.0), (0.5, 2.0), (3.0, 3.0))
    losses = []
    for global_seed in (1, 2):
        entry, context = _context(batch_size=1, lr=0.1)
        client = _linear_client(context, x=x, y=(0, 1, 2, 0, 1, 2))
        torch.manual_seed(global_seed)
        losses.append(entry.client(context).train(client, _knowledge(TRIANGLE), 0, torch_generator(0, "b")).loss_sum)
    assert losses[0] == losses[1]


def test_download_fields_by_hand():
    from htfl_dist.payload import Field

    entry, context = _context(feature_dim=2)
    assert entry.server.download_fields(context) == (
        Field("class_ids", torch.int64), Field("anchors", torch.float32, (2,)),
        Field("protos", torch.float32, (2,)), Field("proto_present", torch.bool))


def test_server_refuses_a_bad_upload_naming_the_client():
    from htfl_dist.errors import ProtocolError

    server = _server(compat="reference")
    server.validate_upload(7, {"class_ids": torch.tensor([1]), "protos": torch.ones(1, 2)})
    with pytest.raises(ProtocolError, match="client 7"):
        server.validate_upload(7, {"class_ids": torch.tensor([5]), "protos": torch.ones(1, 2)})
