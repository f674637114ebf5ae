"""privacy.*: the noise calibration against hand-computed Gaussian bounds, the clipping and
sensitivity bounds of the released class rows and of DP-SGD, budget exhaustion, the ledger's
checkpoint round trip, the refusals, and world-size invariance of a private run."""
from __future__ import annotations

import copy
import math
import re
import sys

import numpy as np
import pytest
import torch

from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.algorithms.class_rows import class_means
from htfl_dist.algorithms.training import batch_cross_entropy, run_local_training
from htfl_dist.config import config_from_dict
from htfl_dist.errors import ConfigError, PrivacyPlanError
from htfl_dist.privacy import LEDGER_KEY
from htfl_dist.privacy.accounting import PrivacyLedger, PrivacyPlan, calibrate_noise, epsilon_spent
from htfl_dist.privacy.noise import SecureNoise, SeededNoise
from htfl_dist.privacy.release import clip_rows, noisy_class_means
from htfl_dist.privacy.startup import (
    attach_ledger,
    check_private_config,
    check_private_run,
    epsilon_columns,
    privacy_plan,
)
from htfl_dist.seeding import seed_global_torch, torch_generator
from tests.conftest import SMOKE, launch, maths_only, read_metrics, run_program
from tests.helpers import make_client, make_context, roundtrip

pytest.importorskip("opacus")

DELTA = 1e-5


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_delta(epsilon: float, sigma: float) -> float:
    """The exact δ(ε) of one Gaussian mechanism of sensitivity 1 and noise σ (Balle & Wang 2018,
    Thm. 8): Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ)."""
    return _phi(1 / (2 * sigma) - epsilon * sigma) - math.exp(epsilon) * _phi(-1 / (2 * sigma) - epsilon * sigma)


def rdp_epsilon(mechanisms: int, sigma: float, delta: float) -> float:
    """ε of ``mechanisms`` Gaussian mechanisms through Rényi DP, minimised over a fine grid of
    orders: RDP ε_α = n·α / (2σ²), converted as ε = ε_α + log((α − 1)/α) − (log δ + log α)/(α − 1)."""
    orders = np.linspace(1.01, 400, 200_000)
    values = (mechanisms * orders / (2 * sigma**2) + np.log((orders - 1) / orders)
              - (math.log(delta) + np.log(orders)) / (orders - 1))
    return float(values.min())


def _plan(sigma: float = 1.0, *, target: float = 4.0, epochs: int = 1, clip: float = 1.0, grad_norm: float = 1.0,
          min_count: int = 1, accountant: str = "rdp", noise: str = "seeded") -> PrivacyPlan:
    """A plan for the maths tests: seeded noise (the tests that compare two neighbours need the
    same draws on both sides); the secret default has tests of its own."""
    return PrivacyPlan(noise_multiplier=sigma, target_epsilon=target, delta=DELTA, feature_clip=clip,
                       max_grad_norm=grad_norm, min_class_samples=min_count, accountant=accountant,
                       local_epochs=epochs, seed=0, noise=noise)


# --------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("mechanisms", [1, 10, 60])
def test_rdp_calibration_meets_the_hand_computed_bounds(mechanisms):
    """σ from the RDP accountant: n mechanisms of σ are one Gaussian of σ/√n, whose exact δ at
    the target ε is within δ (RDP is an upper bound); the hand-computed RDP ε is at the target
    (Opacus's coarser order grid can only be above it); and σ is tight: 3 % less overspends."""
    sigma = calibrate_noise(4.0, DELTA, mechanisms, "rdp")
    assert gaussian_delta(4.0, sigma / math.sqrt(mechanisms)) <= DELTA
    by_hand = rdp_epsilon(mechanisms, sigma, DELTA)
    opacus = epsilon_spent(((sigma, 1.0, mechanisms),), DELTA, "rdp")
    assert by_hand <= opacus + 1e-9 and opacus == pytest.approx(by_hand, rel=0.02)
    assert 3.98 <= opacus <= 4.0
    assert rdp_epsilon(mechanisms, 0.97 * sigma, DELTA) > 4.0


def test_one_gaussian_hand_computed_case():
    """One mechanism at ε = 1, δ = 1e-5: bisection on Balle & Wang's exact δ(ε) gives σ = 3.73 (the
    analytic Gaussian mechanism's published value); PRV (numerically near-exact) calibrates within
    2 % above it, RDP (an upper bound) above it too."""
    low, high = 0.1, 20.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if gaussian_delta(1.0, middle) > DELTA else (low, middle)
    exact = high
    assert exact == pytest.approx(3.73, abs=0.005)
    prv = calibrate_noise(1.0, DELTA, 1, "prv")
    rdp = calibrate_noise(1.0, DELTA, 1, "rdp")
    assert exact <= prv <= 1.02 * exact
    assert rdp >= prv


def test_plan_counts_every_epoch_and_release_of_the_planned_rounds():
    """R rounds of E DP-SGD epochs and one release are R·(E + 1) mechanisms, calibrated so that
    exactly the planned spending lands on the target."""
    raw = {"rounds": 9, "train": {"local_epochs": 2},
           "privacy": {"enabled": True, "target_epsilon": 3.0, "planned_rounds": 4}}
    plan = privacy_plan(config_from_dict(raw))
    assert gaussian_delta(3.0, plan.noise_multiplier / math.sqrt(12)) <= DELTA
    spent = epsilon_spent(((plan.noise_multiplier, 1.0, 12),), DELTA, "rdp")
    assert 2.98 <= spent <= 3.0
    assert privacy_plan(config_from_dict({"rounds": 4, "train": {"local_epochs": 2},
                                          "privacy": {"enabled": True, "target_epsilon": 3.0}})) == plan
    assert privacy_plan(config_from_dict({})) is None


# --------------------------------------------------------------------------- released class rows


