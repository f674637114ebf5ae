"""Uploads summed where they are made (``runtime.presum_uploads``, issue 45 item 1): for a server
that needs only the sum of the round's contributions (``registry.sums_only``), each client rank
adds its own participants' contributions and rank 0 receives one message per rank instead of
every participant's upload (for FedAvg over a whole model: one model per rank, not one per client).

The sum must not depend on which rank holds which client (results are the same on any world
size), and float additions do depend on their order. So every contribution is written in fixed
point before it is added: each field's entries as int64 multiples of 2^(e − k), e the exponent of
the largest magnitude any participant holds in that field this round (every rank learns it in one
small exchange) and k = 62 − ⌈log₂ n⌉ for n participants, so n of them cannot overflow. Integer sums
are exact in any order; the precision is 2^−k of the field's largest entry (2^−52 at 1,000
participants: float64's). The numbers are therefore the same on any world size, and equal the
per-client path's up to float rounding (the per-client path sums in float64 in client order), so
this is an option, off by default.

What rank 0 gives up: it cannot screen one client's upload (``on_bad_upload``), the simulated
participation cannot drop single uploads at rank 0, and the server trusts each rank's sum (its shape
is declared and bounded; its values are a rank's arithmetic, as in an all-reduce).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from htfl_dist.algorithms import AlgorithmContext, AlgorithmEntry
from htfl_dist.config import Config
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.runtime.exchange import RoundTraffic, message_bounds
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.wire import BROADCAST_ENTRY, Encoded, decode, encode


@dataclass(frozen=True)
class SummedRound:
    """What rank 0 learns from a summed gather: the summed fields (None when nothing may be
    released: too few masked inputs arrived), over how many uploads, and for secure aggregation
    the entries clipped and the round's threshold."""

    sums: dict[str, torch.Tensor] | None
    uploaders: int
    clipped: int | None = None
    threshold: int = 0


FIXED_POINT_BITS = 62
"""Bits of an int64 a sum may use (one left for the sign)."""


def check_presum(config: Config) -> None:
    """What ``runtime.presum_uploads`` cannot run with, in one line each."""
    if not config.runtime.presum_uploads:
        return
    from htfl_dist.config import ParticipationConfig

    require_sums_only(config, "runtime.presum_uploads")
    if config.privacy.secure_aggregation:
        raise ConfigError("runtime.presum_uploads and privacy.secure_aggregation both sum the uploads; secure "
                          "aggregation already sends rank 0 nothing but the sum: leave runtime.presum_uploads off")
    if config.participation != ParticipationConfig(random_join=config.participation.random_join):
        raise ConfigError("runtime.presum_uploads runs without the simulated participation (participation.*): its "
                          "drop-outs and deadlines act on single uploads at rank 0, which receives sums")


def require_sums_only(config: Config, key: str) -> None:
    """The one refusal of a summed gather (``key``) for a server that reads each upload."""
    from htfl_dist.algorithms import algorithm_names, get_algorithm

    if not get_algorithm(config.algorithm).sums_only:
        able = [name for name in algorithm_names() if get_algorithm(name).sums_only]
        raise ConfigError(f"{key}: {config.algorithm}'s server reads each client's upload, not only their sum "
                          f"(it is not registry.sums_only); the sums-only algorithms are {', '.join(able)}")


def fraction_bits(participants: int) -> int:
    """k: the bits below the largest entry, so that ``participants`` sums fit in 62 bits."""
    return FIXED_POINT_BITS - max(1, math.ceil(math.log2(max(participants, 2))))


