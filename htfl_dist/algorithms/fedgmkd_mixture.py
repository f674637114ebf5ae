"""FedGMKD's Cluster Knowledge Fusion prototype: a Gaussian mixture fitted to one class's features
by EM, and the mixture's weighted mean Σ_j π_j·μ_j (docs/algorithms.md, "FedGMKD").

The reference (SereinZY/FedGMKD@bd673b0, ``ClientFedGMKD.local_CKF_aggregation``) standardises
the class's features (scikit-learn's ``StandardScaler``), fits ``GaussianMixture`` with 1 to
min(n, 6) full-covariance components (``random_state=42``, the library's other defaults), keeps
the fit of lowest BIC and uploads Σ_j π_j·μ_j. scikit-learn is not a dependency here, so the EM
is written below in torch: diagonal covariances, the library's M-step (``reg_covar`` added to
every variance, 10·eps added to every component's mass), its stopping rule (the change of the
mean log-likelihood below ``tol``, but after at most ``algo.mixture_iterations`` = 10 iterations
where it allows 100) and its BIC; the initial means are distinct samples drawn
from a seeded generator (the library's ``init_params="random_from_data"``; its default is
k-means), so a fit depends only on (seed, client, round, class).

Why the choice of covariance and initialisation does not move the prototype: after any M-step,
Σ_j π_j·μ_j = Σ_j (N_j / Σ N)·(Σ_i r_ij·x_i / N_j) = Σ_i x_i·(Σ_j r_ij) / Σ N, the sample mean
(up to the 10·eps masses), whatever the mixture. ``mixture_prototype`` therefore returns the
class mean to float rounding, and in the reference, which never undoes the standardisation, the
prototype is the mean of standardised data: the zero vector (|·| ≈ 1e-16, measured with
scikit-learn 1.9.1). The fit is kept because it is the method; ``algo.prototype=mean`` skips it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REG_COVAR = 1e-6
"""Added to every variance after each M-step (scikit-learn ``GaussianMixture(reg_covar=1e-6)``)."""
MASS_FLOOR = 10 * torch.finfo(torch.float64).eps
"""Added to every component's responsibility mass (scikit-learn's ``nk = resp.sum(0) + 10 * eps``)."""


@dataclass(frozen=True)
class DiagonalMixture:
    """A fitted mixture: π [k], μ [k, D], σ² [k, D], and the mean log-likelihood of the data under it."""

    weights: torch.Tensor
    means: torch.Tensor
    variances: torch.Tensor
    mean_log_likelihood: float
    iterations: int

    def bic(self, samples: int) -> float:
        """−2·n·(mean log-likelihood) + p·ln n, p = k·D means + k·D variances + (k − 1) weights
        (scikit-learn's ``bic`` for ``covariance_type="diag"``)."""
        k, width = self.means.shape
        parameters = 2 * k * width + k - 1
        return -2.0 * samples * self.mean_log_likelihood + parameters * math.log(samples)

    @property
    def weighted_mean(self) -> torch.Tensor:
        """Σ_j π_j·μ_j [D]: the uploaded prototype."""
        return self.weights @ self.means


def log_joint(x: torch.Tensor, weights: torch.Tensor, means: torch.Tensor, variances: torch.Tensor,
              squares: torch.Tensor | None = None) -> torch.Tensor:
    """[n, k]: ln π_j + ln N(x_i | μ_j, diag σ²_j), the squared distances expanded into
    matrix products (no [n, k, D] tensor: a class holds thousands of 512-wide rows); ``squares``
    is x², passed by a caller that reuses it."""
    precision = 1.0 / variances
    squared = ((x * x if squares is None else squares) @ precision.t() - 2.0 * x @ (means * precision).t()
               + (means * means * precision).sum(dim=1))
    log_norm = torch.log(2 * math.pi * variances).sum(dim=1)
    return weights.log().unsqueeze(0) - 0.5 * (squared + log_norm.unsqueeze(0))


def maximisation(x: torch.Tensor, responsibilities: torch.Tensor, squares: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The M-step from responsibilities r [n, k]: N_j = Σ_i r_ij + 10·eps, π = N / ΣN,
    μ_j = Σ_i r_ij·x_i / N_j, σ²_j = Σ_i r_ij·x_i² / N_j − μ_j² + ``REG_COVAR`` (scikit-learn's
    ``_estimate_gaussian_covariances_diag``; the difference clamped at 0 against rounding)."""
    mass = (responsibilities.sum(dim=0) + MASS_FLOOR).unsqueeze(1)
    means = responsibilities.t() @ x / mass
    spread = (responsibilities.t() @ (x * x if squares is None else squares) / mass - means * means).clamp(min=0)
    return (mass / mass.sum()).squeeze(1), means, spread + REG_COVAR


def fit_diagonal_mixture(x: torch.Tensor, components: int, max_iterations: int, tolerance: float,
                         generator: torch.Generator) -> DiagonalMixture:
    """EM on ``x`` [n, D] (float64) with ``components`` ≤ n diagonal Gaussians; stops after the
    first iteration whose E-step mean log-likelihood moved by less than ``tolerance``, or after
    ``max_iterations``. Started as scikit-learn's ``init_params="random_from_data"``: the M-step
    of one distinct sample per component, so means at those samples, variances ``REG_COVAR`` and
    equal weights, and the first E-step assigns every sample to its nearest start."""
    count = x.shape[0]
    means = x[torch.randperm(count, generator=generator)[:components]].clone()
    variances = torch.full_like(means, REG_COVAR)
    weights = torch.full((components,), 1.0 / components, dtype=x.dtype)
    squares = x * x
    previous, done = -math.inf, 0
    while done < max_iterations:
        joint = log_joint(x, weights, means, variances, squares)
        normaliser = torch.logsumexp(joint, dim=1, keepdim=True)
        weights, means, variances = maximisation(x, (joint - normaliser).exp(), squares)
        done += 1
        current = float(normaliser.mean())
        if abs(current - previous) < tolerance:
            break
        previous = current
    final = float(torch.logsumexp(log_joint(x, weights, means, variances, squares), dim=1).mean())
    return DiagonalMixture(weights, means, variances, final, done)


def standardise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, centre, scale): z = (x − mean) / std per dimension (population std; a constant
    dimension keeps scale 1, as ``StandardScaler``)."""
    centre = x.mean(dim=0)
    scale = x.std(dim=0, unbiased=False)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x - centre) / scale, centre, scale


def best_mixture(z: torch.Tensor, max_components: int, max_iterations: int, tolerance: float,
                 generator: torch.Generator) -> DiagonalMixture:
    """The fit of lowest BIC over 1..min(n, ``max_components``) components (the first on a tie)."""
    fits = [fit_diagonal_mixture(z, k, max_iterations, tolerance, generator)
            for k in range(1, min(z.shape[0], max_components) + 1)]
    return min(fits, key=lambda fit: fit.bic(z.shape[0]))


def mixture_prototype(x: torch.Tensor, max_components: int, max_iterations: int, tolerance: float,
                      generator: torch.Generator, *, standardised: bool = False) -> tuple[torch.Tensor, int]:
    """(prototype [D], components chosen) of one class's features ``x`` [n, D]: the best
    mixture's Σ_j π_j·μ_j, fitted on the standardised features and mapped back to feature space;
    ``standardised``: left in the standardised space, as the reference uploads it. One sample is
    its own prototype (0 standardised), as the reference's ``len(features) < 2`` branch."""
    data = x.double()
    z, centre, scale = standardise(data)
    if data.shape[0] < 2:
        return (z[0] if standardised else data[0]), 1
    fit = best_mixture(z, max_components, max_iterations, tolerance, generator)
    prototype = fit.weighted_mean
    return (prototype if standardised else centre + scale * prototype), int(fit.means.shape[0])
