"""Distributed DP under secure aggregation (``privacy.noise_split=distributed``; docs/privacy.md,
"Distributed DP").

Under secure aggregation the server learns only the sum of a round's contributions, and only if at
least t of them arrived: t is the protocol's Shamir threshold (Bonawitz et al. 2017, "Practical
Secure Aggregation for Privacy-Preserving Machine Learning", §4: fewer than t shares reconstruct
nothing, and the server unmasks no sum of fewer than t masked inputs, ``SecAggServer``). So the
noise that protects one client's rows against the server need not all come from that client: if
each client adds Gaussian noise of variance σ²·B²/t, any released sum of m ≥ t contributions
carries variance m·σ²·B²/t ≥ σ²·B², the Gaussian mechanism of multiplier σ on the sum (Kairouz,
Liu & Steinke 2021, "The Distributed Discrete Gaussian Mechanism for Federated Learning with
Secure Aggregation", §1 and Algorithm 1: each client adds 1/n of the noise variance the central
mechanism needs, n replaced here by the guaranteed minimum t).

B must bound the sensitivity of *every* contributor's row, because each client's noise protects
the others' samples too: the local release's sensitivity 2·S/n_c (release.py) depends on the
client's own count, so the bound used is the largest a released row can have, 2·S/m with m =
``min_class_samples`` (no class with fewer samples is released). A client with n_c > m·√t adds
more noise per row than the local mode would; one with n_c < m·√t adds less.

The departure from Kairouz et al.: they add *discrete* Gaussian noise to integer (already
quantised) vectors, so that the sum of the clients' noise is close to a discrete Gaussian and the
guarantee holds exactly for what the server unmasks. Here each client adds *continuous* Gaussian
noise (the same secure source as the local mode, noise.py) to its float rows, and the result is
then quantised by secagg_quant.py (clipped to ±c, Flower's grid, stochastic rounding). The
analysis covers the unrounded sum; the unmasked sum differs from it by the clients' rounding
errors, zero-mean and each under one grid step (2c/levels, 3.8·10⁻⁶ at the defaults). That is the
simpler, documented departure; the clip (which would cut the Gaussian's tails and change the
mechanism) is kept away from the noise by :func:`check_clip_range`.

Every row of the sum, not only the held ones: a client releases (and noises) only its classes
with at least m samples, so a class held by h < t contributors would carry h/t of the variance.
Kairouz et al. noise the whole vector; so each contribution's rows of the classes it does not
release get the same per-client noise (:func:`fill_unreleased`, on the client's rank, before
quantisation), and every row of a sum of m ≥ t contributions carries m·σ²B²/t.
"""
from __future__ import annotations

import math

import torch

from htfl_dist.config.participation_section import round_participants
from htfl_dist.errors import ConfigError
from htfl_dist.privacy.noise import NoiseSource

MATERIAL_CLIPPED_SHARE = 1e-3
"""A share of clipped contribution entries above this refuses the run: the clip to ±c would cut
the Gaussian's tails often enough to change the mechanism (and bias the sum)."""


def threshold(holders: int, share: float) -> int:
    """t = ⌊share·holders⌋ + 1 (a strict majority at 0.5), at least 2 and at most ``holders``."""
    return max(2, min(holders, math.floor(share * holders) + 1))


def share_holders(participants: int, neighbours: int | None) -> int:
    """Who holds a client's shares: its ring neighbours and itself (SecAgg+), or every participant
    (SecAgg: every pair, also when the ring's degree reaches n − 1)."""
    every_pair = neighbours is None or neighbours >= participants - 1
    return participants if every_pair else neighbours + 1  # type: ignore[operator]


def smallest_round(num_clients: int, join_ratio: float) -> int:
    """The fewest participants a round has (a random join count is drawn from there up to N)."""
    return round_participants(num_clients, join_ratio)


def guaranteed_contributors(num_clients: int, join_ratio: float, neighbours: int | None, share: float) -> int:
    """t of the run: the protocol's threshold at its smallest round. t grows with the participants
    (the share holders do), so every released sum of the run has at least this many contributions;
    secure_exchange refuses to unmask a round whose own threshold would be lower."""
    return threshold(share_holders(smallest_round(num_clients, join_ratio), neighbours), share)


def sensitivity_bound(feature_clip: float, min_class_samples: int) -> float:
    """B = 2·S/m: the largest L2 sensitivity of any released class mean (release.mean_sensitivity
    at the smallest count that is released)."""
    return 2.0 * feature_clip / min_class_samples


def client_noise_multiplier(noise_multiplier: float, contributors: int) -> float:
    """Each client's share of the multiplier: σ/√t, so t clients' noise of std σ·B/√t sums to
    variance t·σ²B²/t = σ²B²."""
    return noise_multiplier / math.sqrt(contributors)


def clipped_share_bound(row_bound: float, noise_std: float, clip: float) -> float:
    """An upper bound on the share of contribution entries clipped to ±``clip``: an entry is a
    row entry of magnitude at most ``row_bound`` plus N(0, ``noise_std``²), so it leaves [−c, c]
    with probability at most P(|N| > c − row_bound) = erfc((c − row_bound)/(std·√2))."""
    if clip <= row_bound:
        return 1.0
    return math.erfc((clip - row_bound) / (noise_std * math.sqrt(2.0)))


def check_clip_range(row_bound: float, noise_std: float, clip: float) -> None:
    """One line refusing a ``secagg_clip`` that would cut a material share of the noised entries."""
    share = clipped_share_bound(row_bound, noise_std, clip)
    if share > MATERIAL_CLIPPED_SHARE:
        wanted = row_bound + 5.0 * noise_std  # erfc(5/√2) ≈ 5.7e-7
        raise ConfigError(f"privacy.secagg_clip={clip:g} would clip up to {share:.2%} of the distributed-noise entries "
                          f"(rows within ±{row_bound:g} plus noise of std {noise_std:.4g}), which changes the Gaussian "
                          f"mechanism; raise privacy.secagg_clip to at least {wanted:.4g}")


def fill_unreleased(parts: dict[str, torch.Tensor], std: float, noise: NoiseSource) -> dict[str, torch.Tensor]:
    """A class-row contribution (``ClassMeanServer.contribution``: Σ w·row ``row_sums`` [C, D] and
    Σ w ``weights`` [C]) with N(0, ``std``²) added to the rows of the classes it does not release
    (weight 0), whose row is otherwise an exact 0: the released rows carry their own noise from
    the release. The weights stay exact (which classes a client holds is public, docs/privacy.md)."""
    if set(parts) != {"row_sums", "weights"}:
        raise ValueError(f"the distributed noise split fills class-row contributions, not fields {sorted(parts)}")
    rows, weights = parts["row_sums"], parts["weights"]
    draws = noise.standard_normal(rows.shape, dtype=torch.float64).to(rows.dtype)
    unreleased = (weights == 0).to(rows.dtype)[:, None]
    return {"row_sums": rows + std * draws * unreleased, "weights": weights}
