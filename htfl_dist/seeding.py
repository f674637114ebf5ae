"""Derive every random stream from (seed, client_id, round, purpose).

World-size invariance depends on no stream ever being keyed by rank or by the order in
which a rank happens to visit its clients, so all randomness goes through these helpers.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

_MASK63 = (1 << 63) - 1


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``keys`` (stable across runs and hosts)."""
    text = ":".join([str(int(seed))] + [str(k) for k in keys])
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU torch generator for the stream named by ``keys``."""
    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, *keys))
    return generator


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    """A numpy generator for the stream named by ``keys``."""
    return np.random.default_rng(derive_seed(seed, *keys))


def seed_global_torch(seed: int, *keys: int | str) -> None:
    """Seed torch's global RNG (CPU and every GPU) for code that draws from it implicitly,
    such as ``nn.Module`` initialisation and dropout."""
    torch.manual_seed(derive_seed(seed, *keys))
