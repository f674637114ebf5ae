"""The public parts of secure aggregation (secure_aggregation.py): its config, the neighbour graph,
the messages between the clients and the server, and the checks every received message passes.

Messages are plain dataclasses of ints, bytes and numpy arrays, for a wire layer to pack. Nothing
a peer sends decides how much is allocated or looped over: every length is checked against the
config (its roster bound, vector length, key and share widths) before the contents are used, and a
message that fails raises ``ProtocolError`` naming the client it came from.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.privacy.secagg_crypto import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from htfl_dist.privacy.secagg_quant import MODULUS_BITS
from htfl_dist.privacy.secagg_shamir import SHARE_BYTES

SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES
"""An encrypted share's plaintext: the shares of the self-mask seed and of the masking private key.
The sender, receiver and round are not repeated inside: the AEAD authenticates them as associated
data (secagg_crypto.encrypt), so a share decrypts only where and when it was addressed."""
SHARE_CIPHERTEXT_BYTES = SHARE_PLAINTEXT_BYTES + TAG_BYTES
MAX_CLIENT_ID = 2 ** 63 - 1


class SecAggAbort(ProtocolError):
    """The round cannot complete securely (too few clients left to reconstruct what is needed):
    no sum is released, rather than one the threshold does not protect."""


@dataclass(frozen=True)
class SecAggConfig:
    """The public parameters of one secure aggregation, the same at every party.

    ``threshold`` (t): shares needed to reconstruct a client's secrets; the server learns nothing of
    a client's input unless it obtains t shares of both of its secrets, which honest clients never
    give. Against an active server Bonawitz et al. need t above half the share holders.
    ``neighbours`` (k): the degree of SecAgg+'s ring graph, even; None or ≥ n − 1 masks every pair
    (the original SecAgg). A client's secrets go to its k neighbours and itself, so t ≤ k + 1 and
    at most k + 1 − t of them may drop. Quantisation (secagg_quant.py): ``levels`` grid steps over
    [−clipping_range, clipping_range]; its defaults follow Flower's SecAgg+. ``max_clients`` bounds
    the roster, so that n·levels < 2^32 (the sum does not wrap).
    """

    threshold: int
    neighbours: int | None = None
    clipping_range: float = 8.0
    levels: int = 2 ** 22
    max_clients: int = 1023
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        if self.threshold < 2:
            raise ConfigError(f"secure aggregation's threshold must be at least 2, not {self.threshold}: "
                              "with one share a single neighbour could unmask a client alone")
        if self.neighbours is not None and (self.neighbours < 2 or self.neighbours % 2):
            raise ConfigError(f"the neighbour graph's degree must be even and at least 2, not {self.neighbours}")
        if self.neighbours is not None and self.threshold > self.neighbours + 1:
            raise ConfigError(f"threshold {self.threshold} exceeds the {self.neighbours + 1} holders of a "
                              "client's shares (its neighbours and itself)")
        if not (self.clipping_range > 0 and np.isfinite(self.clipping_range)):
            raise ConfigError(f"the clipping range must be positive and finite, not {self.clipping_range!r}")
        if not 1 <= self.levels < 2 ** MODULUS_BITS or self.max_clients < 2:
            raise ConfigError(f"levels {self.levels} or max_clients {self.max_clients} out of range")
        if self.max_clients * self.levels >= 2 ** MODULUS_BITS:
            raise ConfigError(f"the sum of {self.max_clients} inputs of {self.levels} levels would wrap modulo "
                              f"2^{MODULUS_BITS}: lower max_clients or levels")


def ring_order(client_ids: Iterable[int], round_index: int) -> list[int]:
    """The clients around the ring: sorted by a public hash of (round, id), so that the neighbours
    change from round to round while every party computes the same graph; nothing here is secret."""
    def place(client: int) -> tuple[bytes, int]:
        return hashlib.sha256(struct.pack(">qq", round_index, client)).digest(), client
    return sorted(set(client_ids), key=place)


def neighbour_graph(client_ids: Iterable[int], round_index: int, degree: int | None) -> dict[int, tuple[int, ...]]:
    """Each client's neighbours: the ``degree``/2 clients either side of it on the ring (a Harary
    graph, SecAgg+), or every other client when ``degree`` is None or reaches n − 1 (SecAgg)."""
    order = ring_order(client_ids, round_index)
    n = len(order)
    if degree is None or degree >= n - 1:
        return {client: tuple(sorted(set(order) - {client})) for client in order}
    half = degree // 2
    return {client: tuple(sorted({order[(i + step) % n] for step in range(-half, half + 1) if step}))
            for i, client in enumerate(order)}


def evaluation_points(client_ids: Iterable[int]) -> dict[int, int]:
    """The public Shamir point of each client's shares: its rank among the sorted ids, plus one."""
    return {client: rank + 1 for rank, client in enumerate(sorted(client_ids))}


