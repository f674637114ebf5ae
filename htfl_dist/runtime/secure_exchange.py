"""The gather phase under ``privacy.secure_aggregation``: rank 0 learns the sum of the round's
contributions and nothing else of any one client (docs/privacy.md, "Secure aggregation").

Each rank turns its trained participants' uploads into their contributions (the server's
``contribution``, made here, on the client's rank), flattens them, clips every entry to
±``secagg_clip`` (counted) and quantises them; then the four stages of SecAgg+
(htfl_dist/privacy/secure_aggregation.py) run over the transport, rank 0 relaying as the
protocol's server: the public keys up and the roster down; the encrypted key shares up and, routed,
down (each rank keeps those addressed to its clients; the server can neither read nor alter them);
the masked inputs up; the unmasking request down and the shares that unmask up. Rank 0 then holds
the sum mod 2^32, which it de-quantises and splits back into the server's ``summed_fields``.

Every message is a declared payload (``wire``), bounded before rank 0 allocates: a rank speaks for
exactly its trained participants, a client sends at most one row of keys, a share row per holder,
one masked vector of the declared length. The protocol objects check the contents (ids, widths,
authentication) and name the client a bad message came from. Secrets come from the OS inside the
protocol objects; nothing here draws from the experiment's seed.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from htfl_dist.algorithms import AlgorithmContext, AlgorithmEntry
from htfl_dist.config import Config, PrivacyConfig
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.privacy import distributed
from htfl_dist.privacy.distributed import fill_unreleased, share_holders, threshold
from htfl_dist.privacy.noise import noise_source
from htfl_dist.privacy.secagg_crypto import KEY_BYTES, NONCE_BYTES
from htfl_dist.privacy.secagg_messages import (
    SHARE_CIPHERTEXT_BYTES,
    EncryptedShare,
    KeyAdvertisement,
    MaskedInput,
    SecAggAbort,
    SecAggConfig,
    UnmaskingShares,
)
from htfl_dist.privacy.secagg_quant import dequantize_sum, quantize
from htfl_dist.privacy.secagg_server import SecAggServer
from htfl_dist.privacy.secagg_shamir import SHARE_BYTES
from htfl_dist.privacy.secure_aggregation import SecAggClient
from htfl_dist.runtime.exchange import RoundTraffic, message_bounds
from htfl_dist.runtime.presum import SummedRound, require_sums_only
from htfl_dist.runtime.screening import unpack_rank_message
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.wire import BROADCAST_ENTRY, decode, encode

MAX_PARTICIPANTS = 1023
"""The most clients one secure sum takes: n·levels stays below 2^32 (``SecAggConfig.max_clients``)."""


def check_secure_aggregation(config: Config) -> None:
    """What ``privacy.secure_aggregation`` cannot run with, in one line each, before anything loads:
    a server that reads each client's upload, the simulated participation (its drop-outs and
    deadlines act on single uploads at rank 0), and a round too small to hide one client or too
    large for the 32-bit sum. Called only where it is on (``session._summing_possible``): this
    module needs the privacy extra."""
    from htfl_dist.runtime.clock import join_count

    require_sums_only(config, "privacy.secure_aggregation")
    if config.participation.late == "next_round":
        raise ConfigError("privacy.secure_aggregation cannot carry a late upload into the next round "
                          "(participation.late=next_round): a masked input belongs to its round's masks; use late=drop")
    smallest = join_count(config.seed, 0, config.num_clients, config.join_ratio, False)
    if smallest < 3:
        raise ConfigError(f"privacy.secure_aggregation needs at least 3 participants a round (the sum of two tells "
                          f"each the other's input); num_clients x join_ratio gives {smallest}")
    if config.num_clients > MAX_PARTICIPANTS and config.join_ratio * config.num_clients > MAX_PARTICIPANTS:
        raise ConfigError(f"privacy.secure_aggregation takes at most {MAX_PARTICIPANTS} participants a round "
                          f"(the 32-bit sum of {config.privacy.secagg_levels} levels); lower join_ratio")


def guaranteed_contributors(config: Config) -> int:
    """The fewest contributions any unmasked sum of the run may have: the threshold at the run's
    smallest round under the distributed noise split (its noise is calibrated for it,
    privacy/distributed.py), else the protocol's least threshold, 2."""
    privacy = config.privacy
    if not (privacy.enabled and privacy.secure_aggregation and privacy.noise_split == "distributed"):
        return 2
    return distributed.guaranteed_contributors(config.num_clients, config.join_ratio, privacy.secagg_neighbours,
                                               privacy.secagg_threshold)