def test_clipping_bounds_every_row_and_keeps_short_ones():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(200, 16, generator=generator) * torch.logspace(-2, 2, 200).unsqueeze(1)
    clipped = clip_rows(rows, 1.5)
    norms = clipped.norm(dim=1)
    assert bool((norms <= 1.5 * (1 + 1e-6)).all())
    short = rows.norm(dim=1) <= 1.5
    torch.testing.assert_close(clipped[short], rows[short])
    long = ~short
    torch.testing.assert_close(norms[long], torch.full_like(norms[long], 1.5))
    cosine = torch.nn.functional.cosine_similarity(clipped, rows, dim=1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine))  # scaled, never turned


def _class_sums(rows, labels, classes, clip):
    clipped = clip_rows(rows, clip)
    sums = torch.zeros(classes, rows.shape[1], dtype=torch.float64).index_add_(0, labels, clipped.double())
    return sums, torch.bincount(labels, minlength=classes).double()


def test_replacing_one_sample_moves_only_its_class_mean_by_at_most_2S_over_n():
    """Noise off: the released mean of the replaced sample's class moves by at most 2S/n_c (and
    almost exactly that for two antipodal rows); every other class's row stays put. A class below
    ``min_count`` is not released."""
    S, classes = 2.0, 4
    labels = torch.tensor([0] * 5 + [1] * 8 + [2] * 2 + [3] * 6)
    rows = torch.randn(labels.shape[0], 6, generator=torch.Generator().manual_seed(1)) * 3
    direction = torch.nn.functional.normalize(torch.randn(6, generator=torch.Generator().manual_seed(2)), dim=0)
    rows[7], replaced = direction * 10, rows.clone()
    replaced[7] = -direction * 10  # sample 7 (class 1) replaced by its opposite, far outside S
    kwargs = dict(clip=S, noise_multiplier=0.0, min_count=3, noise=SeededNoise(0))
    ids, before = noisy_class_means(*_class_sums(rows, labels, classes, S), **kwargs)
    ids_after, after = noisy_class_means(*_class_sums(replaced, labels, classes, S), **kwargs)
    assert ids.tolist() == ids_after.tolist() == [0, 1, 3]  # class 2 has 2 < 3 samples
    moved = (after - before).norm(dim=1)
    assert float(moved[1]) <= 2 * S / 8 * (1 + 1e-5)
    assert float(moved[1]) == pytest.approx(2 * S / 8, rel=1e-5)
    assert float(moved[0]) == 0 and float(moved[2]) == 0


def test_class_means_hook_releases_clipped_noised_rows_with_one_stream_per_round():
    """Through ``class_rows.class_means`` with a ledger: the same (seed, client, round) stream
    noises both neighbours alike, so replacing one sample moves its class row by at most 2S/n_c
    even with the noise on; another round draws other noise; the ledger is charged one release."""
    _, context = make_context("fedproto", num_classes=3, feature_dim=8)
    client, neighbour = make_client(context, samples=30), make_client(context, samples=30)
    neighbour.train_x = client.train_x.clone()
    neighbour.train_x[4] = -50 * client.train_x[4]  # sample 4 (class 1) replaced
    plan = _plan(sigma=0.7, clip=0.5, min_count=1, target=100.0)
    for state in (client, neighbour):
        attach_ledger(state, plan)
        state.modules[LEDGER_KEY].begin_round(3)
    ids, rows = class_means(client, 3, "features")
    _, other = class_means(neighbour, 3, "features")
    assert ids.tolist() == [0, 1, 2]
    moved = (rows - other).double().norm(dim=1)
    assert float(moved[1]) <= 2 * 0.5 / 10 * (1 + 1e-4) and float(moved[[0, 2]].max()) < 1e-5
    client.model.eval()
    with torch.no_grad():
        clean = clip_rows(client.model.features(client.train_x), 0.5)
    means = torch.stack([clean[client.train_y == c].mean(0) for c in range(3)])
    noise = (rows - means).double()
    assert float(noise.norm()) > 0.05  # the noise is there: 0.7 · 2 · 0.5 / 10 per coordinate
    ledger = client.modules[LEDGER_KEY]
    assert ledger.history == ((0.7, 1.0, 1),)
    ledger.begin_round(4)
    _, later = class_means(client, 3, "features")
    assert float((later - rows).norm()) > 0.05  # round 4 draws other noise


def test_a_client_is_private_exactly_when_given_a_ledger_and_stays_so_when_parked(tmp_path):
    """``attach_ledger`` installs the private trainer beside the ledger, and the helpers branch on
    nothing else: a client built without privacy has none. A parked client is built again (the
    runtime's factory attaches a fresh ledger) and its state restored into that ledger, which
    the new trainer spends: the round's release already made is refused a second time. A copy
    of the client (FedL2G's study set, ``dataclasses.replace``) trains through the same one."""
    import dataclasses

    from htfl_dist.privacy.trainer import PrivateTrainer  # imports Opacus
    from htfl_dist.runtime.client_store import ClientStore

    _, context = make_context("fedproto", num_classes=3, feature_dim=8)
    assert make_client(context).private is None

    def build(client_id: int, shell: bool):
        client = make_client(context, client_id=client_id, samples=12)
        attach_ledger(client, _plan(0.7, target=100.0))
        return client

    store = ClientStore([0, 1], build, resident=1, device=torch.device("cpu"), rank=0, scratch_dir=tmp_path)
    client = store[0]
    assert isinstance(client.private, PrivateTrainer) and client.private.ledger is client.modules[LEDGER_KEY]
    client.modules[LEDGER_KEY].begin_round(0)
    class_means(client, 3, "features")
    store[1]  # parks client 0
    again = store[0]
    assert again is not client and store.unparked == 1
    assert isinstance(again.private, PrivateTrainer) and again.private.ledger is again.modules[LEDGER_KEY]
    assert again.modules[LEDGER_KEY].history == ((0.7, 1.0, 1),)
    again.modules[LEDGER_KEY].begin_round(0)  # as the runtime does before a participant trains
    with pytest.raises(PrivacyPlanError, match="client 0, round 1: a second release of class rows"):
        class_means(again, 3, "features")
    assert dataclasses.replace(again, train_x=again.train_x[:6], train_y=again.train_y[:6]).private is again.private
    store.close()


