"""Buffered asynchronous aggregation on the simulated clock (``participation.mode=async``,
docs/asynchronous.md): FedBuff (Nguyen et al., AISTATS 2022) as FLSim runs it
(flsim/optimizers/async_aggregators.py ``HybridAggregator``@085aa75).

Real cross-device servers do not wait for a round: ``concurrency`` (C) clients are always
training, each started with the server's knowledge of that instant, and the server takes a step
whenever ``buffer`` (K) uploads have arrived. Here nobody waits either: the simulated clock
(``runtime.clock``) says when each client would finish, and :class:`BufferedSchedule` replays the
events, so one loop iteration is one server step (the metrics' "round" is the server version it
produces). Training is deferred to the arrival: a client is trained in the step its upload
arrives, with the knowledge of the version it started from, which rank 0 retains while a client
in flight refers to it and broadcasts again when it is needed. The numbers are therefore the same
on any world size, and a checkpoint holds the clients in flight and the versions they refer to.

The server step (:func:`server_step`): a class-mean server (FedProto, FedDistill: the sums-only
servers whose knowledge is class rows) mixes the staleness-weighted mean of the buffer into its
rows at rate η; a part-averaging server (LG-FedAvg's head, FML's and FedMRL's shared model) takes
FedBuff's step on the staleness-weighted deltas; every other server runs its own ``update`` on
the buffered uploads, without staleness weights (FedTGP trains on the buffer).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from htfl_dist.algorithms.blocks.model_part import PartAveragingServer
from htfl_dist.algorithms.class_rows import ClassMeanServer
from htfl_dist.algorithms.interface import ServerAlgorithm
from htfl_dist.algorithms.registry import sums_only
from htfl_dist.config import Config
from htfl_dist.config.participation_section import round_participants
from htfl_dist.errors import ConfigError
from htfl_dist.payload import Field, Payload
from htfl_dist.runtime.exchange import RoundTraffic
from htfl_dist.runtime.observers import RoundObserver
from htfl_dist.runtime.participation import Participation, client_devices, payload_bytes
from htfl_dist.runtime.records import RoundOutcome
from htfl_dist.seeding import numpy_rng

if TYPE_CHECKING:
    from htfl_dist.runtime.session import Session

PLAN_SPEC = (Field("starts", torch.int64, (2,)),)
"""The step's plan, rank 0 to every rank: (client, version it started from) per arrival."""


def staleness_weight(staleness: int, rule: str, exponent: float) -> float:
    """s(τ): 1/(1+τ)^a, a = ½ for inverse_sqrt (FedBuff §3), ``exponent`` for polynomial
    (FLSim's PolynomialStalenessWeight, with its avg_staleness normaliser left at raw weights),
    0 for constant."""
    power = {"inverse_sqrt": 0.5, "polynomial": exponent, "constant": 0.0}[rule]
    return 1.0 / (1.0 + staleness) ** power


@dataclass
class InFlight:
    """A client training now: when it started, from which server version, when it will finish
    (None until its start version's bytes are known: the clock needs its download)."""

    client: int
    started_s: float
    version: int
    count: int
    """Its how-many-th start (0-based): the clock's jitter stream is (seed, client, count)."""
    finish_s: float | None = None


@dataclass(frozen=True)
class Arrival:
    """An upload reaching the server."""

    client: int
    version: int
    staleness: int
    arrived_s: float
    stale: bool
    """More than ``max_staleness`` steps stale: dropped."""


@dataclass(frozen=True)
class StepPlan:
    """One server step: the uploads that arrive before it (in arrival order), its times."""

    version: int
    """The server version the uploads arrive at (the step makes version + 1)."""
    arrivals: tuple[Arrival, ...]
    began_s: float
    ended_s: float

    def starts(self) -> dict[int, int]:
        """The clients to train in this step and the version each started from."""
        return {a.client: a.version for a in self.arrivals}

    def row(self) -> dict[str, Any]:
        """The metrics row's keys for the step (docs/asynchronous.md)."""
        kept = [a.staleness for a in self.arrivals if not a.stale]
        histogram = [kept.count(tau) for tau in range(max(kept, default=-1) + 1)]
        return {"arrived_clients": len(kept), "aggregated_clients": sorted(a.client for a in self.arrivals
                                                                           if not a.stale),
                "stale_dropped_clients": sorted(a.client for a in self.arrivals if a.stale),
                "server_version": self.version + 1, "staleness_histogram": histogram,
                "staleness_max": max(kept, default=0),
                "staleness_mean": round(sum(kept) / len(kept), 6) if kept else 0.0,
                "sim_round_s": round(self.ended_s - self.began_s, 6), "sim_clock_s": round(self.ended_s, 6)}