def protocol_config(privacy: PrivacyConfig, participants: int) -> SecAggConfig:
    """The round's public parameters: the ring's degree (every pair when unset or when it reaches
    n − 1) and the threshold over a client's share holders."""
    degree = privacy.secagg_neighbours
    holders = share_holders(participants, degree)
    return SecAggConfig(threshold=threshold(holders, privacy.secagg_threshold),
                        neighbours=None if degree is None or degree >= participants - 1 else degree,
                        clipping_range=privacy.secagg_clip, levels=privacy.secagg_levels,
                        max_clients=MAX_PARTICIPANTS)


@dataclass(frozen=True)
class Layout:
    """Where each summed field sits in the flat vector."""

    fields: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def length(self) -> int:
        return sum(math.prod(shape) for _, shape in self.fields)

    def flatten(self, parts: Mapping[str, torch.Tensor]) -> np.ndarray:
        return np.concatenate([parts[name].detach().double().cpu().reshape(-1).numpy() for name, _ in self.fields])

    def split(self, vector: np.ndarray) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape in self.fields:
            size = math.prod(shape)
            out[name] = torch.from_numpy(vector[offset : offset + size].copy()).reshape(shape)
            offset += size
        return out


SEALED_BYTES = NONCE_BYTES + SHARE_CIPHERTEXT_BYTES
"""One encrypted share on the wire: its nonce, then its ciphertext and tag."""


def _specs(length: int, participants: int) -> dict[str, PayloadSpec]:
    """The payload of each stage; row bounds from the round's participant count."""
    n = participants
    return {
        "keys": (Field("keys", torch.uint8, (2 * KEY_BYTES,), max_rows=1),),
        "roster": (Field("ids", torch.int64, (), max_rows=n), Field("keys", torch.uint8, (2 * KEY_BYTES,), max_rows=n)),
        "shares": (Field("receivers", torch.int64, (), max_rows=n),
                   Field("sealed", torch.uint8, (SEALED_BYTES,), max_rows=n)),
        "routed": (Field("senders", torch.int64, (), max_rows=n * n),
                   Field("receivers", torch.int64, (), max_rows=n * n),
                   Field("sealed", torch.uint8, (SEALED_BYTES,), max_rows=n * n)),
        "masked": (Field("masked", torch.int32, (length,), max_rows=1),),
        "request": (Field("survivors", torch.int64, (), max_rows=n), Field("dropped", torch.int64, (), max_rows=n)),
        "unmask": (Field("seed_owners", torch.int64, (), max_rows=n),
                   Field("seed_shares", torch.uint8, (SHARE_BYTES,), max_rows=n),
                   Field("key_owners", torch.int64, (), max_rows=n),
                   Field("key_shares", torch.uint8, (SHARE_BYTES,), max_rows=n)),
    }


def _bytes_rows(values: Sequence[bytes], width: int) -> torch.Tensor:
    if not values:
        return torch.empty(0, width, dtype=torch.uint8)
    return torch.from_numpy(np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), width).copy())


def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


Arrivals = Callable[[dict[int, Payload]], dict[int, Payload]]
"""Rank 0: of the masked inputs received (``{client: {"masked": ...}}``), those that arrive."""