@pytest.mark.parametrize("source", [SecureNoise(), SeededNoise(7)], ids=["secure", "seeded"])
def test_release_noise_has_the_calibrated_scale(source):
    """The noise added to class c's mean has standard deviation σ · 2S / n_c, σ being the
    calibrated multiplier (measured over 40 000 coordinates: within 2 %), from either source."""
    sigma = calibrate_noise(4.0, DELTA, 20, "rdp")
    counts = torch.tensor([20.0, 50.0, 400.0])
    sums = torch.zeros(3, 40_000, dtype=torch.float64)
    _, rows = noisy_class_means(sums, counts, clip=1.5, noise_multiplier=sigma, min_count=1, noise=source)
    for row, n in zip(rows, counts.tolist(), strict=True):
        assert float(row.double().std()) == pytest.approx(sigma * 2 * 1.5 / n, rel=0.02)
        assert abs(float(row.double().mean())) < 4 * sigma * 3 / n / math.sqrt(40_000)


# --------------------------------------------------------------------------- DP-SGD


def _private_client(plan, samples, batch_size, lr=0.1, data_seed=0):
    _, context = make_context("fedproto", num_classes=3, feature_dim=8, batch_size=batch_size, lr=lr)
    client = make_client(context, samples=samples, data_seed=data_seed)
    attach_ledger(client, plan)
    client.modules[LEDGER_KEY].begin_round(0)
    return context, client


def _parameters(client) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in client.model.parameters()]).double()


def test_dpsgd_noise_has_the_calibrated_scale():
    """A loss with zero gradient: one step moves the parameters by lr · noise / B only, whose
    standard deviation is lr · 2σC / B (2C: a replaced sample's clipped gradient moves the sum
    by up to 2C)."""
    sigma, C, B, lr = 1.3, 0.8, 6, 0.1
    context, client = _private_client(_plan(sigma, grad_norm=C, target=1e4), samples=B, batch_size=B, lr=lr)
    before = _parameters(client)
    loss, samples = run_local_training(client, context, lambda batch: 0.0 * batch.logits.sum(),
                                       torch_generator(0, "b"))
    assert samples == B and loss == 0.0
    step = _parameters(client) - before
    assert float(step.std()) == pytest.approx(lr * 2 * sigma * C / B, rel=0.02)
    assert client.modules[LEDGER_KEY].history == ((sigma, 1.0, 1),)
    assert not any(hasattr(p, "grad_sample") or hasattr(p, "summed_grad") for p in client.model.parameters())


def test_dpsgd_step_moves_by_at_most_2C_over_B_when_one_sample_is_replaced():
    """Two neighbouring clients (sample 2 replaced) take one DP-SGD step with the same noise
    stream: their parameters differ by at most lr · 2C / B, however large the gradients (the
    loss is scaled by 1e4), which holds only if every per-sample gradient was clipped to C.
    FedProto's batch-coupled regulariser is in the loss: per-sample evaluation keeps the bound."""
    C, B, lr = 0.5, 5, 0.1
    plan = _plan(2.0, grad_norm=C, target=1e4)
    entry, context = make_context("fedproto", num_classes=3, feature_dim=8, batch_size=B, lr=lr)
    protos = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    knowledge = {"class_ids": torch.tensor([0, 1, 2]), "protos": protos}
    algorithm = entry.client(context)
    loss_fn = algorithm.loss_function(knowledge, torch.device("cpu"))
    results = []
    for replace in (False, True):
        client = make_client(context, samples=B)
        if replace:
            client.train_x[2] = torch.randn(1, 28, 28, generator=torch.Generator().manual_seed(9)) * 20
        attach_ledger(client, plan)
        client.modules[LEDGER_KEY].begin_round(0)
        before = _parameters(client)
        run_local_training(client, context, lambda batch: 1e4 * loss_fn(batch), torch_generator(0, "b"))
        results.append(_parameters(client) - before)
    gap = float((results[0] - results[1]).norm())
    assert gap <= lr * 2 * C / B * (1 + 1e-4)
    assert gap > 0.2 * lr * C / B  # the replaced sample's clipped gradient did change


def test_dpsgd_trains_and_reports_per_sample_losses():
    """With little noise DP-SGD still learns the training batches (the loss falls over epochs),
    and the reported loss is the sum of the per-sample losses."""
    context, client = _private_client(_plan(0.05, grad_norm=5.0, target=1e6, epochs=1), samples=12, batch_size=4,
                                      lr=0.05)
    generator = torch_generator(0, "b")
    first, seen = run_local_training(client, context, batch_cross_entropy, generator)
    assert seen == 12
    for round_index in range(1, 6):
        client.modules[LEDGER_KEY].begin_round(round_index)
        last, _ = run_local_training(client, context, batch_cross_entropy, torch_generator(0, "b", round_index))
    assert last < first


def test_dpsgd_refuses_other_optimizers_and_gradient_edits():
    context, client = _private_client(_plan(1.0), samples=8, batch_size=4)
    with pytest.raises(ConfigError, match="DP-SGD does not cover"):
        run_local_training(client, context, batch_cross_entropy, torch_generator(0, "b"), before_step=lambda: None)


