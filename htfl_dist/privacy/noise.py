"""Where a mechanism's Gaussian noise comes from (``privacy.noise``).

The guarantee holds against the server and the other clients only if none of them can know the
noise. Everything else of a run is a public function of the config (the seed travels in
config.yaml, and a seed of a few digits is found by trying them all), so the default source is
secret: every release takes a fresh 256-bit key and nonce from the operating system's
cryptographically secure generator (``os.urandom``) and expands them with ChaCha20 (RFC 8439,
PyCA's ``cryptography``), the construction the Linux kernel's own generator uses. The bits become
standard normals by the Box–Muller transform in float64 (53-bit uniforms, so the tails reach
8.5 standard deviations). Why not the alternatives: torchcsprng, which Opacus's ``secure_mode``
needs, has no build for current torch releases; a torch generator seeded from a secret leaves a
non-cryptographic stream (Mersenne Twister, Philox) whose state its outputs may give away; and
reading every bit from ``os.urandom`` (8 bytes a coordinate, one system call's worth of kernel
ChaCha20 each) is several times slower than expanding one key in process. The secret noise
costs more than torch's seeded ``randn`` all the same; bench/RESULTS.md has the figures.

``seeded`` keeps reproducible streams for experiments, keyed by (seed, mechanism, client, round,
release number) so that no two releases of a client share a draw. Anyone who has the seed can
regenerate them: such a run is not private against the server, and says so.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from htfl_dist.errors import ConfigError
from htfl_dist.seeding import derive_seed

NoiseMode = Literal["secure", "seeded"]

_MANTISSA_BITS = 53
_UNIT = 2.0 ** -_MANTISSA_BITS


class NoiseSource(Protocol):
    """Independent standard normal draws for one release of one client."""

    def standard_normal(self, shape: Sequence[int], *, dtype: torch.dtype = torch.float64,
                        device: torch.device | str = "cpu") -> torch.Tensor:
        ...


PRIVACY_EXTRA = "pip install 'htfl_dist[privacy]' (from a clone: pip install -e .[privacy])"
"""How to install what a private run needs (Opacus, and ``cryptography`` for the secret noise)."""


def require_cryptography(use: str, primitives: str) -> None:
    """One line, at start-up, where ``use`` (a setting and what it does) needs ``cryptography``
    (for ``primitives``) and it is not installed. It is the privacy extra's, and Opacus does not
    bring it: a run without such a setting starts without it, and one with it must not end in a
    traceback at its first step or round."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms  # noqa: F401
    except ImportError:
        raise ConfigError(f"{use} with the package 'cryptography' ({primitives}), which is not installed; install "
                          f"the privacy extra: {PRIVACY_EXTRA}") from None


def secure_bits(count: int) -> torch.Tensor:
    """``count`` int64 words of ChaCha20 keystream under a fresh key and nonce from ``os.urandom``."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms  # the privacy extra

    # cryptography's 16-byte ChaCha20 nonce is the 32-bit block counter (little-endian) followed by
    # the 96-bit nonce of RFC 8439: the counter starts at 0, so a draw has 2^32 blocks (256 GiB) of
    # keystream before it would wrap; a random counter could start next to the end and refuse.
    stream = Cipher(algorithms.ChaCha20(os.urandom(32), bytes(4) + os.urandom(12)), mode=None).encryptor()
    keystream = stream.update(bytes(8 * count)) + stream.finalize()
    if not count:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(keystream), dtype=torch.int64)


def secure_uniforms(count: int) -> torch.Tensor:
    """``count`` float64 uniforms in the open interval (0, 1), 53 secret bits each (the midpoints
    of a 2^-53 grid, so neither end is ever drawn and the logarithm stays finite)."""
    bits = (secure_bits(count) >> (64 - _MANTISSA_BITS)) & ((1 << _MANTISSA_BITS) - 1)
    return (bits.double() + 0.5) * _UNIT


def secure_standard_normal(count: int) -> torch.Tensor:
    """``count`` independent N(0, 1) float64 draws from the OS's secure source (Box–Muller: a
    pair of uniforms gives two independent normals, r·cos θ and r·sin θ)."""
    pairs = (count + 1) // 2
    uniforms = secure_uniforms(2 * pairs)
    radius = torch.sqrt(-2.0 * torch.log(uniforms[:pairs]))
    angle = (2.0 * math.pi) * uniforms[pairs:]
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]


class SecureNoise:
    """Noise no other party can reproduce (the default)."""

    def standard_normal(self, shape: Sequence[int], *, dtype: torch.dtype = torch.float64,
                        device: torch.device | str = "cpu") -> torch.Tensor:
        values = secure_standard_normal(math.prod(shape)).reshape(tuple(shape))
        return values.to(device=device, dtype=dtype)


class SeededNoise:
    """A reproducible stream keyed by ``key`` (one generator per device, each seeded alike)."""

    def __init__(self, key: int) -> None:
        self.key = key
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device | str) -> torch.Generator:
        name = str(torch.device(device))
        if name not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.key)
            self._generators[name] = generator
        return self._generators[name]

    def standard_normal(self, shape: Sequence[int], *, dtype: torch.dtype = torch.float64,
                        device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self._generator(device), dtype=dtype, device=device)


def seeded_noise_key(seed: int, mechanism: str, client_id: int, round_index: int, release: int) -> int:
    """The seed of a seeded release's stream: the run's seed, the mechanism, the client, the
    0-based round and the client's release number (mechanisms recorded before this one)."""
    return derive_seed(seed, "privacy", mechanism, client_id, round_index, release)


def noise_source(mode: NoiseMode, seed: int, mechanism: str, client_id: int, round_index: int,
                 release: int) -> NoiseSource:
    """The source of one release's noise under ``privacy.noise``."""
    if mode == "secure":
        return SecureNoise()
    return SeededNoise(seeded_noise_key(seed, mechanism, client_id, round_index, release))