class SecureSums:
    """One rank's side of the secure sums of a run (``Session.secure_sums`` when on)."""

    def __init__(self, transport: Transport, entry: AlgorithmEntry, context: AlgorithmContext,
                 privacy: PrivacyConfig, describe_rank: Callable[[int], str], *, contributors: int = 2,
                 filler_std: float = 0.0) -> None:
        fields = entry.server.summed_fields(context)
        if fields is None:
            raise ValueError(f"{entry.name}'s server declares no summed fields")
        self.transport, self.entry, self.context, self.privacy = transport, entry, context, privacy
        self.layout = Layout(tuple(fields.items()))
        self.describe_rank = describe_rank
        self.contributors = contributors
        """t the release's noise was split for (``guaranteed_contributors``): a round whose own
        threshold is lower unmasks nothing, since its sum could carry less than the planned noise."""
        self.filler_std = filler_std
        """Under the distributed split, the noise of a contribution's unreleased class rows
        (``distributed.fill_unreleased``); 0: none."""

    def gather(self, uploads: dict[int, Payload], participants: list[int], trainers: Mapping[int, int],
               round_index: int, traffic: RoundTraffic, arrivals: Arrivals | None = None) -> SummedRound | None:
        """The round's sum on rank 0 (None on the other ranks). ``uploads``: this rank's trained
        participants' uploads. ``arrivals`` (rank 0): of the masked inputs received, those that
        reach the server this round (the simulated participation's drop-outs and deadlines); the
        others count as dropped, and the protocol removes their pairwise masks without learning
        their inputs. Fewer than the threshold left: no sum (``SummedRound.sums`` None)."""
        config = protocol_config(self.privacy, len(participants))
        if config.threshold < self.contributors:  # every rank decides alike (public counts); no protocol runs
            return None if self.transport.rank != 0 else SummedRound(None, 0, 0, self.contributors)
        round_ = _Round(self, config, round_index, traffic, participants, trainers, arrivals)
        clipped, vectors = 0, {}
        for cid in sorted(uploads):
            flat = self.layout.flatten(self._contribution(uploads[cid], cid, round_index))
            clipped += int(np.count_nonzero(np.abs(flat) > config.clipping_range))
            vectors[cid] = quantize(flat, config.clipping_range, config.levels, stochastic=True)
            round_.clients[cid] = SecAggClient(cid, self.layout.length, config, round_index)
        roster = round_.advertise()
        mine = round_.share(roster)
        survivors, dropped = round_.mask(vectors, mine)
        total = round_.unmask(survivors, dropped)
        if self.transport.rank != 0:
            return None
        if total is None:
            return SummedRound(None, 0, clipped, config.threshold)
        summed = dequantize_sum(total, len(survivors), config.clipping_range, config.levels)
        return SummedRound(self.layout.split(summed), len(survivors), clipped, config.threshold)

    def _contribution(self, upload: Payload, client_id: int, round_index: int) -> dict[str, torch.Tensor]:
        """The client's contribution, made on its rank; under the distributed split its unreleased
        rows noised from the release's source (secure, or the seeded stream of ``privacy.noise``)."""
        parts = self.entry.server.contribution(self.context, upload)
        if not self.filler_std:
            return parts
        source = noise_source(self.privacy.noise, self.context.seed, "filler", client_id, round_index, 0)
        return fill_unreleased(parts, self.filler_std, source)

    def _up(self, spec: PayloadSpec, entries: dict[int, Payload], expected: Mapping[int, list[int]],
            traffic: RoundTraffic) -> dict[int, Payload]:
        """Every rank's entries to rank 0, each rank holding exactly its trained participants."""
        bounds = message_bounds(self.transport, spec, lambda rank: len(expected[rank]))
        messages = self.transport.gather(encode(spec, entries), bounds)
        if messages is None:
            return {}
        merged: dict[int, Payload] = {}
        for rank, message in enumerate(messages):
            try:
                merged.update(unpack_rank_message(spec, message, expected[rank]))
            except ProtocolError as exc:
                raise ProtocolError(f"secure aggregation: {self.describe_rank(rank)} {exc}") from None
            traffic.up += message.nbytes
        return merged

    def _down(self, spec: PayloadSpec, entry: Payload | None, traffic: RoundTraffic) -> Payload:
        message = self.transport.broadcast(None if entry is None else encode(spec, {BROADCAST_ENTRY: entry}))
        traffic.down += message.nbytes * max(1, self.transport.world_size - 1)
        return decode(spec, message)[BROADCAST_ENTRY]


def _sealed_share(sender: int, receiver: int, sealed: bytes) -> EncryptedShare:
    return EncryptedShare(sender, receiver, sealed[:NONCE_BYTES], sealed[NONCE_BYTES:])


def _unmask_payload(answer: UnmaskingShares) -> Payload:
    seeds, keys = sorted(answer.seed_shares.items()), sorted(answer.key_shares.items())
    return {"seed_owners": _ids([owner for owner, _ in seeds]),
            "seed_shares": _bytes_rows([share for _, share in seeds], SHARE_BYTES),
            "key_owners": _ids([owner for owner, _ in keys]),
            "key_shares": _bytes_rows([share for _, share in keys], SHARE_BYTES)}