def test_batchnorm_model_is_refused_with_one_line():
    _, context = make_context("fedproto", num_classes=3, feature_dim=8)
    client = make_client(context)
    client.model.extra = torch.nn.BatchNorm1d(4)
    with pytest.raises(ConfigError, match="BatchNorm1d") as caught:
        attach_ledger(client, _plan(1.0))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("algorithm, options", [
    ("fedproto", {}), ("fedproto", {"client_reg": "htfllib"}), ("fedtgp", {}), ("fedoc", {}), ("fedgh", {}),
    ("feddistill", {"logits_from": "post_update"}), ("fedsa", {"weighted": False}),
    ("fedsa", {"weighted": False, "reg_distance": "mse", "contrast_on": "samples", "margin_rule": "nearest"}),
])
def test_accepted_algorithms_train_privately_through_their_own_code(algorithm, options):
    """Two rounds of each accepted algorithm's own client and server with a ledger: every loss
    runs under the per-sample DP-SGD step, every upload is the noised release of the classes
    with enough samples, and the ledger holds E + 1 mechanisms per round."""
    plan = _plan(1.0, target=1e3, min_count=3)
    entry, context = make_context(algorithm, num_classes=3, feature_dim=8, **options)
    server, algorithm_client = entry.server(context), entry.client(context)
    client = make_client(context, samples=8)  # classes 0, 1 hold 3 samples each, class 2 holds 2
    algorithm_client.init_client(client)
    attach_ledger(client, plan)
    before = _parameters(client)
    for round_index in range(2):
        client.modules[LEDGER_KEY].begin_round(round_index)
        result = algorithm_client.train(client, server.download(), round_index, torch_generator(0, "b", round_index))
        assert result.samples == 8 and math.isfinite(result.loss_sum)
        assert result.upload["class_ids"].tolist() == [0, 1]
        server.validate_upload(0, result.upload)
        server.update({0: result.upload}, round_index, torch_generator(0, "s", round_index))
    assert client.modules[LEDGER_KEY].history == ((1.0, 1.0, 4),)
    assert float((_parameters(client) - before).norm()) > 0


def test_a_loss_that_calls_the_model_itself_gets_that_gradient_through_dpsgd():
    """FedSA's L_CC sends the anchors through the head, not the batch: under DP-SGD that term must
    differentiate the same weights as the forward pass. Two clients, same noise stream, one with
    the extra term head(a).sum() for a constant a: one step apart they differ by exactly
    −lr·∂/∂θ (bias: −lr per entry; weight: −lr·a in every row; nothing else), the term's
    per-sample gradient norm √(C·(‖a‖² + 1)) ≈ 1.94 being below the clipping norm 5."""
    lr, B = 0.1, 4
    anchor = torch.full((1, 8), 0.5 / math.sqrt(8))  # ‖a‖ = 0.5
    steps = []
    for extra in (False, True):
        context, client = _private_client(_plan(0.5, grad_norm=5.0, target=1e4), samples=B, batch_size=B, lr=lr)
        head = client.model.head

        def loss_fn(batch, head=head, extra=extra):
            loss = 0.0 * batch.logits.sum()
            return loss + head(anchor).sum() if extra else loss

        before = {name: p.detach().clone() for name, p in client.model.named_parameters()}
        run_local_training(client, context, loss_fn, torch_generator(0, "b"))
        steps.append({name: p.detach() - before[name] for name, p in client.model.named_parameters()})
    for name, step in steps[1].items():
        difference = step - steps[0][name]
        if name.endswith("head.bias"):
            expected = torch.full_like(difference, -lr)
        elif name.endswith("head.weight"):
            expected = -lr * anchor.expand_as(difference)
        else:
            expected = torch.zeros_like(difference)
        torch.testing.assert_close(difference, expected, rtol=0, atol=1e-6, msg=name)


def test_public_term_is_added_after_the_noise_and_trains_its_own_modules():
    """A public loss (no training sample in it) adds its plain gradient to the noised one and steps
    its own optimizers: with L = ½‖b‖² + ½‖w‖² (b the head's bias, w a module of its own), one
    step differs from the same step without it by exactly −lr·b on b and nothing elsewhere; w
    moves to (1 − lr_w)·w; the reported loss grows by L × batch size."""
    from htfl_dist.privacy.dpsgd import train_privately

    lr, lr_w, B = 0.1, 0.3, 4
    outcomes = []
    for public in (False, True):
        context, client = _private_client(_plan(0.5, grad_norm=1.0, target=1e4), samples=B, batch_size=B, lr=lr)
        bias = client.model.head.bias
        own = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        start_bias, start_own = bias.detach().clone(), own.detach().clone()
        public_loss = (lambda b=bias, w=own: 0.5 * b.pow(2).sum() + 0.5 * w.pow(2).sum()) if public else None
        loss, seen = train_privately(client, context, batch_cross_entropy, torch_generator(0, "b"),
                                     client.modules[LEDGER_KEY], public_loss=public_loss,
                                     public_optimizers=(torch.optim.SGD([own], lr=lr_w),))
        outcomes.append((loss, {name: p.detach().clone() for name, p in client.model.named_parameters()},
                         own.detach().clone()))
        assert seen == B
    (plain_loss, plain, _), (loss, with_public, own_after) = outcomes
    for name, value in with_public.items():
        expected = plain[name] - lr * start_bias if name.endswith("head.bias") else plain[name]
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(own_after, (1 - lr_w) * start_own)
    public_value = 0.5 * float(start_bias.pow(2).sum()) + 0.5 * 5.0
    assert loss == pytest.approx(plain_loss + B * public_value, rel=1e-5)


def _ktl_generator(latent_dim: int):
    """z → ConvTranspose(latent→1, 28×28) on a 1×1 map → tanh: 1×28×28 images, seeded weights and
    bias (left to ``nn.ConvTranspose2d``, the bias would come from the process's global stream, and
    two generators built in one test would differ)."""
    from htfl_dist.generators.dcgan import PriorLatentGenerator

    module = torch.nn.Sequential(torch.nn.Unflatten(1, (latent_dim, 1, 1)),
                                 torch.nn.ConvTranspose2d(latent_dim, 1, 28), torch.nn.Tanh())
    seeded = torch.Generator().manual_seed(5)
    with torch.no_grad():
        module[1].weight.copy_(torch.randn(module[1].weight.shape, generator=seeded) * 0.3)
        module[1].bias.copy_(torch.randn(module[1].bias.shape, generator=seeded) * 0.3)
    return PriorLatentGenerator("tiny", module, latent_dim, channels=1, resolution=28, provenance={})


def _ktl_context(**options):
    from htfl_dist.algorithms import AlgorithmContext
    from htfl_dist.config import TrainConfig

    entry = get_algorithm("fedktl")
    return entry, AlgorithmContext(num_classes=3, feature_dim=8, seed=0, train=TrainConfig(batch_size=4, lr=0.05),
                                   options=parse_options(entry, {"server_epochs": 2, **options}), in_channels=1,
                                   image_size=28, latent_dim=6, model_group="HtCNN8", num_clients=2)