class BufferedSchedule:
    """FedBuff's events, replayed: a pure function of (seed, the clients' seconds).

    At time 0, ``concurrency`` clients start with version 0. Each arrival (earliest finish first,
    ties by client id) is staleness τ = current version − its start version; unless it is the K-th
    accepted one, a client neither in flight nor waiting in the buffer starts at once with the
    current version (none: the step goes on with fewer in flight, and closes early when nobody is
    left). After the step, version + 1, and the in-flight set is topped up to C with the new
    version. ``seconds(client, count, version)`` is a client's simulated seconds for its
    ``count``-th start from ``version``; it is asked only once that version exists. ``draw(index,
    idle)`` picks the client that starts (default: uniformly from the (seed, draw index) stream)."""

    def __init__(self, seed: int, num_clients: int, concurrency: int, buffer: int, max_staleness: int | None,
                 seconds: Callable[[int, int, int], float],
                 draw: Callable[[int, list[int]], int] | None = None) -> None:
        self.num_clients, self.concurrency, self.buffer = num_clients, concurrency, buffer
        self.max_staleness = max_staleness
        self.seconds = seconds
        self.draw = draw or (lambda index, idle: idle[int(numpy_rng(seed, "async-start", index).integers(len(idle)))])
        self.now_s = 0.0
        self.version = 0
        self.in_flight: list[InFlight] = []
        self.counts = [0] * num_clients
        self.draws = 0
        self.started = False

    def plan_step(self) -> StepPlan:
        """The arrivals of the next server step; advances the clock and the version."""
        if not self.started:
            self._top_up(set())
            self.started = True
        began, arrivals, accepted, waiting = self.now_s, [], 0, set()
        while accepted < self.buffer and self.in_flight:
            for entry in self.in_flight:
                if entry.finish_s is None:
                    entry.finish_s = entry.started_s + self.seconds(entry.client, entry.count, entry.version)
            first = min(self.in_flight, key=lambda e: (e.finish_s, e.client))
            self.in_flight.remove(first)
            assert first.finish_s is not None
            self.now_s = first.finish_s
            staleness = self.version - first.version
            stale = self.max_staleness is not None and staleness > self.max_staleness
            arrivals.append(Arrival(first.client, first.version, staleness, self.now_s, stale))
            waiting.add(first.client)
            accepted += not stale
            if accepted < self.buffer:
                self._start(waiting)
        plan = StepPlan(self.version, tuple(arrivals), began, self.now_s)
        self.version += 1
        self._top_up(set())
        return plan

    def versions_in_flight(self) -> set[int]:
        return {entry.version for entry in self.in_flight}

    def _top_up(self, waiting: set[int]) -> None:
        while len(self.in_flight) < self.concurrency and self._start(waiting):
            pass

    def _start(self, waiting: set[int]) -> bool:
        """Start one client drawn from those idle (the (seed, draw) stream); False if none is."""
        busy = {entry.client for entry in self.in_flight} | waiting
        idle = [c for c in range(self.num_clients) if c not in busy]
        if not idle:
            return False
        client = self.draw(self.draws, idle)
        self.draws += 1
        self.in_flight.append(InFlight(client, self.now_s, self.version, self.counts[client]))
        self.counts[client] += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"now_s": self.now_s, "version": self.version, "counts": list(self.counts), "draws": self.draws,
                "started": self.started, "in_flight": [asdict(entry) for entry in self.in_flight]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.now_s, self.version, self.draws = float(state["now_s"]), int(state["version"]), int(state["draws"])
        self.counts, self.started = [int(c) for c in state["counts"]], bool(state["started"])
        self.in_flight = [InFlight(**entry) for entry in state["in_flight"]]


