"""Rank 0's part in realistic federations: each round, whose uploads reach the server
(``participation.*``, docs/running.md "Realistic federations").

The clients all train as always; afterwards rank 0 asks :class:`Participation` which of the
gathered uploads the server would have received: not the dropped ones, not those the simulated
clock brings after the deadline, and none at all when fewer than ``min_clients`` arrived. The
maths is :mod:`htfl_dist.runtime.clock`; this holds what it needs across rounds (every client's
device and cost per round, known the same way on every machine, and the simulated time so far,
which checkpoints keep).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from htfl_dist.config import Config
from htfl_dist.config.participation_section import parse_tiers
from htfl_dist.data.cache import PartitionInfo
from htfl_dist.errors import ConfigError
from htfl_dist.models import architecture_for_client
from htfl_dist.models.cost import forward_flops_per_sample
from htfl_dist.payload import Payload
from htfl_dist.runtime.clock import (
    ClientDevice,
    RoundTimes,
    client_seconds,
    dropped_clients,
    is_available,
    profile_devices,
    read_trace,
    round_times,
    tier_devices,
)
from htfl_dist.runtime.placement import local_steps

TRAINING_PASSES = 3
"""A training step costs about three forward passes (forward, and backward's two products)."""


def client_devices(config: Config) -> list[ClientDevice]:
    """Every client's device: from the trace, or the uniform profile with HtFLlib's slow fractions.
    Every rank calls it at start-up, so a bad trace stops them all with the same line."""
    options = config.participation
    if options.profile == "trace":
        assert options.trace is not None, "checked with the config"
        return read_trace(options.trace, config.num_clients)
    if options.profile == "tiers":
        assert options.tiers is not None, "checked with the config"
        return tier_devices(config.seed, config.num_clients, parse_tiers(options.tiers), options.train_slow_rate,
                            options.send_slow_rate)
    return profile_devices(config.seed, config.num_clients, options.bandwidth_mbps, options.train_slow_rate,
                           options.send_slow_rate)


def payload_bytes(payload: Payload | None) -> int:
    """The bytes of a payload's tensors (what its transfer costs on the simulated link)."""
    if not payload:
        return 0
    return sum(t.numel() * t.element_size() for t in payload.values() if isinstance(t, torch.Tensor))


def check_late_uploads(config: Config) -> None:
    """``participation.late=next_round`` needs a server that can take last round's uploads beside
    this round's (``ServerAlgorithm.accepts_late_uploads``); refused in one line otherwise."""
    if config.participation.late != "next_round":
        return
    from htfl_dist.algorithms import get_algorithm

    if not get_algorithm(config.algorithm).server.accepts_late_uploads:
        raise ConfigError(f"participation.late=next_round: {config.algorithm}'s server answers each round's "
                          f"uploads to that round's download and cannot take a late one a round later; "
                          f"use participation.late=drop")


@dataclass
class RoundArrivals:
    """What :meth:`Participation.decide` tells the round loop and the metrics row."""

    kept: dict[int, Payload]
    times: RoundTimes
    too_few: bool
    """Fewer than ``participation.min_clients`` arrived: the server step is skipped."""
    unavailable: list[int] | None = None
    """Participants outside their trace's availability windows when the round started: not
    heard from (None when no client has windows: the row has no such key)."""
    folded: list[int] | None = None
    """``participation.late=next_round``: the clients whose upload of the round before is in
    ``kept`` (None otherwise: the row has no such key)."""

    def row(self, clock_on: bool, clock_s: float) -> dict[str, Any]:
        """The metrics row's keys: who was lost, late or aggregated; with the clock, the times."""
        row: dict[str, Any] = {"dropped_clients": self.times.dropped, "late_clients": self.times.late,
                               "arrived_clients": len(self.times.arrived)}
        if self.folded is not None:
            row["late_folded_clients"] = self.folded
        if self.unavailable is not None:
            row["unavailable_clients"] = self.unavailable
        if clock_on:
            row.update(sim_round_s=round(self.times.round_seconds, 6), sim_clock_s=round(clock_s, 6))
        return row


class Participation:
    """Rank 0: each round's arrivals; the simulated clock's total."""

    def __init__(self, config: Config, info: PartitionInfo, devices: list[ClientDevice]) -> None:
        self.config = config
        self.options = config.participation
        self.devices = devices
        self.has_windows = any(device.windows for device in devices)
        self.clock_s = 0.0
        self.held: dict[int, Payload] = {}
        """``late=next_round``: last round's late uploads, by client, for this round's server."""
        train = config.train
        self.steps = local_steps(info.class_counts[: config.num_clients].sum(axis=1), train)
        flops: dict[str, float] = {}
        self.flops_per_step = []
        for client_id in range(config.num_clients):
            member = architecture_for_client(config.model.group, client_id)
            if member not in flops:
                flops[member] = forward_flops_per_sample(member, num_classes=info.num_classes,
                                                         feature_dim=config.model.feature_dim, inputs=info.inputs(),
                                                         options=config.model.options)
            self.flops_per_step.append(TRAINING_PASSES * flops[member] * train.batch_size)

    def seconds(self, client_id: int, round_index: int, bytes_moved: int) -> float:
        return client_seconds(self.devices[client_id], steps=self.steps[client_id],
                              flops_per_step=self.flops_per_step[client_id],
                              reference_flops=self.options.reference_tflops * 1e12, bytes_moved=bytes_moved,
                              seed=self.config.seed, client_id=client_id, round_index=round_index,
                              jitter=self.options.jitter)

    def decide(self, round_index: int, participants: list[int], gathered: Mapping[int, Payload],
               download_bytes: int) -> RoundArrivals:
        """Of the gathered uploads, those that reach the server this round; advances the clock.
        A participant outside its availability windows at the round's start is not heard from
        and not waited for (it trained on its rank all the same: every rank plays the same round)."""
        options = self.options
        unavailable = None
        if self.has_windows:
            available = {c for c in participants
                         if is_available(self.devices[c], self.clock_s, options.availability_period_s)}
            unavailable = [c for c in participants if c not in available]
            participants = [c for c in participants if c in available]
        seconds = {c: (self.seconds(c, round_index, download_bytes + payload_bytes(gathered.get(c)))
                       if options.clock else 0.0) for c in participants}
        times = round_times(seconds, dropped_clients(self.config.seed, round_index, participants, options.drop_rate),
                            options.deadline_s)
        self.clock_s += times.round_seconds
        kept = {c: gathered[c] for c in times.arrived if c in gathered}
        folded = None
        if options.late == "next_round":  # last round's late uploads join, unless their client's fresh one arrived
            folded = sorted(c for c in self.held if c not in kept)
            kept = dict(sorted({**kept, **{c: self.held[c] for c in folded}}.items()))
            self.held = {c: gathered[c] for c in times.late if c in gathered}
        aggregated = len(kept) if folded is not None else len(times.arrived)
        return RoundArrivals(kept, times, too_few=aggregated < options.min_clients, folded=folded,
                             unavailable=unavailable)

    def state_dict(self) -> dict[str, Any]:
        return {"clock_s": self.clock_s, "held_uploads": {c: dict(p) for c, p in self.held.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clock_s = float(state.get("clock_s", 0.0))
        self.held = {int(c): dict(p) for c, p in state.get("held_uploads", {}).items()}


def rank0_participation(config: Config, info: PartitionInfo) -> Participation | None:
    """Rank 0's arrivals policy, or None when every gathered upload reaches the server (the default)
    or when rounds are asynchronous server steps."""
    options = config.participation
    if options.mode == "async" or not (options.clock or options.drop_rate > 0 or options.min_clients > 0):
        return None  # async: its schedule decides the arrivals (runtime.asynchronous)
    return Participation(config, info, client_devices(config))
