"""Distillation losses of the mutual-learning baselines (FML, FedKD).

Small pure functions of logits and features: no modules, no options objects. Notation: p =
softmax(z) of the local model M_i, p_g = softmax(z_g) of the shared model G_i, K the feature
width, C the number of classes, B the batch size.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

KLReduction = Literal["batchmean", "mean_all"]
MutualKD = Literal["dml", "htfllib"]


def kl_divergence(target_logits: torch.Tensor, logits: torch.Tensor, reduction: KLReduction = "batchmean",
                  detach_target: bool = True) -> torch.Tensor:
    """KL(q ‖ p) = Σ_k q_k (log q_k − log p_k) with q = softmax(target_logits), p = softmax(logits).

    ``batchmean``: the sum over classes, averaged over the batch (the KL of deep mutual learning,
    FML paper Eq. 1–2). ``mean_all``: the average over all B·C elements, i.e. batchmean / C (what
    ``nn.KLDivLoss()`` with its default ``reduction='mean'`` computes, HtFLlib FML/FedKD).
    ``detach_target``: q is a constant (DML); otherwise gradients also flow into the target.
    """
    if detach_target:
        target_logits = target_logits.detach()
    log_q = F.log_softmax(target_logits, dim=1)
    log_p = F.log_softmax(logits, dim=1)
    total = F.kl_div(log_p, log_q, reduction="sum", log_target=True)
    return total / (logits.shape[0] if reduction == "batchmean" else logits.numel())


def fml_losses(logits: torch.Tensor, shared_logits: torch.Tensor, labels: torch.Tensor, alpha: float,
               beta: float, mode: MutualKD = "dml") -> tuple[torch.Tensor, torch.Tensor]:
    """FML's pair of objectives (Shen et al. 2020 Eq. 1–2):

        L   = α·CE(z, y)   + (1−α)·KL(p_g ‖ p)
        L_g = β·CE(z_g, y) + (1−β)·KL(p ‖ p_g)

    ``dml``: each KL target is a constant and KL is the batch mean (so ∇(L + L_g) gives M_i the
    gradient of L only and G_i that of L_g). ``htfllib``: KL averaged over B·C and targets not
    detached (both models receive both KL directions when L + L_g is differentiated).
    """
    reduction: KLReduction = "batchmean" if mode == "dml" else "mean_all"
    detach = mode == "dml"
    local = alpha * F.cross_entropy(logits, labels) + \
        (1 - alpha) * kl_divergence(shared_logits, logits, reduction, detach)
    shared = beta * F.cross_entropy(shared_logits, labels) + \
        (1 - beta) * kl_divergence(logits, shared_logits, reduction, detach)
    return local, shared


def fedkd_losses(features: torch.Tensor, logits: torch.Tensor, shared_logits: torch.Tensor,
                 projected_shared_features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FedKD's mentor and mentee objectives (official ``model_bert.py``, HtFLlib ``clientkd``):

        S   = CE(z, y) + CE(z_g, y)
        L   = CE(z, y)   + KL(p_g ‖ p)/S + MSE(r, W_h r_g)/S
        L_g = CE(z_g, y) + KL(p ‖ p_g)/S + MSE(r, W_h r_g)/S      (the hidden loss appears twice)

    with r = ``features`` (the mentor's), ``projected_shared_features`` = W_h r_g (r_g the mentee's),
    KL averaged over B·C with targets not detached, MSE averaged over B·K, S not detached. Both are
    differentiated together (one backward of L + L_g).
    """
    ce = F.cross_entropy(logits, labels)
    ce_shared = F.cross_entropy(shared_logits, labels)
    scale = ce + ce_shared  # S, deliberately not detached
    hidden = F.mse_loss(features, projected_shared_features)
    local = ce + kl_divergence(shared_logits, logits, "mean_all", False) / scale + hidden / scale
    shared = ce_shared + kl_divergence(logits, shared_logits, "mean_all", False) / scale + hidden / scale
    return local, shared