class _Round:
    """One secure sum's four stages on one rank (rank 0 also plays the protocol's server)."""

    def __init__(self, sums: SecureSums, config: SecAggConfig, round_index: int, traffic: RoundTraffic,
                 participants: list[int], trainers: Mapping[int, int], arrivals: Arrivals | None) -> None:
        self.sums, self.traffic, self.arrivals = sums, traffic, arrivals
        self.specs = _specs(sums.layout.length, len(participants))
        self.expected = {rank: sorted(cid for cid in participants if trainers[cid] == rank)
                         for rank in range(sums.transport.world_size)}
        self.clients: dict[int, SecAggClient] = {}
        self.server = SecAggServer(sums.layout.length, config, round_index) if sums.transport.rank == 0 else None

    def _up(self, stage: str, entries: dict[int, Payload]) -> dict[int, Payload]:
        return self.sums._up(self.specs[stage], entries, self.expected, self.traffic)

    def _down(self, stage: str, entry: Payload | None) -> Payload:
        return self.sums._down(self.specs[stage], entry, self.traffic)

    def advertise(self) -> list[KeyAdvertisement]:
        """Stage 0: the public keys up, the roster down."""
        ads = {cid: client.advertise() for cid, client in self.clients.items()}
        received = self._up("keys", {cid: {"keys": _bytes_rows([ad.encryption_key + ad.masking_key], 2 * KEY_BYTES)}
                                     for cid, ad in ads.items()})
        entry = None
        if self.server is not None:
            for cid, payload in received.items():
                row = payload["keys"][0].numpy().tobytes()
                self.server.receive_advertisement(KeyAdvertisement(cid, row[:KEY_BYTES], row[KEY_BYTES:]))
            roster = self.server.roster()
            entry = {"ids": _ids([ad.client_id for ad in roster]),
                     "keys": _bytes_rows([ad.encryption_key + ad.masking_key for ad in roster], 2 * KEY_BYTES)}
        down = self._down("roster", entry)
        keys = down["keys"].numpy()
        return [KeyAdvertisement(int(cid), keys[i, :KEY_BYTES].tobytes(), keys[i, KEY_BYTES:].tobytes())
                for i, cid in enumerate(down["ids"].tolist())]

    def share(self, roster: list[KeyAdvertisement]) -> dict[int, list[EncryptedShare]]:
        """Stage 1: each client's encrypted shares up; all of them routed down, each rank keeping
        those addressed to its clients (only the addressee can open one)."""
        sealed = {cid: client.share_keys(roster) for cid, client in self.clients.items()}
        received = self._up("shares", {cid: _share_rows(shares, sender=False) for cid, shares in sealed.items()})
        entry = None
        if self.server is not None:
            routed: list[EncryptedShare] = []
            for cid, payload in received.items():
                shares = [_sealed_share(cid, int(receiver), row.numpy().tobytes())
                          for receiver, row in zip(payload["receivers"].tolist(), payload["sealed"], strict=True)]
                self.server.receive_shares(cid, shares)
                routed.extend(shares)
            entry = _share_rows(routed, sender=True)
        down = self._down("routed", entry)
        mine: dict[int, list[EncryptedShare]] = {cid: [] for cid in self.clients}
        for sender, receiver, row in zip(down["senders"].tolist(), down["receivers"].tolist(), down["sealed"],
                                         strict=True):
            if receiver in mine:
                mine[receiver].append(_sealed_share(int(sender), int(receiver), row.numpy().tobytes()))
        return mine

    def mask(self, vectors: dict[int, np.ndarray], mine: dict[int, list[EncryptedShare]]
             ) -> tuple[list[int], list[int]]:
        """Stage 2: the masked inputs up; the unmasking request (survivors, dropped) down."""
        masked = {cid: client.masked_input(vectors[cid], mine[cid]) for cid, client in self.clients.items()}
        received = self._up("masked", {cid: {"masked": torch.from_numpy(m.masked.view(np.int32).copy())[None]}
                                       for cid, m in masked.items()})
        entry = None
        if self.server is not None:
            if self.arrivals is not None:
                received = self.arrivals(received)
            for cid, payload in sorted(received.items()):
                self.server.receive_masked_input(MaskedInput(cid, payload["masked"][0].numpy().view(np.uint32).copy()))
            try:
                request = self.server.unmask_request()
                entry = {"survivors": _ids(request.survivors), "dropped": _ids(request.dropped)}
            except SecAggAbort:  # too few arrived: every rank learns it from the empty request
                entry = {"survivors": _ids([]), "dropped": _ids([])}
        down = self._down("request", entry)
        return down["survivors"].tolist(), down["dropped"].tolist()

    def unmask(self, survivors: list[int], dropped: list[int]) -> np.ndarray | None:
        """Stage 3: the shares that unmask up; rank 0 returns the sum mod 2^32 (None: the round
        aborted). A client counted as dropped (its masked input arrived late) answers nothing: the
        others' shares of its masking key remove its pairwise masks, its self mask stays secret."""
        answers = {cid: client.unmask(survivors, dropped) if cid in survivors else UnmaskingShares(cid)
                   for cid, client in self.clients.items()}
        received = self._up("unmask", {cid: _unmask_payload(answer) for cid, answer in answers.items()})
        if self.server is None or not survivors:
            return None
        for cid, payload in received.items():
            if cid not in survivors:
                continue
            seeds = zip(payload["seed_owners"].tolist(), payload["seed_shares"], strict=True)
            keys = zip(payload["key_owners"].tolist(), payload["key_shares"], strict=True)
            self.server.receive_unmasking(UnmaskingShares(cid, {int(o): r.numpy().tobytes() for o, r in seeds},
                                                          {int(o): r.numpy().tobytes() for o, r in keys}))
        return self.server.result()


def _share_rows(shares: Sequence[EncryptedShare], *, sender: bool) -> Payload:
    rows = {"receivers": _ids([share.receiver for share in shares]),
            "sealed": _bytes_rows([share.nonce + share.ciphertext for share in shares], SEALED_BYTES)}
    return {"senders": _ids([share.sender for share in shares]), **rows} if sender else rows