@pytest.mark.parametrize("options", [{}, {"compat": "reference"}])
def test_fedktl_trains_privately_with_its_transfer_loss_as_a_public_term(options, monkeypatch):
    """FedKTL's own client and server over three rounds with a ledger: ArcFace goes through DP-SGD,
    the transfer loss on the downloaded pairs (from round 2 on) through the public term, and
    every upload is the noised release of the classes with enough samples (h′ and the 100-norm
    clipping included, nothing is refused)."""
    from htfl_dist.privacy.trainer import PrivateTrainer  # imports Opacus

    entry, context = _ktl_context(**options)
    server, algorithm = entry.server(context, _ktl_generator(6)), entry.client(context)
    client = make_client(context, samples=8)  # classes 0, 1 hold 3 samples each, class 2 holds 2
    algorithm.init_client(client)
    attach_ledger(client, _plan(1.0, target=1e3, min_count=3))
    public_calls = []
    real = PrivateTrainer.train

    def spy(self, *args, **kwargs):
        public_calls.append(kwargs["public_loss"] is not None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PrivateTrainer, "train", spy)
    before = _parameters(client)
    for round_index in range(3):
        client.modules[LEDGER_KEY].begin_round(round_index)
        result = algorithm.train(client, server.download(), round_index, torch_generator(0, "b", round_index))
        assert result.samples == 8 and math.isfinite(result.loss_sum)
        assert result.upload["class_ids"].tolist() == [0, 1] and result.upload["protos"].shape == (2, 3)
        server.validate_upload(0, result.upload)
        server.update({0: result.upload}, round_index, torch_generator(0, "s", round_index))
    assert public_calls == [False, True, True]  # no pairs before the first update
    assert client.modules[LEDGER_KEY].history == ((1.0, 1.0, 6),)
    assert float((_parameters(client) - before).norm()) > 0


@pytest.mark.parametrize("algorithm", ["fedsa", "fedktl"])
def test_a_private_clients_upload_depends_on_seed_client_and_round_only(algorithm):
    """World-size invariance, in process: client 1's round-2 upload is the same whether its rank
    trained client 0 before it or not (no stream keyed by the rank or by what ran before)."""
    def upload_of_client_1(train_client_0_first: bool) -> dict:
        seed_global_torch(0, "server-init")  # as startup does: FedKTL's F and centroids draw from it
        if algorithm == "fedktl":
            entry, context = _ktl_context()
            server = entry.server(context, _ktl_generator(6))
        else:
            entry, context = make_context(algorithm, num_classes=3, feature_dim=8, weighted=False)
            server = entry.server(context)
        algorithm_client = entry.client(context)
        clients = [make_client(context, client_id=cid, samples=12, data_seed=cid) for cid in (0, 1)]
        for client in clients:
            algorithm_client.init_client(client)
            attach_ledger(client, _plan(1.0, target=1e3, min_count=3))
        order = clients if train_client_0_first else clients[1:]
        for round_index in range(2):
            uploads = {}
            for client in order:
                client.modules[LEDGER_KEY].begin_round(round_index)
                generator = torch_generator(0, "batches", client.client_id, round_index)
                uploads[client.client_id] = algorithm_client.train(client, server.download(), round_index,
                                                                   generator).upload
            server.update({1: uploads[1]}, round_index, torch_generator(0, "s", round_index))
        return uploads[1]

    alone, after_another = upload_of_client_1(False), upload_of_client_1(True)
    assert alone.keys() == after_another.keys()
    for key in alone:
        assert torch.equal(alone[key], after_another[key]), key


# --------------------------------------------------------------------------- budget and resume


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_a_spent_budget_stops_training_and_uploads(capsys, accountant):
    """Calibrated for 2 rounds: the client takes part in rounds 1 and 2 (ε at most the target),
    then stops, says so in one line, neither trains nor uploads, and spends nothing more."""
    raw = {"rounds": 2, "privacy": {"enabled": True, "target_epsilon": 2.0, "min_class_samples": 1,
                                    "accountant": accountant}}
    plan = privacy_plan(config_from_dict(raw))
    entry, context = make_context("fedproto", num_classes=3, feature_dim=8, batch_size=4)
    algorithm = entry.client(context)
    client = make_client(context, client_id=3, samples=12)
    attach_ledger(client, plan)
    ledger = client.modules[LEDGER_KEY]
    knowledge = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 8)}
    spent = []
    for round_index in range(4):
        ledger.begin_round(round_index)
        result = algorithm.train(client, knowledge, round_index, torch_generator(0, "b", round_index))
        spent.append(ledger.epsilon())
        if round_index < 2:
            assert result.upload["class_ids"].tolist() == [0, 1, 2] and result.samples == 12
        else:
            assert result.upload["class_ids"].numel() == 0 and result.upload["protos"].shape == (0, 8)
            assert result.samples == 0
    assert spent[0] < spent[1] <= 2.0 and spent[1] == spent[2] == spent[3]
    lines = [line for line in capsys.readouterr().err.splitlines() if "privacy" in line]
    assert len(lines) == 1 and "client 3" in lines[0] and "round 3" in lines[0]


@pytest.mark.parametrize("epsilon, budget, message", [
    (3.99, 4.0, None), (0.0, 4.0, None), (4.0, 4.0, None), (7.5, None, None),
    (4.2, 4.0, "privacy ε=4.2 for client 5, past privacy.target_epsilon=4"),
    (-0.1, 4.0, "impossible privacy ε for client 5"), (float("nan"), None, "impossible privacy ε for client 5"),
    (float("inf"), 4.0, "impossible privacy ε for client 5"),
])
def test_a_ranks_epsilon_rows_are_screened(epsilon, budget, message):
    """Rank 0 checks every reported ε before it reaches metrics.jsonl: finite, >= 0 and at most
    the target (when known), one line naming the client."""
    from htfl_dist.errors import ProtocolError
    from htfl_dist.runtime.screening import check_rank_report

    entry = {"train": torch.tensor([[1.0, 10.0]], dtype=torch.float64), "eval": torch.zeros(0, 4),
             "privacy": torch.tensor([[epsilon]], dtype=torch.float64)}
    if message is None:
        check_rank_report({5: entry}, [5], [], epsilon_budget=budget)
        return
    with pytest.raises(ProtocolError, match=re.escape(message)) as caught:
        check_rank_report({5: entry}, [5], [], epsilon_budget=budget)
    assert "\n" not in str(caught.value)