@dataclass(frozen=True)
class KeyAdvertisement:
    """Stage 0, client → server → all: the client's two X25519 public keys (c: encryption, s: masking)."""

    client_id: int
    encryption_key: bytes
    masking_key: bytes


@dataclass(frozen=True)
class EncryptedShare:
    """Stage 1, client → server → one neighbour: the sender's shares for the receiver, encrypted and
    authenticated under their agreed key, so the server routing it can neither read nor alter it."""

    sender: int
    receiver: int
    nonce: bytes
    ciphertext: bytes


@dataclass(frozen=True)
class MaskedInput:
    """Stage 2, client → server: y_u = x_u + PRG(b_u) ± Σ PRG(s_uv) mod 2^32."""

    client_id: int
    masked: np.ndarray


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 3, server → survivors: who sent a masked input and who shared keys but did not."""

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class UnmaskingShares:
    """Stage 3, survivor → server: shares of survivors' self-mask seeds and of dropped clients'
    masking keys, keyed by the client they belong to; never both kinds for one client."""

    client_id: int
    seed_shares: dict[int, bytes] = field(default_factory=dict)
    key_shares: dict[int, bytes] = field(default_factory=dict)


def where(round_index: int, client: object) -> str:
    return f"secure aggregation, round {round_index}: client {client}"


def check_id(value: object, round_index: int, sender: object) -> int:
    """A client id (an int in 0 … 2^63 − 1), or ProtocolError naming who sent it."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_CLIENT_ID:
        raise ProtocolError(f"{where(round_index, sender)} sent an invalid client id {value!r}")
    return value


def check_bytes(value: object, length: int, what: str, round_index: int, sender: object) -> bytes:
    """``value`` if it is exactly ``length`` bytes, else ProtocolError naming who sent it."""
    if not isinstance(value, bytes) or len(value) != length:
        size = len(value) if isinstance(value, bytes) else type(value).__name__
        raise ProtocolError(f"{where(round_index, sender)} sent {what} of {size} bytes, expected {length}")
    return value


def check_ids(values: object, limit: int, what: str, round_index: int, sender: object) -> tuple[int, ...]:
    """A list of distinct client ids, no longer than ``limit`` (checked before reading any)."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ProtocolError(f"{where(round_index, sender)}: {what} is not a sequence of client ids")
    if len(values) > limit:
        raise ProtocolError(f"{where(round_index, sender)}: {what} lists {len(values)} clients, more than {limit}")
    ids = tuple(check_id(value, round_index, sender) for value in values)
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"{where(round_index, sender)}: {what} lists a client twice")
    return ids


def check_advertisement(ad: object, round_index: int) -> KeyAdvertisement:
    """A stage-0 message with a valid id and two 32-byte public keys."""
    if not isinstance(ad, KeyAdvertisement):
        raise ProtocolError(f"{where(round_index, '?')} sent a {type(ad).__name__}, not a KeyAdvertisement")
    check_id(ad.client_id, round_index, ad.client_id)
    check_bytes(ad.encryption_key, KEY_BYTES, "an encryption key", round_index, ad.client_id)
    check_bytes(ad.masking_key, KEY_BYTES, "a masking key", round_index, ad.client_id)
    return ad


def check_encrypted(share: object, round_index: int, sender: object) -> EncryptedShare:
    """A stage-1 message with valid ids and a nonce and ciphertext of the fixed widths."""
    if not isinstance(share, EncryptedShare):
        raise ProtocolError(f"{where(round_index, sender)} sent a {type(share).__name__}, not an EncryptedShare")
    check_id(share.sender, round_index, sender)
    check_id(share.receiver, round_index, sender)
    check_bytes(share.nonce, NONCE_BYTES, "a nonce", round_index, sender)
    check_bytes(share.ciphertext, SHARE_CIPHERTEXT_BYTES, "an encrypted share", round_index, sender)
    return share


def check_vector(value: object, length: int, round_index: int, sender: object) -> np.ndarray:
    """A uint32 vector of ``length`` entries (checked before any arithmetic touches it)."""
    if not isinstance(value, np.ndarray) or value.dtype != np.uint32 or value.shape != (length,):
        shape = (value.dtype, value.shape) if isinstance(value, np.ndarray) else type(value).__name__
        raise ProtocolError(f"{where(round_index, sender)} sent a vector {shape}, expected uint32 of {length}")
    return value
