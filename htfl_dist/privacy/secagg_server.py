"""The server's side of secure aggregation (secure_aggregation.py): it collects the keys, routes
the encrypted shares, sums the masked inputs and removes the masks it is allowed to reconstruct.

Its view of a client is the client's public keys, ciphertexts it cannot open, the masked input
(uniform in Z_{2^32}^d without the masks' seeds) and, in stage 3, t or more shares of exactly one
of the client's two secrets: the self-mask seed of a survivor (whose pairwise masks cancel in the
sum) or the masking key of a dropped client (whose input is not in the sum).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from htfl_dist.errors import ProtocolError
from htfl_dist.privacy import secagg_crypto as crypto
from htfl_dist.privacy.secagg_messages import (
    EncryptedShare,
    KeyAdvertisement,
    MaskedInput,
    SecAggAbort,
    SecAggConfig,
    UnmaskingShares,
    UnmaskRequest,
    check_advertisement,
    check_bytes,
    check_encrypted,
    check_id,
    check_vector,
    evaluation_points,
    neighbour_graph,
    where,
)
from htfl_dist.privacy.secagg_shamir import SHARE_BYTES, combine, share_value

_KEYS, _SHARES, _MASKED, _UNMASKING, _DONE = range(5)


class SecAggServer:
    """The server of one round. Call its methods stage by stage; each closing call (``roster``,
    ``shares_for`` the first time, ``unmask_request``, ``result``) ends the collection before it."""

    def __init__(self, vector_length: int, config: SecAggConfig, round_index: int = 0) -> None:
        self.vector_length, self.config, self.round_index = vector_length, config, round_index
        self._stage = _KEYS
        self.advertisements: dict[int, KeyAdvertisement] = {}
        self.shares: dict[int, list[EncryptedShare]] = {}  # by sender: stage 1's U1
        self.masked: dict[int, MaskedInput] = {}  # stage 2's U2
        self.unmasking: dict[int, UnmaskingShares] = {}
        self._neighbours: dict[int, tuple[int, ...]] = {}
        self._points: dict[int, int] = {}
        self._request: UnmaskRequest | None = None

    def _at(self, stage: int, what: str, client: object) -> None:
        if self._stage != stage:
            raise ProtocolError(f"{where(self.round_index, client)}: {what} arrived out of turn")

    def receive_advertisement(self, ad: KeyAdvertisement) -> None:
        """Stage 0: one client's public keys."""
        ad = check_advertisement(ad, self.round_index)
        self._at(_KEYS, "its keys", ad.client_id)
        if ad.client_id in self.advertisements or len(self.advertisements) >= self.config.max_clients:
            raise ProtocolError(f"{where(self.round_index, ad.client_id)} advertised twice or past "
                                f"max_clients={self.config.max_clients}")
        self.advertisements[ad.client_id] = ad

    def roster(self) -> tuple[KeyAdvertisement, ...]:
        """Ends stage 0: every client's keys, for each client's ``share_keys``."""
        if self._stage == _KEYS:
            if len(self.advertisements) < self.config.threshold:
                raise SecAggAbort(f"secure aggregation, round {self.round_index}: {len(self.advertisements)} "
                                  f"clients advertised keys, fewer than the threshold {self.config.threshold}")
            self._neighbours = neighbour_graph(self.advertisements, self.round_index, self.config.neighbours)
            self._points = evaluation_points(self.advertisements)
            self._stage = _SHARES
        return tuple(self.advertisements[u] for u in sorted(self.advertisements))

    def receive_shares(self, client_id: int, shares: Sequence[EncryptedShare]) -> None:
        """Stage 1: the encrypted shares a client sends, exactly one for each of its neighbours."""
        u = check_id(client_id, self.round_index, client_id)
        self._at(_SHARES, "its shares", u)
        if u not in self.advertisements or u in self.shares:
            raise ProtocolError(f"{where(self.round_index, u)} sent shares without keys, or twice")
        neighbours = self._neighbours[u]
        if not isinstance(shares, Sequence) or len(shares) != len(neighbours):
            raise ProtocolError(f"{where(self.round_index, u)} sent other than one share for each of its "
                                f"{len(neighbours)} neighbours")
        checked = [check_encrypted(share, self.round_index, u) for share in shares]
        if {s.sender for s in checked} != {u} or sorted(s.receiver for s in checked) != list(neighbours):
            raise ProtocolError(f"{where(self.round_index, u)} sent shares from or to the wrong clients")
        self.shares[u] = checked

    def shares_for(self, client_id: int) -> list[EncryptedShare]:
        """Ends stage 1 (the first call): the shares addressed to ``client_id``."""
        if self._stage == _SHARES:
            self._stage = _MASKED
        self._at(_MASKED, "a request for shares", client_id)
        return [share for sender in sorted(self.shares) for share in self.shares[sender] if share.receiver == client_id]

    def receive_masked_input(self, message: MaskedInput) -> None:
        """Stage 2: one client's masked vector."""
        u = check_id(getattr(message, "client_id", None), self.round_index, "?")
        if self._stage == _SHARES:
            self._stage = _MASKED
        self._at(_MASKED, "its masked input", u)
        if u not in self.shares or u in self.masked:
            raise ProtocolError(f"{where(self.round_index, u)} sent a masked input without sharing keys, or twice")
        check_vector(message.masked, self.vector_length, self.round_index, u)
        self.masked[u] = message

    def unmask_request(self) -> UnmaskRequest:
        """Ends stage 2: the survivors (sent a masked input) and the dropped (shared keys, did not)."""
        if self._stage == _MASKED:
            if len(self.masked) < self.config.threshold:
                raise SecAggAbort(f"secure aggregation, round {self.round_index}: only {len(self.masked)} clients "
                                  f"sent masked inputs, fewer than the threshold {self.config.threshold}")
            dropped = set(self.shares) - set(self.masked)
            self._request = UnmaskRequest(tuple(sorted(self.masked)), tuple(sorted(dropped)))
            self._stage = _UNMASKING
        self._at(_UNMASKING, "the unmasking request", "server")
        assert self._request is not None
        return self._request

    def _holders(self, owner: int) -> set[int]:
        return {*self._neighbours[owner], owner}

    def receive_unmasking(self, message: UnmaskingShares) -> None:
        """Stage 3: a survivor's shares, each for a client it holds shares of and of the kind asked."""
        u = check_id(getattr(message, "client_id", None), self.round_index, "?")
        self._at(_UNMASKING, "its unmasking shares", u)
        assert self._request is not None
        if u not in self.masked or u in self.unmasking:
            raise ProtocolError(f"{where(self.round_index, u)} sent unmasking shares unasked, or twice")
        for kind, owners in (("seed", self._request.survivors), ("key", self._request.dropped)):
            shares = message.seed_shares if kind == "seed" else message.key_shares
            if not isinstance(shares, dict) or len(shares) > len(self._neighbours[u]) + 1:
                raise ProtocolError(f"{where(self.round_index, u)} sent too many {kind} shares")
            for owner, share in shares.items():
                if owner not in owners or u not in self._holders(owner):
                    raise ProtocolError(f"{where(self.round_index, u)} sent a {kind} share of client {owner} "
                                        "it does not hold or was not asked for")
                try:
                    share_value(check_bytes(share, SHARE_BYTES, f"a {kind} share", self.round_index, u))
                except ValueError:
                    raise ProtocolError(f"{where(self.round_index, u)} sent a {kind} share of client {owner} "
                                        "that is not a field element") from None
        self.unmasking[u] = message

    def _reconstruct(self, owner: int, kind: str) -> bytes:
        shares = {self._points[u]: (m.seed_shares if kind == "seed" else m.key_shares)[owner]
                  for u, m in sorted(self.unmasking.items())
                  if owner in (m.seed_shares if kind == "seed" else m.key_shares)}
        if len(shares) < self.config.threshold:
            raise SecAggAbort(f"{where(self.round_index, owner)}: only {len(shares)} shares of its {kind} came back, "
                              f"fewer than the threshold {self.config.threshold}; the sum cannot be unmasked")
        try:
            return combine(shares, self.config.threshold)
        except ValueError as error:
            raise ProtocolError(f"{where(self.round_index, owner)}: its {kind} shares are inconsistent "
                                f"({error})") from None

    def result(self) -> np.ndarray:
        """Ends stage 3: Σ x_u over the survivors, mod 2^32 (uint32)."""
        self._at(_UNMASKING, "the result", "server")
        assert self._request is not None
        self._stage = _DONE
        total = np.zeros(self.vector_length, dtype=np.uint32)
        for u in self._request.survivors:
            total += self.masked[u].masked
            total -= crypto.prg_words(self._reconstruct(u, "seed"), self.vector_length)
        for v in self._request.dropped:
            partners = [u for u in self._neighbours[v] if u in self.masked]
            if not partners:
                continue
            key = crypto.private_key_from(self._reconstruct(v, "key"))
            if crypto.public_bytes(key) != self.advertisements[v].masking_key:
                raise ProtocolError(f"{where(self.round_index, v)}: its reconstructed masking key does not match "
                                    "the key it advertised (a holder sent a wrong share)")
            for u in partners:
                try:
                    seed = crypto.mask_seed(key, self.advertisements[u].masking_key, self.round_index, v, u)
                except crypto.AgreementFailed:
                    raise ProtocolError(f"{where(self.round_index, u)} advertised a low-order public key") from None
                mask = crypto.prg_words(seed, self.vector_length)
                # u added +mask for a partner above it and −mask for one below: take it back out
                if v > u:
                    total -= mask
                else:
                    total += mask
        return total