def test_reported_epsilon_columns_are_the_max_and_median():
    assert epsilon_columns([0.5, 3.0, 1.0, 2.0]) == {"epsilon_max": 3.0, "epsilon_median": 1.5}
    assert epsilon_columns([]) == {}


def test_a_mechanism_past_the_budget_is_refused_never_a_silent_overspend():
    ledger = PrivacyLedger(_plan(1.0, target=3.0, epochs=50), 0)
    ledger.round_index = 0  # as if begin_round had not stopped it: the ledger itself must refuse
    with pytest.raises(PrivacyPlanError, match=r"client 0, round 1: DP-SGD local training would take ε to .* past"):
        ledger.open_mechanism("sgd")
    assert ledger.history == ()


def test_a_second_release_in_a_round_is_refused_in_one_line_naming_client_round_and_mechanism():
    """Finding 3 of the audit: a second release in one round was accepted, charged as independent
    and drew the same noise, so the difference of the two was noise-free. It is refused now,
    before any noise is drawn, and so is a second DP-SGD pass, a mechanism outside a round and one
    the plan does not know; the next round allows one of each again."""
    ledger = PrivacyLedger(_plan(1.0, target=100.0), 4)
    with pytest.raises(PrivacyPlanError, match="client 4, outside a round: release of class rows"):
        ledger.open_mechanism("release")
    ledger.begin_round(2)
    ledger.open_mechanism("sgd")
    ledger.open_mechanism("release")
    spent = ledger.history
    for mechanism, name in (("release", "release of class rows"), ("sgd", "DP-SGD local training")):
        with pytest.raises(PrivacyPlanError) as caught:
            ledger.open_mechanism(mechanism)
        message = str(caught.value)
        assert f"client 4, round 3: a second {name} in one round is not in the privacy plan" in message
        assert "\n" not in message
    with pytest.raises(PrivacyPlanError, match="client 4, round 3: 'histogram' is not a mechanism"):
        ledger.open_mechanism("histogram")
    assert ledger.history == spent  # nothing refused was charged
    ledger.begin_round(2)  # the runtime starting the same round again does not reopen it
    with pytest.raises(PrivacyPlanError, match="a second release"):
        ledger.open_mechanism("release")
    parked = PrivacyLedger(_plan(1.0, target=100.0), 4)  # parked and restored within the round
    parked.load_state_dict(roundtrip(ledger.state_dict()))
    parked.begin_round(2)
    with pytest.raises(PrivacyPlanError, match="a second release"):
        parked.open_mechanism("release")
    ledger.begin_round(3)
    ledger.open_mechanism("release")


def test_the_class_means_hook_refuses_a_second_release_in_a_round():
    """Through the algorithms' one release path: an algorithm that builds its class rows twice in
    a round gets one line, not a second noisy copy of the same means."""
    _, context = make_context("fedproto", num_classes=3, feature_dim=8)
    client = make_client(context, client_id=2, samples=30)
    attach_ledger(client, _plan(0.7, target=100.0))
    client.modules[LEDGER_KEY].begin_round(0)
    class_means(client, 3, "features")
    with pytest.raises(PrivacyPlanError, match="client 2, round 1: a second release of class rows"):
        class_means(client, 3, "features")


def test_seeded_noise_is_keyed_per_release_so_no_two_releases_share_a_draw():
    """Even in seeded mode a client's releases never reuse a draw: the key holds the mechanism,
    the round and the release number (what the client recorded before), so another mechanism,
    another round or another history draws other noise; the same release of the same run draws
    the same noise."""
    def release_noise(rounds: list[int]) -> list[torch.Tensor]:
        ledger = PrivacyLedger(_plan(1.0, target=1e3), 0)
        draws = []
        for round_index in rounds:
            ledger.begin_round(round_index)
            draws.append(ledger.open_mechanism("release").standard_normal((4, 5)))
        return draws

    first, again = release_noise([0, 1]), release_noise([0, 1])
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])
    ledger = PrivacyLedger(_plan(1.0, target=1e3), 0)
    ledger.begin_round(0)
    sgd = ledger.open_mechanism("sgd").standard_normal((4, 5))
    release = ledger.open_mechanism("release").standard_normal((4, 5))
    assert not torch.equal(sgd, release)
    earlier = PrivacyLedger(_plan(1.0, target=1e3), 0)  # the same round after other releases
    earlier.history = ((1.0, 1.0, 3),)
    earlier.begin_round(0)
    assert not torch.equal(earlier.open_mechanism("sgd").standard_normal((4, 5)), sgd)


def test_ledger_round_trip_continues_epsilon_exactly():
    """The ledger's state through a checkpoint (torch.save / weights_only load) into a ledger
    built from another plan (a resumed run with more rounds calibrates another σ): the history,
    the kept σ and the stop continue, so ε after further rounds equals the uninterrupted one."""
    plan = _plan(1.7, target=30.0)
    original = PrivacyLedger(plan, 5)
    for round_index in range(3):
        original.begin_round(round_index)
        original.open_mechanism("sgd")
        original.open_mechanism("release")
    restored = PrivacyLedger(_plan(9.0, target=30.0), 5)
    restored.load_state_dict(roundtrip(copy.deepcopy(original.state_dict())))
    assert restored.history == original.history == ((1.7, 1.0, 6),)
    assert restored.noise_multiplier == 1.7 and restored.epsilon() == original.epsilon()
    for ledger in (original, restored):
        ledger.begin_round(3)
        ledger.open_mechanism("sgd")
        ledger.open_mechanism("release")
    assert restored.epsilon() == original.epsilon()
    stopped = PrivacyLedger(plan, 5)
    stopped.stopped_round = 4
    again = PrivacyLedger(plan, 5)
    again.load_state_dict(roundtrip(stopped.state_dict()))
    again.begin_round(5)
    assert not again.active


