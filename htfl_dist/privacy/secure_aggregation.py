"""Secure aggregation: the server learns the sum of the clients' vectors and nothing else of any
one of them (issue 48 item 3). SecAgg+ (Bell et al., CCS 2020) over SecAgg (Bonawitz et al.,
CCS 2017), as plain objects and messages; the wire exchange is another module's job.

Threat model: an honest-but-curious server, alone or with colluding clients that number fewer
than t among the share holders of every honest client, and clients dropping out at any stage. One
active deviation is refused: a request to unmask a client both ways (its self-mask seed and its
masking key), which would reveal its input. Not implemented: Bonawitz's signatures and
consistency-check round against a server that lies about who dropped to different clients. The
ring is a public function of the ids and the round (as Flower's, which rings the sorted ids), not
Bell et al.'s random graph drawn after corruption: whoever picks the colluders knowing the schedule
can surround a victim, so the guarantee is per neighbourhood, not Bell et al.'s probabilistic one.

The four stages (t: threshold; N(u): u's neighbours on the round's ring, secagg_messages.py):
0. advertise: each client draws two X25519 key pairs (c for encryption, s for masking) and a 32-byte
   self-mask seed b from the OS, and sends the public keys; the server broadcasts the roster.
1. share keys: each client Shamir-splits b and its masking private key among N(u) ∪ {u}
   (t-out-of-|N(u)| + 1, secagg_shamir.py) and sends each neighbour its shares encrypted under
   their agreed key (X25519, HKDF, ChaCha20-Poly1305; secagg_crypto.py), routed by the server.
2. masked input: y_u = x_u + PRG(b_u) + Σ_{v ∈ N(u), v > u} PRG(s_uv) − Σ_{v ∈ N(u), v < u} PRG(s_uv)
   mod 2^32, over the neighbours whose shares arrived; the pairwise masks cancel in the sum.
3. unmask: each survivor sends its shares of b for the clients that sent a masked input and of the
   masking key for those that shared keys but did not; the server removes the self masks and the
   dropped clients' uncancelled pairwise masks (secagg_server.py).

Everything secret (keys, seeds, Shamir coefficients, rounding coins) comes from the OS's secure
generator, never from the experiment seed; two runs of one config mask differently and sum alike.
The primitives come from PyCA's ``cryptography`` (audited, constant-time X25519 and AEAD over
OpenSSL), not hand-written code that would leak keys through timing (secagg_crypto.py).
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

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
    check_encrypted,
    check_ids,
    check_vector,
    evaluation_points,
    neighbour_graph,
    where,
)
from htfl_dist.privacy.secagg_quant import dequantize_sum, quantize
from htfl_dist.privacy.secagg_server import SecAggServer
from htfl_dist.privacy.secagg_shamir import SHARE_BYTES, split

__all__ = ["EncryptedShare", "KeyAdvertisement", "MaskedInput", "ProtocolRun", "SecAggAbort", "SecAggClient",
           "SecAggConfig", "SecAggServer", "UnmaskRequest", "UnmaskingShares", "run_protocol", "secure_sum"]

_ADVERTISE, _SHARE, _MASK, _UNMASK, _DONE = range(5)


class SecAggClient:
    """One client's side of one round. Each stage runs once, in order; the secrets never leave the
    object except as encrypted shares and, for the unmasking, the shares the protocol allows."""

    def __init__(self, client_id: int, vector_length: int, config: SecAggConfig, round_index: int = 0) -> None:
        self.client_id, self.vector_length = client_id, vector_length
        self.config, self.round_index = config, round_index
        self._encryption_key = crypto.new_private_key()
        self._masking_key = crypto.new_private_key()
        self._self_seed = secrets.token_bytes(crypto.KEY_BYTES)
        self._stage = _ADVERTISE
        self._roster: dict[int, KeyAdvertisement] = {}
        self._neighbours: tuple[int, ...] = ()
        self._held: dict[int, tuple[bytes, bytes]] = {}  # owner → (share of its b, share of its masking key)

    def _enter(self, stage: int, name: str) -> None:
        if self._stage != stage:
            raise ProtocolError(f"{where(self.round_index, self.client_id)} was asked to {name} out of turn")
        self._stage = stage + 1

    def advertise(self) -> KeyAdvertisement:
        """Stage 0: the two public keys."""
        self._enter(_ADVERTISE, "advertise its keys")
        return KeyAdvertisement(self.client_id, crypto.public_bytes(self._encryption_key),
                                crypto.public_bytes(self._masking_key))

    def share_keys(self, roster: Sequence[KeyAdvertisement]) -> list[EncryptedShare]:
        """Stage 1: check the roster, then shares of b and of the masking key for each neighbour,
        encrypted to it (this client keeps its own pair of shares)."""
        self._enter(_SHARE, "share its keys")
        config, here = self.config, where(self.round_index, self.client_id)
        if not isinstance(roster, Sequence) or len(roster) > config.max_clients:
            raise ProtocolError(f"{here}: the roster is not a list of at most {config.max_clients} clients")
        ads = {ad.client_id: ad for ad in (check_advertisement(ad, self.round_index) for ad in roster)}
        keys = [key for ad in ads.values() for key in (ad.encryption_key, ad.masking_key)]
        if len(ads) != len(roster) or len(set(keys)) != len(keys):
            raise ProtocolError(f"{here}: the roster repeats a client or a public key")
        if ads.get(self.client_id) != self.advertise_copy():
            raise ProtocolError(f"{here}: the roster does not hold this client's own keys")
        self._roster = ads
        self._neighbours = neighbour_graph(ads, self.round_index, config.neighbours)[self.client_id]
        holders = (*self._neighbours, self.client_id)
        if len(holders) < config.threshold:
            raise SecAggAbort(f"{here}: {len(holders)} holders of its shares, fewer than the threshold "
                              f"{config.threshold}")
        points = evaluation_points(ads)
        seed_shares = split(self._self_seed, [points[v] for v in holders], config.threshold)
        key_shares = split(crypto.private_bytes(self._masking_key), [points[v] for v in holders], config.threshold)
        self._held[self.client_id] = (seed_shares[points[self.client_id]], key_shares[points[self.client_id]])
        out = []
        for v in self._neighbours:
            plaintext = seed_shares[points[v]] + key_shares[points[v]]
            key = self._agree("encrypt", ads[v].encryption_key, v)
            nonce, ciphertext = crypto.encrypt(key, plaintext, self.round_index, self.client_id, v)
            out.append(EncryptedShare(self.client_id, v, nonce, ciphertext))
        return out

    def advertise_copy(self) -> KeyAdvertisement:
        """This client's stage-0 message again (what the roster must hold for it)."""
        return KeyAdvertisement(self.client_id, crypto.public_bytes(self._encryption_key),
                                crypto.public_bytes(self._masking_key))

    def _agree(self, purpose: str, peer_key: bytes, peer: int) -> bytes:
        """The key shared with ``peer`` for encrypting shares (purpose "encrypt", c keys) or its
        pairwise mask seed ("mask", s keys); ProtocolError naming the peer if its key is unusable."""
        try:
            if purpose == "encrypt":
                return crypto.encryption_key(self._encryption_key, peer_key, self.round_index, self.client_id, peer)
            return crypto.mask_seed(self._masking_key, peer_key, self.round_index, self.client_id, peer)
        except crypto.AgreementFailed:
            raise ProtocolError(f"{where(self.round_index, peer)} advertised a low-order public key") from None

    def masked_input(self, x_quantised: np.ndarray, shares_received: Sequence[EncryptedShare]) -> MaskedInput:
        """Stage 2: decrypt and keep the neighbours' shares, then mask the quantised input with the
        self mask and a pairwise mask for each neighbour whose shares arrived."""
        self._enter(_MASK, "mask its input")
        config, here = self.config, where(self.round_index, self.client_id)
        x = check_vector(x_quantised, self.vector_length, self.round_index, self.client_id)
        if x.size and int(x.max()) > config.levels:
            raise ValueError(f"{here}: a quantised input must lie in 0 … {config.levels}")
        if not isinstance(shares_received, Sequence) or len(shares_received) > len(self._neighbours):
            raise ProtocolError(f"{here} received more shares than it has neighbours ({len(self._neighbours)})")
        for share in shares_received:
            share = check_encrypted(share, self.round_index, getattr(share, "sender", "?"))
            v = share.sender
            if share.receiver != self.client_id or v not in self._neighbours or v in self._held:
                raise ProtocolError(f"{where(self.round_index, v)}: a share misrouted or repeated to client "
                                    f"{self.client_id}")
            key = self._agree("encrypt", self._roster[v].encryption_key, v)
            try:
                plain = crypto.decrypt(key, share.nonce, share.ciphertext, self.round_index, v, self.client_id)
            except crypto.DecryptionFailed:
                raise ProtocolError(f"{where(self.round_index, v)}: its share for client {self.client_id} "
                                    "failed authentication") from None
            self._held[v] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])  # its length was checked encrypted
        if len(self._held) < config.threshold:
            raise SecAggAbort(f"{here}: only {len(self._held) - 1} neighbours shared their keys; fewer than "
                              f"threshold {config.threshold} holders could not unmask it")
        masked = x + crypto.prg_words(self._self_seed, self.vector_length)
        for v in self._held:
            if v == self.client_id:
                continue
            mask = crypto.prg_words(self._agree("mask", self._roster[v].masking_key, v), self.vector_length)
            masked = masked + mask if v > self.client_id else masked - mask
        return MaskedInput(self.client_id, masked)

    def unmask(self, survivors: Sequence[int], dropped: Sequence[int]) -> UnmaskingShares:
        """Stage 3: shares of b for the survivors and of the masking key for the dropped, among the
        clients whose shares this client holds. Refuses a request naming a client in both lists
        (the server would get both secrets of it, hence its input), one that counts this client as
        dropped, or one with fewer than t survivors."""
        self._enter(_UNMASK, "unmask")
        config, here = self.config, where(self.round_index, self.client_id)
        alive = check_ids(survivors, config.max_clients, "the survivors", self.round_index, "server")
        gone = check_ids(dropped, config.max_clients, "the dropped clients", self.round_index, "server")
        both = set(alive) & set(gone)
        if both:
            raise ProtocolError(f"{here} refuses to unmask clients {sorted(both)} both ways (self-mask seed and "
                                "masking key): the server would learn their inputs")
        if self.client_id not in alive:
            raise ProtocolError(f"{here} sent its masked input but the server counts it as dropped")
        if len(alive) < config.threshold:
            raise SecAggAbort(f"{here}: only {len(alive)} survivors, fewer than the threshold {config.threshold}")
        reply = UnmaskingShares(self.client_id,
                                {v: self._held[v][0] for v in alive if v in self._held},
                                {v: self._held[v][1] for v in gone if v in self._held})
        self._held.clear()
        return reply