def add_fixed(total: torch.Tensor, values: torch.Tensor, exponent: int, bits: int) -> None:
    """``total +=`` ``values`` as int64 multiples of 2^(exponent − bits), rounded to nearest (ties
    to even): a function of the value alone, so every rank writes a client's contribution alike.
    A cache-sized chunk at a time through two preallocated buffers: the whole-tensor form allocated
    four 8-byte copies of every upload, and pre-summing 25 pfl CNNs a rank cost more than sending
    them. Float32 values are scaled in float32 where that is exact (:func:`_float32_exact`): no
    widening pass, and half the bytes through the scaling and the rounding."""
    flat, out = values.reshape(-1), total.view(-1)
    shift = bits - exponent
    dtype = torch.float32 if _float32_exact(flat.dtype, shift) else torch.float64
    scale = _powers_of_two(shift)
    size = min(_FIXED_CHUNK, flat.numel())
    scaled = torch.empty(size, dtype=dtype)
    fixed = torch.empty(size, dtype=torch.int64)
    for start in range(0, flat.numel(), _FIXED_CHUNK):
        end = min(start + _FIXED_CHUNK, flat.numel())
        chunk, source = scaled[: end - start], flat[start:end]
        if source.dtype != dtype:  # widened first: mul(out=) computes in its input's dtype
            source = chunk.copy_(source)
        for factor in scale:  # exact: a power of two, in range at every step
            source = torch.mul(source, factor, out=chunk)
        integers = fixed[: end - start]
        integers.copy_(chunk.round_())  # whole numbers below 2^62: converted exactly
        out[start:end].add_(integers)


def _float32_exact(dtype: torch.dtype, shift: int) -> bool:
    """A float32 value times 2^shift is exact in float32 for |shift| ≤ 100 (no overflow: the
    product is at most 2^bits ≤ 2^62; a product that falls below float32's normal range is far below
    ½ and rounds to 0 as its exact value would), and a subnormal input, which a flush-to-zero mode
    would read as 0, ends at most 2^(−26): 0 either way. So the float32 path writes what the
    float64 path writes, bit for bit (tests/runtime/test_presum.py compares the two)."""
    return dtype == torch.float32 and abs(shift) <= 100


def from_fixed(total: torch.Tensor, exponent: int, bits: int) -> torch.Tensor:
    """The float64 values of int64 multiples of 2^(exponent − bits) (exact where float64 holds them)."""
    values = total.double()
    for factor in _powers_of_two(exponent - bits):
        values.mul_(factor)
    return values


_FIXED_CHUNK = 1 << 15
"""Elements per chunk of :func:`add_fixed`: 256 KiB of float64 and of int64, in a core's L2."""


def _powers_of_two(shift: int) -> list[float]:
    """2^shift as factors that float64 holds (|exponent| ≤ 1000 each): 2^(bits − e) for an all-zero
    field (e = −1074) is 2^1130, which overflows to inf, and 0 · inf is NaN."""
    factors = []
    while abs(shift) > 1000:
        step = 1000 if shift > 0 else -1000
        factors.append(math.ldexp(1.0, step))
        shift -= step
    return [*factors, math.ldexp(1.0, shift)]


def finite_exponent(tensor: torch.Tensor) -> int | None:
    """e with max |entry| ≤ 2^e (the smallest such power; −1074 for an all-zero tensor), or None
    when an entry is NaN or ±Inf, in one pass over the tensor (``aminmax`` propagates NaN and
    allocates nothing: ``isfinite(t).all()`` then ``abs().max()`` took 7 ms a pfl CNN, on the
    critical path of every pre-summed round)."""
    if not tensor.numel():
        return -1074
    low, high = (float(value) for value in torch.aminmax(tensor))
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    peak = max(-low, high)
    return math.frexp(peak)[1] if peak > 0 else -1074


