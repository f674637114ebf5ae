"""Released class statistics under the Gaussian mechanism: per-sample clipping, class means of
the classes with enough samples, noise scaled to the mean's sensitivity.

Neighbouring datasets differ in one training sample's input, its label kept (docs/privacy.md):
the class counts n_c are then the same on both sides, and replacing one clipped row (norm at
most S) by another moves its class mean by at most 2·S / n_c and no other class's mean. The
rows of the different classes are disjoint in the data, so one release of every class row is
one Gaussian mechanism of noise multiplier σ when row c gets noise of standard deviation
σ · 2·S / n_c."""
from __future__ import annotations

import torch

from htfl_dist.privacy.noise import NoiseSource


def clip_rows(rows: torch.Tensor, clip: float) -> torch.Tensor:
    """Each row scaled to L2 norm at most ``clip`` (rows already inside are unchanged)."""
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    return rows * (clip / norms.clamp(min=clip))


def mean_sensitivity(clip: float, counts: torch.Tensor) -> torch.Tensor:
    """L2 sensitivity of the mean of ``counts`` rows clipped to ``clip`` when one row is
    replaced: 2·clip / n."""
    return 2.0 * clip / counts


def noisy_class_means(sums: torch.Tensor, counts: torch.Tensor, *, clip: float, noise_multiplier: float,
                      min_count: int, noise: NoiseSource, sensitivity: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The released rows: for every class with at least ``min_count`` samples, its mean (``sums``
    [C, D] of rows clipped to ``clip``, ``counts`` [C]) plus Gaussian noise of standard deviation
    ``noise_multiplier`` · 2·clip / n_c, or ``noise_multiplier`` · ``sensitivity`` when a bound
    shared by every client is given (the distributed split, distributed.py). The noise of every
    class is drawn, as one [C, D] block from ``noise`` (the release's own source), whichever
    classes are released, so what is drawn does not depend on the data. Returns (class ids int64
    [m], rows float32 [m, D]) on the CPU."""
    sums, counts = sums.detach().double().cpu(), counts.detach().double().cpu()
    draws = noise.standard_normal(sums.shape, dtype=torch.float64)
    released = torch.nonzero(counts >= min_count).flatten()
    n = counts[released].unsqueeze(1)
    means = sums[released] / n
    scale = noise_multiplier * (mean_sensitivity(clip, n) if sensitivity is None else sensitivity)
    return released, (means + scale * draws[released]).float()