# --------------------------------------------------------------------------- config and refusals


def test_privacy_section_off_leaves_the_experiment_and_its_hash_alone():
    plain = config_from_dict({})
    assert "privacy" not in plain.experiment()
    changed_but_off = config_from_dict({"privacy": {"delta": 1e-6, "feature_clip": 3.0}})
    assert changed_but_off.config_hash() == plain.config_hash()
    on = config_from_dict({"privacy": {"enabled": True}})
    assert on.experiment()["privacy"]["target_epsilon"] == 4.0 and on.config_hash() != plain.config_hash()


@pytest.mark.parametrize("raw, message", [
    ({"privacy": {"delta": 1.0}}, "'privacy.delta' must be in (0, 1)"),
    ({"privacy": {"target_epsilon": 0}}, "'privacy.target_epsilon' must be > 0"),
    ({"privacy": {"accountant": "gdp"}}, "'privacy.accountant' is 'gdp'; allowed: rdp, prv"),
    ({"privacy": {"min_class_samples": 0}}, "'privacy.min_class_samples' must be >= 1"),
])
def test_bad_privacy_values_are_one_line(raw, message):
    with pytest.raises(ConfigError) as caught:
        config_from_dict(raw)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def _check(algorithm, **extra):
    algo = extra.pop("algo", {})
    config = config_from_dict({"algorithm": algorithm, "privacy": {"enabled": True}, "algo": algo, **extra})
    entry = get_algorithm(algorithm)
    options = parse_options(entry, algo)
    _, context = make_context(algorithm, num_classes=10, feature_dim=8, **algo)
    check_private_run(config, entry, options, [field.name for field in entry.client.upload_fields(context)])


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp", "fedoc", "fedgh", "fedktl"])
def test_class_row_algorithms_are_accepted(algorithm):
    _check(algorithm)


def test_fedsa_without_counts_on_the_wire_is_accepted():
    _check("fedsa", algo={"weighted": False})


@pytest.mark.parametrize("algorithm, extra, message", [
    ("fedkd", {}, "uploads what privacy.* does not noise"),
    ("lgfedavg", {}, "uploads what privacy.* does not noise"),
    ("fml", {}, "uploads what privacy.* does not noise"),
    ("feddistill", {}, "algo.logits_from=during_training"),
    ("fedproto", {"algo": {"proto_from": "during_training"}}, "algo.proto_from=during_training"),
    ("fedproto", {"algo": {"weighted": True}}, "class counts"),
    ("fedproto", {"train": {"client_batching": "vmap"}}, "client_batching=vmap"),
    ("fedsa", {}, "class counts"),  # the paper's weighted mean
    ("fedsa", {"algo": {"compat": "reference"}}, "algo.proto_from=during_training"),
    ("fedl2g", {}, "uploads what privacy.* does not noise"),
])
def test_uncovered_runs_are_refused_with_one_line(algorithm, extra, message):
    with pytest.raises(ConfigError) as caught:
        _check(algorithm, **extra)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_feddistill_with_post_update_logits_is_accepted():
    _check("feddistill", algo={"logits_from": "post_update"})


@pytest.mark.parametrize("overrides, needle", [
    (["model.group=HtFE8"], "privacy.enabled: model group 'HtFE8': member googlenet has a BatchNorm2d layer"),
    (["model.group=resnet18"], "member resnet18 has a BatchNorm2d layer (feature_extractor.bn1)"),
    (["algorithm=lgfedavg"], "algorithm 'lgfedavg' uploads what privacy.* does not noise"),
    (["algorithm=fedsa"], "fedsa with these options uploads class counts"),
    (["algo.proto_from=during_training"], "algo.proto_from=during_training"),
    (["train.client_batching=vmap"], "train.client_batching=vmap has no DP-SGD path"),
    (["train.compile=default"], "train.compile=default has no DP-SGD path (Opacus steps the eager model)"),
    (["eval.new_clients=2"], "privacy.enabled: eval.new_clients=2: the unseen clients would train and report "
                             "their accuracy without privacy"),
], ids=["batchnorm-group", "batchnorm-member", "not-private", "counts-on-the-wire", "rows-during-training",
        "batched-clients", "compiled-forward", "unseen-clients"])
def test_every_privacy_refusal_is_one_line_before_the_data_loads(tmp_path, overrides, needle):
    """Were refused after the partition was prepared and the models built (the audit: a BatchNorm
    group, an algorithm that cannot be private), or not at all (unseen clients trained without
    privacy). The data root does not exist: a refusal that came after the data would be a
    data error instead, and the start's "data:" line would be there."""
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path / "run"), "privacy.enabled=true",
                          f"data.root={tmp_path / 'no-such-data'}", *overrides])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("htfl_dist: error: privacy.enabled"), result.stderr
    assert needle in lines[0]
    assert "data:" not in result.stderr + result.stdout
    assert not (tmp_path / "run").exists()


def test_a_group_without_batch_statistics_passes_the_early_check():
    """The stand-in models of the early check find nothing in HtCNN8 (the smoke config's group, whose
    private runs the rest of this file plays), nor in the sensor, text and tabular groups, whose
    stand-in inputs are of their own kinds."""
    for group in ("HtCNN8", "HtFE-sen-5", "HtFE-txt-5-1", "MLPs"):
        check_private_config(config_from_dict({"privacy": {"enabled": True}, "model": {"group": group},
                                               "num_clients": 10}))