class PresummedUploads:
    """One rank's side of the pre-summed gather (``Session.summing`` under ``runtime.presum_uploads``)."""

    def __init__(self, transport: Transport, entry: AlgorithmEntry, context: AlgorithmContext,
                 describe_rank: Callable[[int], str]) -> None:
        fields = entry.server.summed_fields(context)
        if fields is None:
            raise ValueError(f"{entry.name}'s server declares no summed fields")
        self.transport, self.entry, self.context = transport, entry, context
        self.fields = dict(fields)
        self.describe_rank = describe_rank

    def gather(self, uploads: dict[int, Payload], participants: list[int], trainers: Mapping[int, int],
               round_index: int, traffic: RoundTraffic, arrivals: object = None) -> SummedRound | None:
        """Rank 0: the round's summed fields and how many uploads they sum; None elsewhere
        (``arrivals`` is not consulted: the start refuses the simulated participation)."""
        contributions = {cid: self.entry.server.contribution(self.context, uploads[cid]) for cid in sorted(uploads)}
        mine = dict.fromkeys(self.fields, -1074)
        for cid, parts in contributions.items():
            for name, tensor in parts.items():
                exponent = finite_exponent(tensor)
                if exponent is None:
                    raise ProtocolError(f"client {cid}'s contribution {name!r} holds NaN or Inf")
                mine[name] = max(mine[name], exponent)
        exponents = self._agree_exponents(mine, traffic)
        bits = fraction_bits(len(participants))
        local = {name: torch.zeros(shape, dtype=torch.int64) for name, shape in self.fields.items()}
        for parts in contributions.values():
            for name, tensor in parts.items():
                add_fixed(local[name], tensor, exponents[name], bits)
        spec = self._sum_spec()
        entry = {**{name: local[name].reshape(1, -1) for name in self.fields},
                 "uploaders": torch.tensor([len(contributions)], dtype=torch.int64)}
        training = {trainers[cid] for cid in participants}  # a rank that trained nobody sends no sum
        bounds = message_bounds(self.transport, spec, lambda rank: int(rank in training))
        messages = self.transport.gather(encode(spec, {self.transport.rank: entry} if contributions else {}), bounds)
        if messages is None:
            return None
        totals = {name: torch.zeros(shape, dtype=torch.int64) for name, shape in self.fields.items()}
        uploaders = 0
        for rank, message in enumerate(messages):
            traffic.up += message.nbytes
            received = self._one_entry(spec, message, rank, expected=rank in training)
            if received is None:
                continue
            for name, shape in self.fields.items():
                totals[name] += received[name].reshape(shape)  # each within n·2^k < 2^63: exact
            uploaders += int(received["uploaders"][0])
        expected = sum(1 for cid in participants if cid in trainers)
        if uploaders != expected:
            raise ProtocolError(f"the ranks' sums cover {uploaders} uploads, but {expected} clients took part")
        return SummedRound({name: from_fixed(total, exponents[name], bits) for name, total in totals.items()},
                           uploaders)

    def _sum_spec(self) -> PayloadSpec:
        return (*(Field(name, torch.int64, (math.prod(shape),), max_rows=1) for name, shape in self.fields.items()),
                Field("uploaders", torch.int64, (), max_rows=1))

    def _one_entry(self, spec: PayloadSpec, message: Encoded, rank: int, expected: bool = True) -> Payload | None:
        """The one entry ``rank`` sends (keyed by its rank), or None for a rank that trained nobody."""
        try:
            entries = decode(spec, message)
        except ProtocolError as exc:
            raise ProtocolError(f"{self.describe_rank(rank)} sent a malformed sum: {exc}") from None
        if sorted(entries) != ([rank] if expected else []):
            raise ProtocolError(f"{self.describe_rank(rank)} sent sums for {sorted(entries)}, expected "
                                f"{'its own' if expected else 'none (it trained nobody this round)'}")
        return entries.get(rank)

    def _exponents_of(self, spec: PayloadSpec, message: Encoded, rank: int) -> torch.Tensor:
        entry = self._one_entry(spec, message, rank)
        assert entry is not None
        return entry["exponents"][0]

    def _agree_exponents(self, mine: dict[str, int], traffic: RoundTraffic) -> dict[str, int]:
        """Every rank learns, per field, the largest exponent any participant's contribution has:
        each rank's own (``mine``, over its participants) up, their maximum down."""
        names = list(self.fields)
        spec: PayloadSpec = (Field("exponents", torch.int64, (len(names),), max_rows=1),)
        bounds = message_bounds(self.transport, spec, lambda rank: 1)
        local = torch.tensor([[mine[name] for name in names]])
        messages = self.transport.gather(encode(spec, {self.transport.rank: {"exponents": local}}), bounds)
        agreed = None
        if messages is not None:
            rows = [self._exponents_of(spec, message, rank) for rank, message in enumerate(messages)]
            peak = torch.stack(rows).max(dim=0).values
            if bool((peak > 1100).any()):
                raise ProtocolError("a rank reported an exponent beyond float64's range")
            agreed = encode(spec, {BROADCAST_ENTRY: {"exponents": peak[None]}})
        received = self.transport.broadcast(agreed)
        traffic.down += received.nbytes * max(0, self.transport.world_size - 1)
        values = decode(spec, received)[BROADCAST_ENTRY]["exponents"][0].tolist()
        return dict(zip(names, (int(v) for v in values), strict=True))
