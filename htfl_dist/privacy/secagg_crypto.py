"""The cryptographic primitives of secure aggregation (secure_aggregation.py), all from PyCA's
``cryptography`` (the privacy extra): X25519 key agreement, HKDF-SHA256 key derivation,
ChaCha20-Poly1305 authenticated encryption, and the ChaCha20 keystream as the mask generator.

Why a library rather than code of our own: these are audited implementations (OpenSSL underneath)
with constant-time scalar multiplication and tag comparison; a hand-written X25519 or AEAD in
Python would leak its keys through timing and would be the least reviewed code of the protocol.
Every secret is drawn by the library's key generation or ``os.urandom``, never from the experiment
seed (htfl_dist/seeding.py), which travels in config.yaml and is public.

Flower's SecAgg+ expands mask seeds with numpy's Mersenne Twister seeded with 32 bits folded from
the seed, which a server can search exhaustively; here a 32-byte seed keys ChaCha20 (RFC 8439),
a cryptographic generator, so a mask is indistinguishable from uniform without its seed.
"""
from __future__ import annotations

import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
"""X25519 public and private keys, mask seeds and derived keys are all 32 bytes."""
NONCE_BYTES = 12
TAG_BYTES = 16

_ENCRYPTION_INFO = b"htfl_dist secagg share encryption v1"
_MASK_INFO = b"htfl_dist secagg pairwise mask v1"


class AgreementFailed(ValueError):
    """A peer's public key gave the all-zero shared secret (a low-order point)."""


class DecryptionFailed(ValueError):
    """An encrypted share failed authentication: altered, misrouted, or under another key."""


def new_private_key() -> X25519PrivateKey:
    """A fresh X25519 private key from the OS's secure generator (the library's key generation)."""
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def private_key_from(raw: bytes) -> X25519PrivateKey:
    """A private key from its 32 raw bytes (a masking key the server reconstructed)."""
    return X25519PrivateKey.from_private_bytes(raw)


def _pair_info(label: bytes, round_index: int, a: int, b: int) -> bytes:
    low, high = min(a, b), max(a, b)
    return label + struct.pack(">qqq", round_index, low, high)


def agree(private: X25519PrivateKey, peer_public: bytes, label: bytes, round_index: int, a: int, b: int) -> bytes:
    """A 32-byte key shared by clients ``a`` and ``b``: HKDF-SHA256 of their X25519 secret, bound to
    the purpose, the round and the (unordered) pair so that no key serves two uses."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:  # a low-order point: the library refuses the all-zero secret
        raise AgreementFailed(str(error)) from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=_pair_info(label, round_index, a, b)).derive(shared)


def encryption_key(private: X25519PrivateKey, peer_public: bytes, round_index: int, a: int, b: int) -> bytes:
    """The key under which ``a`` and ``b`` encrypt the shares they send each other."""
    return agree(private, peer_public, _ENCRYPTION_INFO, round_index, a, b)


def mask_seed(private: X25519PrivateKey, peer_public: bytes, round_index: int, a: int, b: int) -> bytes:
    """The seed s_ab of the pairwise mask of ``a`` and ``b`` (the same from either side)."""
    return agree(private, peer_public, _MASK_INFO, round_index, a, b)


def _associated(round_index: int, sender: int, receiver: int) -> bytes:
    return struct.pack(">qqq", round_index, sender, receiver)


def encrypt(key: bytes, plaintext: bytes, round_index: int, sender: int, receiver: int) -> tuple[bytes, bytes]:
    """(nonce, ciphertext) of ``plaintext`` under ``key``, authenticating the round, sender and
    receiver too: the server routing it cannot replay it in another round or to another client."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce, ChaCha20Poly1305(key).encrypt(nonce, plaintext, _associated(round_index, sender, receiver))


def decrypt(key: bytes, nonce: bytes, ciphertext: bytes, round_index: int, sender: int, receiver: int) -> bytes:
    """The plaintext of :func:`encrypt`, or :class:`DecryptionFailed` if anything was altered."""
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, ciphertext, _associated(round_index, sender, receiver))
    except InvalidTag:
        raise DecryptionFailed("the share failed authentication") from None


def prg_words(seed: bytes, count: int) -> np.ndarray:
    """``count`` uint32 words of ChaCha20 keystream under ``seed`` (32 bytes; the counter and
    nonce start at zero: a seed expands to one mask only)."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"a mask seed is {KEY_BYTES} bytes, not {len(seed)}")
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    keystream = stream.update(bytes(4 * count)) + stream.finalize()
    return np.frombuffer(keystream, dtype="<u4").astype(np.uint32)
