"""Fixed-point encoding of float vectors for secure aggregation (secure_aggregation.py).

Masks are uniform in Z_{2^32}, so what a client masks must be an integer vector mod 2^32 whose sum
over clients does not wrap. A float in [−c, c] (values outside are clipped) maps onto the grid
of ``levels`` equal steps 2c/levels, the integers 0 … levels (as Flower's ``quantization_range``:
with an even number of steps 0.0 lies on the grid, at levels/2, so the many exact zeros of
prototypes and counts stay exact under deterministic rounding). The sum of n such vectors is at
most n·levels, which stays below 2^32 for n < 2^32/levels (1023 clients at the default 2^22), and
de-quantising the sum removes the n offsets of c.

Rounding onto the grid: stochastic by default (round up with probability equal to the fractional
part), which makes each quantised value an unbiased estimate of the clipped float, so the error of
a sum of many clients averages out instead of accumulating one-sided. Its coins come from the OS's
secure generator (expanded with ChaCha20): they are part of what a client sends, and a seeded
generator would let anyone holding the experiment seed strip them. Deterministic round-to-nearest
is an option. Flower's SecAgg+ (flwr.common.secure_aggregation.quantization) uses stochastic
rounding with numpy's global (non-cryptographic) generator, clipping range 8, a grid of 2^22 steps
and modulus 2^32, the defaults here too.
"""
from __future__ import annotations

import os

import numpy as np

from htfl_dist.privacy.secagg_crypto import prg_words

MODULUS_BITS = 32


def _step(clipping_range: float, levels: int) -> float:
    if not (clipping_range > 0 and np.isfinite(clipping_range)):
        raise ValueError(f"the clipping range must be a positive finite number, not {clipping_range!r}")
    if not 1 <= levels < 2 ** MODULUS_BITS:
        raise ValueError(f"levels must be between 1 and 2^{MODULUS_BITS} − 1, not {levels}")
    return 2.0 * clipping_range / levels


def secure_uniforms(count: int) -> np.ndarray:
    """``count`` float64 uniforms in [0, 1) with 53 secret bits each (a fresh OS key, ChaCha20)."""
    words = prg_words(os.urandom(32), 2 * count).astype(np.uint64)
    bits = ((words[0::2] << np.uint64(32)) | words[1::2]) >> np.uint64(11)
    return bits.astype(np.float64) * 2.0 ** -53


def quantize(x: np.ndarray, clipping_range: float, levels: int, *, stochastic: bool = True) -> np.ndarray:
    """``x`` (floats, any shape) clipped to [−c, c] and mapped to uint32 values in 0 … levels."""
    step = _step(clipping_range, levels)
    values = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError("a vector to aggregate securely has a non-finite entry")
    scaled = (np.clip(values, -clipping_range, clipping_range) + clipping_range) / step
    if stochastic:
        floor = np.floor(scaled)
        rounded = floor + (secure_uniforms(scaled.size).reshape(scaled.shape) < scaled - floor)
    else:
        rounded = np.floor(scaled + 0.5)
    return np.clip(rounded, 0, levels).astype(np.uint32)


def dequantize_sum(total: np.ndarray, count: int, clipping_range: float, levels: int) -> np.ndarray:
    """The float sum of ``count`` vectors from the (mod 2^32) sum of their quantisations: each
    quantised value is (x + c)/step, so the sum is total·step − count·c."""
    step = _step(clipping_range, levels)
    if count < 0 or count * levels >= 2 ** MODULUS_BITS:
        raise ValueError(f"the sum of {count} vectors of {levels} levels would wrap modulo 2^{MODULUS_BITS}")
    return np.asarray(total, dtype=np.uint32).astype(np.float64) * step - count * clipping_range