def _without_cryptography(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every import of ``cryptography`` raises ImportError, as where it is not installed."""
    for name in [name for name in sys.modules if name == "cryptography" or name.startswith("cryptography.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "cryptography", None)


def test_secret_noise_without_cryptography_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    """Was a 78-line traceback at the first DP-SGD step: Opacus does not bring ``cryptography``,
    which the secret noise's ChaCha20 needs. Now the start names the package and the extra."""
    _without_cryptography(monkeypatch)
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path / "run"), "privacy.enabled=true",
                          f"data.root={tmp_path / 'no-such-data'}"])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "package 'cryptography' (ChaCha20), which is not installed" in lines[0]
    assert "pip install 'htfl_dist[privacy]'" in lines[0]
    assert "data:" not in result.stderr + result.stdout and not (tmp_path / "run").exists()
    # seeded noise draws nothing from it: accepted without it (and says at start-up what it is)
    check_private_config(config_from_dict({"privacy": {"enabled": True, "noise": "seeded"}}))


def test_a_target_just_above_the_floor_is_calibrated_or_refused_never_a_traceback():
    """The audit's window: Opacus's search doubles σ from 10 and refuses any σ past its MAX_SIGMA
    (1e6), so the largest σ it can return is 10·2^16 = 655,360, whose ε is a little above the ε at
    1e6 that the floor was computed at. A target between the two passed the floor check and ended
    in Opacus's ValueError; now it is the floor's line, and the floor itself is reachable."""
    from opacus.accountants.utils import MAX_SIGMA

    assert MAX_SIGMA == 1e6
    for accountant in ("rdp", "prv"):
        at_max = epsilon_spent(((1e6, 1.0, 6),), DELTA, accountant)
        floor = epsilon_spent(((655_360.0, 1.0, 6),), DELTA, accountant)
        assert at_max < floor
        with pytest.raises(ConfigError) as caught:
            calibrate_noise((at_max + floor) / 2, DELTA, 6, accountant)
        assert f"the smallest reachable ε for this run's plan is {floor:.4g}" in str(caught.value)
        assert calibrate_noise(floor, DELTA, 6, accountant) == 655_360.0


# --------------------------------------------------------------------------- a real run


PRIVATE = ("privacy.enabled=true", "privacy.target_epsilon=4", "rounds=2", "data.subsample=0.01")
"""Half the smoke config's data: DP-SGD's per-sample gradients make these runs the suite's costliest
per sample, and equality across world sizes and the ε bookkeeping do not depend on the data size."""


def _private_smoke(launcher: str, nproc: int, out, cache_dir, *overrides: str) -> list[dict]:
    """``conftest.run_smoke`` with room for DP-SGD's per-sample step on a busy machine."""
    result = launch(launcher, nproc, ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}",
                                      *overrides], timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(out)


NOISE_FREE = ("round", "epsilon_max", "epsilon_median", "global_classes", "bytes_theory_up", "bytes_theory_down",
              "skipped_clients", "train_loss")
"""Metrics a private run with secret noise must give alike on every world size and every run:
ε, which classes were released (hence the theoretical bytes), who was left out, and the absent
training loss. The accuracies depend on the noise, which differs from run to run by design."""


@pytest.mark.launch
def test_private_run_is_world_size_invariant(tmp_path, cache_dir):
    """The same private FedProto run with the secret noise (the default) in one process and on
    three mpirun ranks: every noise-free metric is identical; FedKTL's below, with seeded noise,
    is identical in everything (it takes torchrun)."""
    from htfl_dist.runtime.simulate import simulate

    single = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *PRIVATE], out=tmp_path / "single")
    ranks = _private_smoke("mpirun", 3, tmp_path / "mpirun", cache_dir, *PRIVATE)
    assert [{k: row[k] for k in NOISE_FREE} for row in single] == [{k: row[k] for k in NOISE_FREE} for row in ranks]
    assert [row["round"] for row in single] == [1, 2] and single[-1]["global_classes"] > 0
    assert 3.9 <= single[-1]["epsilon_max"] <= 4.0 and single[0]["epsilon_max"] < single[-1]["epsilon_max"]


@pytest.mark.launch
def test_private_fedktl_on_three_ranks_matches_the_in_process_run(tmp_path, cache_dir):
    """FedKTL with privacy on and seeded noise (DP-SGD with its public transfer term, the
    server's generator): three torchrun ranks give the metrics of the in-process run
    (``simulate``, which plays the rows of any launch), bit for bit, ε included. One launch:
    FedSA's placement independence is checked in process
    (test_a_private_clients_upload_depends_on_seed_client_and_round_only)."""
    from htfl_dist.runtime.simulate import simulate

    overrides = ("algorithm=fedktl", *PRIVATE, "privacy.noise=seeded")
    single = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *overrides], out=tmp_path / "single")
    ranks = _private_smoke("torchrun", 3, tmp_path / "torchrun", cache_dir, *overrides)
    assert maths_only(single) == maths_only(ranks)
    assert 3.9 <= single[-1]["epsilon_max"] <= 4.0


@pytest.mark.integration
def test_resume_continues_epsilon_exactly_and_stops_clients_at_the_budget(tmp_path, cache_dir):
    """Calibrated for 2 rounds, run for 3: the third round is past every client's budget, so each
    client says so once and uploads nothing, and ε stays where round 2 left it. Resumed from the
    round-2 checkpoint (ledgers in the client files), the run reproduces the uninterrupted one
    (bit for bit with seeded noise)."""
    from htfl_dist.runtime.simulate import simulate

    planned = (*PRIVATE[:2], PRIVATE[3], "privacy.planned_rounds=2", "privacy.noise=seeded")
    whole = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *planned, "rounds=3"], out=tmp_path / "whole")
    assert whole[2]["epsilon_max"] == whole[1]["epsilon_max"] <= 4.0
    assert whole[2]["global_classes"] == 0.0  # nobody uploaded a row in round 3
    part = tmp_path / "part"
    simulate(SMOKE, [f"data.cache_dir={cache_dir}", *planned, "rounds=2", "checkpoint_every=1"], out=part)
    resumed = run_program(["--config", str(SMOKE), "--out", str(part), f"data.cache_dir={cache_dir}",
                          *planned, "rounds=3", "checkpoint_every=1", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("neither trains nor uploads") == 6
    assert maths_only(read_metrics(part)) == maths_only(whole)
