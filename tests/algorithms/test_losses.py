"""Distillation losses (htfl_dist.algorithms.losses) against values worked out by hand, and which
way their gradients flow."""
from __future__ import annotations

import math

import pytest
import torch

from htfl_dist.algorithms.losses import fedkd_losses, fml_losses, kl_divergence

LN3 = math.log(3.0)
# Two rows, two classes. Row 0: q = softmax(0, 0) = (1/2, 1/2), p = softmax(ln 3, 0) = (3/4, 1/4);
# row 1 swaps the roles.
TARGET = torch.tensor([[0.0, 0.0], [LN3, 0.0]], dtype=torch.float64)
LOGITS = torch.tensor([[LN3, 0.0], [0.0, 0.0]], dtype=torch.float64)
KL_ROW0 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # = ½ ln(4/3) ≈ 0.14384
KL_ROW1 = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # ≈ 0.13081


def test_kl_by_hand_in_both_reductions():
    assert math.isclose(KL_ROW0, 0.143841, abs_tol=1e-6) and math.isclose(KL_ROW1, 0.130812, abs_tol=1e-6)
    batchmean = kl_divergence(TARGET, LOGITS, "batchmean", True)
    mean_all = kl_divergence(TARGET, LOGITS, "mean_all", True)
    assert float(batchmean) == pytest.approx((KL_ROW0 + KL_ROW1) / 2, rel=1e-12)
    assert float(mean_all) == pytest.approx((KL_ROW0 + KL_ROW1) / 4, rel=1e-12)  # ÷ B·C = 4
    # KL is not symmetric: the direction matters
    assert float(kl_divergence(LOGITS, TARGET, "batchmean", True)) == pytest.approx((KL_ROW1 + KL_ROW0) / 2)
    single = kl_divergence(TARGET[:1], LOGITS[:1], "batchmean", True)
    assert float(single) == pytest.approx(KL_ROW0, rel=1e-12)
    assert float(kl_divergence(LOGITS[:1], TARGET[:1], "batchmean", True)) == pytest.approx(
        0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5), rel=1e-12)


def test_detached_target_gets_no_gradient():
    for detach, expect_gradient in ((True, False), (False, True)):
        target = TARGET.clone().requires_grad_(True)
        logits = LOGITS.clone().requires_grad_(True)
        (grad_target, grad_logits) = torch.autograd.grad(
            kl_divergence(target, logits, "batchmean", detach), (target, logits), allow_unused=True)
        assert grad_logits is not None and bool(grad_logits.abs().sum() > 0)
        assert (grad_target is not None and bool(grad_target.abs().sum() > 0)) == expect_gradient


def _pair():
    logits = torch.tensor([[LN3, 0.0], [0.2, -0.1]], dtype=torch.float64, requires_grad=True)
    shared = torch.tensor([[0.0, 0.0], [1.0, 0.5]], dtype=torch.float64, requires_grad=True)
    return logits, shared, torch.tensor([0, 1])


def test_fml_values_by_hand():
    logits = torch.tensor([[LN3, 0.0]], dtype=torch.float64)
    shared = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0])
    ce, ce_shared = -math.log(0.75), math.log(2.0)
    kl_shared_to_local = KL_ROW0  # KL(p_g ‖ p) with p_g = (½, ½), p = (¾, ¼)
    kl_local_to_shared = KL_ROW1  # KL(p ‖ p_g)
    local, mutual = fml_losses(logits, shared, labels, 0.5, 0.3, "dml")
    assert float(local) == pytest.approx(0.5 * ce + 0.5 * kl_shared_to_local, rel=1e-12)
    assert float(mutual) == pytest.approx(0.3 * ce_shared + 0.7 * kl_local_to_shared, rel=1e-12)
    local, mutual = fml_losses(logits, shared, labels, 0.5, 0.3, "htfllib")  # KL ÷ C = 2
    assert float(local) == pytest.approx(0.5 * ce + 0.5 * kl_shared_to_local / 2, rel=1e-12)
    assert float(mutual) == pytest.approx(0.3 * ce_shared + 0.7 * kl_local_to_shared / 2, rel=1e-12)


def test_fml_dml_keeps_each_loss_on_its_own_model_and_htfllib_does_not():
    for mode, crosses in (("dml", False), ("htfllib", True)):
        logits, shared, labels = _pair()
        local, mutual = fml_losses(logits, shared, labels, 0.5, 0.5, mode)
        (into_shared,) = torch.autograd.grad(local, (shared,), retain_graph=True, allow_unused=True)
        (into_local,) = torch.autograd.grad(mutual, (logits,), allow_unused=True)
        for gradient in (into_shared, into_local):
            reached = gradient is not None and bool(gradient.abs().sum() > 0)
            assert reached == crosses, mode


def test_fedkd_values_by_hand():
    logits = torch.tensor([[LN3, 0.0]], dtype=torch.float64)  # p = (¾, ¼)
    shared = torch.tensor([[0.0, 0.0]], dtype=torch.float64)  # p_g = (½, ½)
    features = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    projected = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    ce, ce_shared = -math.log(0.75), math.log(2.0)
    scale = ce + ce_shared
    mse = (1.0 + 4.0) / 2  # mean over B·K = 2
    local, mentee = fedkd_losses(features, logits, shared, projected, torch.tensor([0]))
    assert float(local) == pytest.approx(ce + (KL_ROW0 / 2) / scale + mse / scale, rel=1e-12)
    assert float(mentee) == pytest.approx(ce_shared + (KL_ROW1 / 2) / scale + mse / scale, rel=1e-12)


def test_fedkd_gradient_flows_through_the_scale_and_the_kl_targets():
    """Autograd equals central differences of L + L_g: nothing (S, KL targets) is detached."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 4, generator=generator, dtype=torch.float64) for _ in range(2)] + \
        [torch.randn(3, 5, generator=generator, dtype=torch.float64) for _ in range(2)]
    labels = torch.tensor([0, 3, 1])

    def total(logits, shared, features, projected):
        local, mentee = fedkd_losses(features, logits, shared, projected, labels)
        return local + mentee

    leaves = [tensor.clone().requires_grad_(True) for tensor in inputs]
    gradients = torch.autograd.grad(total(*leaves), leaves)
    step = 1e-6
    for index, gradient in enumerate(gradients):
        for position in ((0, 0), (2, 1)):
            plus = [t.clone() for t in inputs]
            minus = [t.clone() for t in inputs]
            plus[index][position] += step
            minus[index][position] -= step
            numeric = (float(total(*plus)) - float(total(*minus))) / (2 * step)
            assert float(gradient[position]) == pytest.approx(numeric, rel=1e-5, abs=1e-8), (index, position)


def test_the_defaults_are_deep_mutual_learning():
    """kl_divergence defaults to the batch mean with a constant target, fml_losses to dml: the
    paper's forms; HtFLlib's are opt-in."""
    assert float(kl_divergence(TARGET, LOGITS)) == pytest.approx((KL_ROW0 + KL_ROW1) / 2, rel=1e-12)
    target = TARGET.clone().requires_grad_(True)
    (grad_target,) = torch.autograd.grad(kl_divergence(target, LOGITS.clone().requires_grad_(True)), (target,),
                                         allow_unused=True)
    assert grad_target is None
    logits = torch.tensor([[LN3, 0.0]], dtype=torch.float64)
    shared = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    by_default = fml_losses(logits, shared, torch.tensor([0]), 0.5, 0.3)
    dml = fml_losses(logits, shared, torch.tensor([0]), 0.5, 0.3, "dml")
    assert [float(v) for v in by_default] == [float(v) for v in dml]
