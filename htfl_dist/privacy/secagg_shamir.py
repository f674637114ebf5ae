"""Shamir secret sharing of 32-byte secrets, for secure aggregation (secure_aggregation.py).

Each SecAgg client splits its self-mask seed and its masking private key among its neighbours so
that the server can recover either one (never both) of a client from any ``t`` of them, and learns
nothing from fewer. The field is GF(p) with p = 2^521 − 1, a Mersenne prime: larger than any
32-byte secret (2^256), so a secret is one field element and sharing it is exact, and its shares
have a fixed width (66 bytes) that a receiver can check before parsing.

Security rests on the coefficients: the t − 1 non-constant ones are uniform in GF(p), drawn from the
OS's secure generator (``secrets``), never from an experiment seed. Then any t − 1 shares are
consistent with every secret (the tests construct the polynomial through them and any secret).
This is plain big-integer arithmetic with no secret-dependent branching beyond Python's own
integers; the shares travel encrypted (secagg_crypto.py) and are combined by the server only.
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

PRIME = 2 ** 521 - 1
"""The field's modulus (a Mersenne prime, > 2^256)."""

SECRET_BYTES = 32
SHARE_BYTES = (PRIME.bit_length() + 7) // 8
"""The width of one share's value on the wire (66 bytes, big-endian)."""


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """The polynomial Σ coefficients[i]·x^i mod p (Horner)."""
    value = 0
    for coefficient in reversed(coefficients):
        value = (value * x + coefficient) % PRIME
    return value


def split(secret: bytes, points: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Shares of ``secret`` (32 bytes) at the distinct non-zero evaluation ``points``: any
    ``threshold`` of them give the secret back, fewer give nothing. Returns point → share value."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes, not {len(secret)}")
    if not 1 <= threshold <= len(points):
        raise ValueError(f"threshold {threshold} must be between 1 and the number of shares {len(points)}")
    if len(set(points)) != len(points) or any(not 0 < x < PRIME for x in points):
        raise ValueError("the evaluation points must be distinct and non-zero")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x).to_bytes(SHARE_BYTES, "big") for x in points}


def share_value(share: bytes) -> int:
    """A share's field element, checked: exactly ``SHARE_BYTES`` bytes and below p."""
    if len(share) != SHARE_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes, not {len(share)}")
    value = int.from_bytes(share, "big")
    if value >= PRIME:
        raise ValueError("a share's value is not a field element")
    return value


def lagrange_at(points: Mapping[int, int], x: int) -> int:
    """The value at ``x`` of the unique polynomial of degree < len(points) through ``points``
    (x → y field elements): the combination step, and the tests' constructive proof that t − 1
    shares fit any secret."""
    total = 0
    for xi, yi in points.items():
        numerator, denominator = 1, 1
        for xj in points:
            if xj != xi:
                numerator = numerator * (x - xj) % PRIME
                denominator = denominator * (xi - xj) % PRIME
        total = (total + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    return total


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (point → share value). Fewer raise: with t − 1
    shares interpolation would return a field element unrelated to the secret, silently."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares cannot reconstruct a secret shared with threshold {threshold}")
    points = {x: share_value(share) for x, share in list(shares.items())[:threshold]}
    if any(not 0 < x < PRIME for x in points):
        raise ValueError("the evaluation points must be non-zero field elements")
    secret = lagrange_at(points, 0)
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise ValueError("the shares are inconsistent: they do not interpolate a 32-byte secret")
    return secret.to_bytes(SECRET_BYTES, "big")