class ProtocolRun:
    """One whole round played in this process: the server (whose view the tests inspect), the
    clients, the survivors, and the unmasked sum (mod 2^32)."""

    def __init__(self, server: SecAggServer, clients: dict[int, SecAggClient], masked: dict[int, MaskedInput],
                 total: np.ndarray) -> None:
        self.server, self.clients, self.masked, self.total = server, clients, masked, total
        self.survivors = tuple(sorted(masked))


def run_protocol(quantised: Mapping[int, np.ndarray], config: SecAggConfig, *,
                 dropouts_after_advertise: Sequence[int] = (), dropouts_after_share: Sequence[int] = (),
                 dropouts_after_masking: Sequence[int] = (), round_index: int = 0) -> ProtocolRun:
    """All four stages between in-process parties: the clients in ``dropouts_after_advertise``
    vanish after stage 0, those in ``dropouts_after_share`` after stage 1, those in
    ``dropouts_after_masking`` after stage 2."""
    length = len(next(iter(quantised.values()))) if quantised else 0
    server = SecAggServer(length, config, round_index)
    clients = {u: SecAggClient(u, length, config, round_index) for u in quantised}
    for client in clients.values():
        server.receive_advertisement(client.advertise())
    roster = server.roster()
    sharing = [u for u in clients if u not in set(dropouts_after_advertise)]
    for u in sharing:
        server.receive_shares(u, clients[u].share_keys(roster))
    alive = [u for u in sharing if u not in set(dropouts_after_share)]
    masked = {u: clients[u].masked_input(quantised[u], server.shares_for(u)) for u in alive}
    for message in masked.values():
        server.receive_masked_input(message)
    request = server.unmask_request()
    for u in alive:
        if u not in set(dropouts_after_masking):
            server.receive_unmasking(clients[u].unmask(request.survivors, request.dropped))
    return ProtocolRun(server, clients, masked, server.result())


def secure_sum(vectors: Sequence[np.ndarray], config: SecAggConfig, *, dropouts_after_advertise: Sequence[int] = (),
               dropouts_after_share: Sequence[int] = (), dropouts_after_masking: Sequence[int] = (),
               round_index: int = 0) -> np.ndarray:
    """The float64 sum of the vectors (client u holds ``vectors[u]``) of the clients that sent a
    masked input, through the whole protocol: quantised, masked, unmasked and de-quantised."""
    quantised = {u: quantize(np.ravel(v), config.clipping_range, config.levels, stochastic=config.stochastic_rounding)
                 for u, v in enumerate(vectors)}
    run = run_protocol(quantised, config, dropouts_after_advertise=dropouts_after_advertise,
                       dropouts_after_share=dropouts_after_share,
                       dropouts_after_masking=dropouts_after_masking, round_index=round_index)
    return dequantize_sum(run.total, len(run.survivors), config.clipping_range, config.levels)
