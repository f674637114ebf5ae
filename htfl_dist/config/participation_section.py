"""The ``participation`` config section (drop-out, slow clients, deadlines and random
participation on a simulated clock), a leaf like the rest of the schema: the runtime's clock
(``htfl_dist.runtime.clock``) reads it, and the experiment's identity compares against its
defaults without importing the whole schema."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from htfl_dist.config.rules import ADDED_LATER, bounded, declared
from htfl_dist.errors import ConfigError


def round_participants(num_clients: int, join_ratio: float) -> int:
    """int(N·ρ), at least one: the participants of a round (the fewest under ``random_join``),
    the one rule the clock, the asynchronous schedule's default concurrency and the secure
    aggregation threshold all read."""
    return max(1, int(num_clients * join_ratio))


def parse_tiers(text: str) -> list[tuple[float, float, float]]:
    """``SHARE:SPEED:MBPS,...`` as (share, speed, Mbit/s) triples: shares in (0, 1] summing to 1,
    speeds and bandwidths finite and positive; anything else one line naming the tier."""
    tiers = []
    for index, part in enumerate(text.split(",")):
        fields = part.strip().split(":")
        try:
            share, speed, mbps = (float(field) for field in fields)
        except ValueError:
            raise ConfigError(f"config key 'participation.tiers': tier {index + 1} is {part.strip()!r}; a tier is "
                              f"SHARE:SPEED:MBPS, e.g. 0.5:1:100") from None
        if not all(math.isfinite(v) and v > 0 for v in (share, speed, mbps)) or share > 1:
            raise ConfigError(f"config key 'participation.tiers': tier {index + 1} ({part.strip()}) needs a share in "
                              f"(0, 1] and a finite speed and bandwidth > 0")
        tiers.append((share, speed, mbps))
    if abs(sum(share for share, _, _ in tiers) - 1) > 1e-6:
        raise ConfigError(f"config key 'participation.tiers': the shares sum to "
                          f"{sum(share for share, _, _ in tiers):g}, not 1")
    return tiers


@dataclass
class ParticipationConfig:
    """Who of a round's participants is aggregated, on a simulated clock (docs/running.md,
    "Realistic federations"): HtFLlib's drop-out, slow clients, random participation and time
    threshold, without anyone sleeping. At its defaults every sampled client trains and is
    aggregated, and the section is not part of the experiment."""

    clock: bool = False
    """Simulate every participant's seconds per round (compute from its architecture's FLOPs and
    its device's speed, transfers from its bytes and bandwidth): rows get ``sim_round_s`` and
    ``sim_clock_s``. A deadline, slow clients or a trace need it."""
    profile: Literal["uniform", "tiers", "trace"] = "uniform"
    """uniform: every client at the reference speed and ``bandwidth_mbps``; tiers: shares of the
    clients at a speed and bandwidth each (``tiers``); both with HtFLlib's slow fractions on top;
    trace: speed, bandwidth and availability per client from ``trace``."""
    tiers: str | None = declared(None, identity=ADDED_LATER)
    """``SHARE:SPEED:MBPS,...`` (e.g. ``0.5:1:100,0.3:0.5:20,0.2:0.1:5``): the shares, summing to
    1, of the clients that get each speed factor and bandwidth; which clients from (seed)."""
    trace: str | None = None
    """CSV (``client,speed,bandwidth_mbps``) or JSON list of such objects, one per client."""
    reference_tflops: float = bounded(1.0, above=0, note="TFLOP/s of a speed-1 client")
    """Training FLOP/s (in TFLOP/s) of a client of speed 1."""
    bandwidth_mbps: float = bounded(100.0, above=0)
    """Link of every client under the uniform profile, Mbit/s, each way."""
    jitter: float = bounded(0.1, at_least=0, note="lognormal sigma")
    """Per-round variation of a client's compute time: a factor exp(σ·N(0, 1)) from (seed, client, round)."""
    train_slow_rate: float = bounded(0.0, at_least=0, at_most=1)
    """HtFLlib's -tsr: int(rate·N) draws (with replacement) of clients that lose U(0, 0.1) s per batch."""
    send_slow_rate: float = bounded(0.0, at_least=0, at_most=1)
    """HtFLlib's -ssr: the same for each transfer."""
    drop_rate: float = bounded(0.0, at_least=0, below=1)
    """HtFLlib's -cdr: of n participants, int((1 − rate)·n) uploads arrive; the others trained and are lost."""
    deadline_s: float = bounded(0.0, at_least=0, note="0 = none")
    """Simulated seconds after which the server stops waiting: later uploads are not aggregated
    (HtFLlib's -ts/-tth on the simulated clock). Needs ``clock``."""
    min_clients: int = bounded(0, at_least=0)
    """A round with fewer aggregated uploads than this skips the server step and says so."""
    random_join: bool = False
    """HtFLlib's -rjr: each round's participant count drawn from int(N·join_ratio)..N."""
    availability_period_s: float = bounded(0.0, identity=ADDED_LATER, at_least=0, note="0 = windows do not repeat")
    """The period after which a trace's availability windows (``available``) repeat, in simulated
    seconds (86400: a day); 0: they are absolute times."""
    late: Literal["drop", "next_round"] = declared("drop", identity=ADDED_LATER)
    """What becomes of an upload that misses ``deadline_s``: drop (lost, as HtFLlib's -tth);
    next_round: the server takes it in the next round, with that round's uploads, unless its
    client has a fresh one there (the metrics row says whose: ``late_folded_clients``); only for
    algorithms whose server aggregates uploads as they come."""
    mode: Literal["sync", "async"] = declared("sync", identity=ADDED_LATER)
    """sync: rounds, the server waits for its participants; async: buffered asynchronous
    aggregation on the simulated clock (FedBuff, Nguyen et al., AISTATS 2022; docs/asynchronous.md):
    ``concurrency`` clients always in flight, a server step whenever ``buffer`` uploads arrived."""
    concurrency: int | None = bounded(None, identity=ADDED_LATER, at_least=1, optional=True,
                                      note="default: a sync round's participants, int(N·join_ratio)")
    """Clients training at once (FedBuff's concurrency C). The default keeps a sync run's count
    busy, so sync and async compare at equal load (a choice of ours: the paper's C=1000 assumes
    a population of millions)."""
    buffer: int = bounded(10, identity=ADDED_LATER, at_least=1)
    """Uploads per server step (FedBuff's K; 10 is the paper's choice in its experiments, §5)."""
    staleness: Literal["inverse_sqrt", "constant", "polynomial"] = declared("inverse_sqrt", identity=ADDED_LATER)
    """Weight s(τ) of an upload τ server steps stale: 1/√(1+τ) (FedBuff's, §3), 1, or
    1/(1+τ)^staleness_exponent (FLSim's PolynomialStalenessWeight,
    flsim/utils/async_trainer/async_staleness_weights.py@085aa75)."""
    staleness_exponent: float = bounded(0.5, identity=ADDED_LATER, at_least=0, at_most=1,
                                        note="FLSim's PolynomialStalenessWeight asserts 0..1")
    """The exponent a of staleness=polynomial."""
    max_staleness: int | None = bounded(None, identity=ADDED_LATER, at_least=0, optional=True,
                                        note="default: no limit")
    """Uploads more than this many server steps stale are dropped (and counted in the row)."""
    server_rate: float = bounded(1.0, identity=ADDED_LATER, above=0, at_most=1)
    """η, the server's mixing rate: class means P ← (1−η)·P + η·P_buffer (1: the buffer's means,
    the synchronous class-mean server's step on the buffer)."""

    def check(self) -> None:
        self._check_mode()
        needs_clock = [name for name, on in (("deadline_s", self.deadline_s > 0),
                                             ("train_slow_rate", self.train_slow_rate > 0),
                                             ("send_slow_rate", self.send_slow_rate > 0),
                                             ("profile", self.profile != "uniform")) if on]
        if needs_clock and not self.clock:
            raise ConfigError(f"config key 'participation.{needs_clock[0]}' is "
                              f"{getattr(self, needs_clock[0])}, which acts on the simulated clock; "
                              f"set participation.clock=true")
        if self.late == "next_round" and self.deadline_s <= 0:
            raise ConfigError("config key 'participation.late' is next_round, but without participation.deadline_s "
                              "no upload is late; set a deadline or leave participation.late=drop")
        if (self.profile == "tiers") != bool(self.tiers):
            raise ConfigError("config key 'participation.tiers' gives the tiers of participation.profile=tiers; "
                              "set both or neither")
        if self.tiers:
            parse_tiers(self.tiers)
        if (self.profile == "trace") != bool(self.trace):
            raise ConfigError("config key 'participation.trace' names the trace file of participation.profile=trace; "
                              "set both or neither")

    def _check_mode(self) -> None:
        """async replaces rounds: what acts on a round's participants has no meaning there, and
        the async-only keys have none in sync mode; each refused in one line."""
        defaults = ParticipationConfig.__dataclass_fields__
        if self.mode == "sync":
            for name in ASYNC_KEYS:
                if getattr(self, name) != defaults[name].default:
                    raise ConfigError(f"config key 'participation.{name}' acts only in buffered asynchronous "
                                      f"aggregation; set participation.mode=async or leave it out")
            return
        if not self.clock:
            raise ConfigError("config key 'participation.mode' is async, which runs on the simulated clock; "
                              "set participation.clock=true")
        for name, on in (("deadline_s", self.deadline_s > 0), ("late", self.late != "drop"),
                         ("drop_rate", self.drop_rate > 0), ("min_clients", self.min_clients > 0),
                         ("random_join", self.random_join)):
            if on:
                raise ConfigError(f"config key 'participation.{name}' is {getattr(self, name)}, which acts on a "
                                  f"synchronous round; participation.mode=async has none: leave it out")
        if self.staleness != "polynomial" and self.staleness_exponent != 0.5:
            raise ConfigError(f"config key 'participation.staleness_exponent' is the exponent of "
                              f"participation.staleness=polynomial, not of {self.staleness}")


ASYNC_KEYS = ("concurrency", "buffer", "staleness", "staleness_exponent", "max_staleness", "server_rate")
"""The keys of buffered asynchronous aggregation (participation.mode=async)."""