def mix_class_rows(previous: Payload, buffered: Payload, key: str, rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P ← (1−η)·P + η·P_buffer for the classes the buffer has; a class only the buffer has is
    taken as it is (nothing to mix with); a class absent from the buffer keeps its row.
    Returns (class_ids, rows) sorted by class."""
    rows = {int(c): r for c, r in zip(previous["class_ids"].tolist(), previous[key].double(), strict=True)}
    for c, row in zip(buffered["class_ids"].tolist(), buffered[key].double(), strict=True):
        rows[int(c)] = (1 - rate) * rows[int(c)] + rate * row if int(c) in rows else row
    ids = sorted(rows)
    width = previous[key].shape[1] if previous[key].dim() == 2 else buffered[key].shape[1]
    table = torch.stack([rows[c] for c in ids]).float() if ids else torch.empty(0, width)
    return torch.tensor(ids, dtype=torch.int64), table


def server_step(server: ServerAlgorithm, uploads: dict[int, Payload], weights: Mapping[int, float],
                started: Mapping[int, Payload], rate: float, round_index: int,
                generator: torch.Generator) -> dict[str, Any]:
    """One asynchronous server step on the buffered ``uploads`` (``weights``: s(τ) per client;
    ``started``: the knowledge each client started from). A class-mean server mixes the buffer's
    staleness-weighted means in (:func:`mix_class_rows`); a part-averaging server takes FedBuff's
    step on the deltas (:func:`fedbuff_part_step`); any other server, and a subclass of those
    two that rewrites ``update`` (not ``registry.sums_only``), runs its ``update``."""
    if not sums_only(type(server)):  # its update is its own (FedPCL's class means, FedTGP's training)
        return server.update(uploads, round_index, generator)
    if isinstance(server, ClassMeanServer):
        return _class_mean_step(server, uploads, weights, rate, round_index, generator)
    if isinstance(server, PartAveragingServer):
        return fedbuff_part_step(server, uploads, weights, started, rate)
    return server.update(uploads, round_index, generator)


def _class_mean_step(server: ClassMeanServer, uploads: dict[int, Payload], weights: Mapping[int, float],
                     rate: float, round_index: int, generator: torch.Generator) -> dict[str, Any]:
    """The buffer's means, each upload's contribution times s(τ) (summed in client order), mixed
    into the rows at rate η."""
    context = server.context
    sums: dict[str, torch.Tensor] = {}
    for client_id in sorted(uploads):
        for name, value in server.contribution(context, uploads[client_id]).items():
            sums[name] = sums.get(name, 0) + weights[client_id] * value
    previous = server.download()
    diagnostics = server.update_from_sums(sums, len(uploads), round_index, generator)
    server.class_ids, server.rows = mix_class_rows(previous, server.download(), server.key, rate)
    diagnostics["global_classes"] = float(server.class_ids.numel())
    return diagnostics


def fedbuff_part_step(server: PartAveragingServer, uploads: dict[int, Payload], weights: Mapping[int, float],
                      started: Mapping[int, Payload], rate: float) -> dict[str, Any]:
    """FedBuff's step (Algorithm 1) on an averaged part: w ← w + η·Σᵢ ωᵢ·s(τᵢ)·(uᵢ − w_{vᵢ}) / Σᵢ ωᵢ,
    ωᵢ the server's own averaging weight (1, or nᵢ when it weighs by samples): with ωᵢ = 1 the
    paper's Σ s(τᵢ)Δᵢ / K; at η = 1 with fresh uploads, the synchronous average."""
    name = server.part.name
    total: torch.Tensor | float = 0.0
    mass = 0.0
    for client_id in sorted(uploads):
        share = server.contribution(server.context, uploads[client_id])  # {part: ω·u, weight: ω}
        omega = share["weight"].double()
        start = started[client_id][name].double().cpu()
        total = total + weights[client_id] * (share[name] - omega * start)
        mass += float(omega.sum())
    previous = server.row
    server.set_row(previous.double() + rate * total / mass)
    return {f"{name}_uploads": len(uploads), f"{name}_change": float((server.row - previous).norm())}


def check_asynchronous(config: Config) -> None:
    """What buffered asynchronous aggregation cannot run with, one line each (the section checks
    its own keys): a sum of masked inputs has no single upload to weigh or leave out."""
    options = config.participation
    if options.mode != "async":
        return
    if config.privacy.secure_aggregation or config.runtime.presum_uploads:
        key = "privacy.secure_aggregation" if config.privacy.secure_aggregation else "runtime.presum_uploads"
        raise ConfigError(f"config key '{key}' sums a round's uploads; participation.mode=async weighs each "
                          f"upload by its staleness: use one or the other")
    if options.profile == "trace" and any(device.windows for device in client_devices(config)):
        raise ConfigError("config key 'participation.trace' gives availability windows; participation.mode=async "
                          "does not model them: drop the trace's 'available' column")
    if options.concurrency is not None and options.concurrency > config.num_clients:
        raise ConfigError(f"config key 'participation.concurrency' is {options.concurrency}, more than the "
                          f"{config.num_clients} clients (num_clients)")


class AsynchronousSteps(RoundObserver):
    """``participation.mode=async``: each loop iteration is one server step. Rank 0 holds the
    schedule and the knowledge versions clients in flight started from; every rank learns the
    step's plan and trains its arrivals with their versions (``train``)."""

    name = "asynchronous"

    def __init__(self, session: Session) -> None:
        config = session.config
        self.session = session
        options = config.participation
        self.options = options
        self.schedule: BufferedSchedule | None = None
        self.retained: dict[int, Payload] = {}
        self.version_bytes: dict[int, int] = {}
        self.plan: StepPlan | None = None
        if not session.is_server:
            return
        clock = Participation(config, session.partition, client_devices(config))
        concurrency = options.concurrency or round_participants(config.num_clients, config.join_ratio)

        def seconds(client: int, count: int, version: int) -> float:
            # down and up: the start version's download, its upload taken as the same size (docs)
            return clock.seconds(client, count, 2 * self.version_bytes[version])

        self.schedule = BufferedSchedule(config.seed, config.num_clients, concurrency, options.buffer,
                                         options.max_staleness, seconds)

    def step_starts(self, knowledge: Payload) -> dict[int, int]:
        """Every rank, with the current version's knowledge: the step's arrivals and the version
        each started from (rank 0 plans them and tells every rank)."""
        message = None
        if self.schedule is not None:
            version = self.schedule.version
            self.retained[version] = knowledge
            self.version_bytes[version] = payload_bytes(knowledge)
            self.plan = self.schedule.plan_step()
            message = {"starts": torch.tensor(sorted(self.plan.starts().items()), dtype=torch.int64).reshape(-1, 2)}
        starts = self.session.exchange.broadcast_knowledge(PLAN_SPEC, message, RoundTraffic())["starts"]
        return {int(client): int(version) for client, version in starts.tolist()}

    def knowledge_of(self, version: int, traffic: RoundTraffic) -> Payload:
        """Every rank: the knowledge of an earlier ``version``, broadcast again from rank 0's copy."""
        download = self.retained[version] if self.schedule is not None else None
        return self.session.exchange.broadcast_knowledge(self.session.download_spec, download, traffic)

    def arrivals(self, outcome: RoundOutcome, gathered: dict[int, Payload]) -> dict[int, Payload]:
        assert self.plan is not None, "rank 0 planned the step"
        outcome.participation = self.plan.row()
        stale = {a.client for a in self.plan.arrivals if a.stale}
        if stale:
            print(f"htfl_dist: warning: round {outcome.round_index + 1}: the uploads of client(s) {sorted(stale)} "
                  f"are more than participation.max_staleness={self.options.max_staleness} server steps stale; "
                  f"dropped", file=sys.stderr, flush=True)
        return {c: p for c, p in gathered.items() if c not in stale}

    def server_step(self, server: ServerAlgorithm, uploads: dict[int, Payload], round_index: int,
                    generator: torch.Generator) -> dict[str, Any]:
        """Rank 0: the step on the buffer (:func:`server_step`), with each arrival's s(τ) and the
        knowledge it started from."""
        assert self.plan is not None
        options = self.options
        weights = {a.client: staleness_weight(a.staleness, options.staleness, options.staleness_exponent)
                   for a in self.plan.arrivals}
        started = {a.client: self.retained[a.version] for a in self.plan.arrivals}
        return server_step(server, uploads, weights, started, options.server_rate, round_index, generator)

    def aggregated(self, outcome: RoundOutcome, kept: dict[int, Payload]) -> None:
        """Rank 0: forget the versions no client in flight refers to any more."""
        assert self.schedule is not None
        needed = self.schedule.versions_in_flight()
        self.retained = {v: p for v, p in self.retained.items() if v in needed}
        self.version_bytes = {v: b for v, b in self.version_bytes.items() if v in needed}

    def state_dict(self) -> dict[str, Any]:
        if self.schedule is None:
            return {}
        return {"schedule": self.schedule.state_dict(), "retained": {v: dict(p) for v, p in self.retained.items()},
                "version_bytes": dict(self.version_bytes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.schedule is None or not state:
            return
        self.schedule.load_state_dict(state["schedule"])
        self.retained = {int(v): dict(p) for v, p in state["retained"].items()}
        self.version_bytes = {int(v): int(b) for v, b in state["version_bytes"].items()}

