"""Which rank hosts which logical client, and who takes part in a round.

Both are pure functions of the config and the partition (which every rank reads), so every rank
computes the same answer without talking to the others; ``runtime.placement_work=timed`` adds
step times that rank 0 measures and broadcasts (the runtime's business, not this module's).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from htfl_dist.algorithms.batches import samples_per_epoch
from htfl_dist.errors import HtflError
from htfl_dist.models import architecture_for_client
from htfl_dist.models.cost import forward_flops_per_sample
from htfl_dist.runtime.clock import join_count
from htfl_dist.seeding import numpy_rng

if TYPE_CHECKING:
    from htfl_dist.config import Config, TrainConfig
    from htfl_dist.data import PartitionInfo


def check_world_size(world_size: int, num_clients: int, server_hosts: bool = False) -> None:
    training = len(client_ranks(world_size, server_hosts))
    if training > num_clients:
        most = num_clients if server_hosts else num_clients + 1
        raise HtflError(
            f"{world_size} ranks give {training} client ranks but there are only {num_clients} "
            f"logical clients; start at most {most} ranks or raise num_clients"
        )


PLACEMENTS = ("balanced", "round_robin")


@dataclass(frozen=True)
class Placement:
    """The rank hosting each client id (rank 0 hosts all of them at world size 1).

    Placement decides only where a client computes: every random stream and every message is
    keyed by client id, so results are the same for any placement (and any world size)."""

    world_size: int
    ranks: tuple[int, ...]
    """``ranks[client_id]``: the hosting rank."""
    work: tuple[float, ...] = ()
    """Estimated work per client (training samples, or samples × FLOPs), for the start-up line;
    empty if unknown."""
    work_unit: str = "samples"
    """What ``work`` counts, as the start-up line names it."""
    unseen: tuple[int, ...] = ()
    """``unseen[j]``: the rank hosting unseen client N + j (``eval.new_clients``), which only ever
    fine-tunes and tests on evaluation rounds."""
    server_hosts: bool = False
    """Rank 0 is a client rank too (``runtime.server_hosts_clients``); always so at world size 1."""

    @property
    def client_ranks(self) -> list[int]:
        """The ranks that host clients, ascending."""
        return client_ranks(self.world_size, self.server_hosts)

    @classmethod
    def round_robin(cls, world_size: int, num_clients: int, server_hosts: bool = False) -> Placement:
        """Client i on the (i mod R)-th client rank (R client ranks: 1..W−1, or 0..W−1 when the
        server hosts clients)."""
        ranks = client_ranks(world_size, server_hosts)
        return cls(world_size, tuple(ranks[cid % len(ranks)] for cid in range(num_clients)),
                   server_hosts=server_hosts)

    @classmethod
    def balanced(cls, world_size: int, work: Sequence[float], server_hosts: bool = False) -> Placement:
        """Longest processing time first: clients by decreasing work (ties: lower id first), each
        onto the client rank with the least work so far (ties: lower rank). Under Dirichlet client
        sizes differ ~100×, and round-robin leaves the rank with the big clients alone at the end
        of every round."""
        hosts = client_ranks(world_size, server_hosts)
        loads = [0.0] * len(hosts)
        ranks = [0] * len(work)
        for cid in sorted(range(len(work)), key=lambda c: (-work[c], c)):
            slot = min(range(len(loads)), key=lambda r: (loads[r], r))
            ranks[cid] = hosts[slot]
            loads[slot] += work[cid]
        return cls(world_size, tuple(ranks), tuple(work), server_hosts=server_hosts)

    def rank_of(self, client_id: int) -> int:
        return self.ranks[client_id]

    def with_unseen(self, count: int) -> Placement:
        """The same placement plus ``count`` unseen clients, ids N..N+count−1, spread over the
        client ranks in turn (rank 0 at world size 1)."""
        hosts = self.client_ranks
        return dataclasses.replace(self, unseen=tuple(hosts[j % len(hosts)] for j in range(count)))

    def unseen_of(self, rank: int) -> list[int]:
        """The unseen clients ``rank`` hosts, ascending (read every evaluated round: computed once)."""
        return list(self._unseen_hosted.get(rank, ()))

    @cached_property
    def _unseen_hosted(self) -> dict[int, tuple[int, ...]]:
        hosted: dict[int, list[int]] = {}
        for j, rank in enumerate(self.unseen):
            hosted.setdefault(rank, []).append(len(self.ranks) + j)
        return {rank: tuple(cids) for rank, cids in hosted.items()}

    def clients_of(self, rank: int) -> list[int]:
        """The clients ``rank`` hosts, ascending (read every round: computed once)."""
        return list(self._hosted.get(rank, ()))

    @cached_property
    def _hosted(self) -> dict[int, tuple[int, ...]]:
        hosted: dict[int, list[int]] = {}
        for cid, rank in enumerate(self.ranks):
            hosted.setdefault(rank, []).append(cid)
        return {rank: tuple(cids) for rank, cids in hosted.items()}

    def describe_rank(self, rank: int) -> str:
        """'rank r (clients [...])' or 'rank 0 (server)', for messages that must name a rank."""
        hosted = self.clients_of(rank)
        if not hosted:
            return f"rank {rank} (server)"
        more = "..." if len(hosted) > 8 else ""
        return f"rank {rank} (clients {hosted[:8]}{more})"

    def work_share(self, rank: int) -> float | None:
        total = sum(self.work)
        if not self.work or total <= 0:
            return None
        return sum(self.work[cid] for cid in self.clients_of(rank)) / total

    def describe(self, ranks_shown: int = 8) -> str:
        """One line for the start-up log: which ranks host how many clients (the first
        ``ranks_shown`` ranks in full, then a count), and their share of the training samples."""
        if self.world_size == 1:
            return f"placement: rank 0 is the server and hosts all {len(self.ranks)} clients"
        parts = []
        for rank in self.client_ranks[:ranks_shown]:
            hosted = self.clients_of(rank)
            shown = ",".join(str(cid) for cid in hosted[:6]) + (",..." if len(hosted) > 6 else "")
            share = self.work_share(rank)
            parts.append(f"rank {rank}: {len(hosted)} ({shown})" + (f" {share:.0%}" if share is not None else ""))
        rest = len(self.client_ranks) - ranks_shown
        more = f"; {rest} more ranks" if rest > 0 else ""
        server = "rank 0 is the server and hosts clients" if self.server_hosts else "rank 0 is the server"
        return (f"placement: {server}; clients per rank (share of {self.work_unit}): "
                f"{'; '.join(parts)}{more}")


def round_trainers(participants: Sequence[int], home: Placement) -> dict[int, int]:
    """The rank that trains each participant this round (``runtime.rebalance=round``): its home
    rank, then, while it shortens the round, the largest participant on the most loaded rank whose
    work is below that rank's lead over the least loaded rank moves there (ties: lower rank, lower
    client id). Each move lowers the sum of squared loads, so it ends; clients stay home where the
    sample is already even (every participant of a full-participation run). Work is
    ``home.work`` (what placed the clients at start-up; 1 per client when unknown). A pure
    function of the participants and the placement: every rank computes the same answer."""
    trainers = {cid: home.rank_of(cid) for cid in participants}
    ranks = home.client_ranks
    if len(ranks) < 2 or not participants:
        return trainers
    work = [float(w) for w in home.work] if home.work else [1.0] * len(home.ranks)
    loads = dict.fromkeys(ranks, 0.0)
    for cid, rank in trainers.items():
        loads[rank] += work[cid]
    while True:
        busiest = max(ranks, key=lambda r: (loads[r], -r))
        idlest = min(ranks, key=lambda r: (loads[r], r))
        lead = loads[busiest] - loads[idlest]
        movable = [cid for cid, rank in trainers.items() if rank == busiest and 0 < work[cid] < lead]
        if not movable:
            return trainers
        moved = max(movable, key=lambda cid: (work[cid], -cid))
        trainers[moved] = idlest
        loads[busiest] -= work[moved]
        loads[idlest] += work[moved]


def plan_placement(policy: str, world_size: int, work: Sequence[float], work_unit: str = "samples",
                   server_hosts: bool = False) -> Placement:
    """``runtime.placement``: balanced (by ``work``) or round_robin; ``server_hosts``: rank 0
    is a client rank too (``runtime.server_hosts_clients``)."""
    if policy == "round_robin":
        placement = dataclasses.replace(Placement.round_robin(world_size, len(work), server_hosts), work=tuple(work))
    else:
        placement = Placement.balanced(world_size, work, server_hosts)
    return dataclasses.replace(placement, work_unit=work_unit)


def client_work(units: Sequence[float], members: Sequence[str], cost_per_unit: dict[str, float] | None
                ) -> list[float]:
    """Each client's estimated work: its units (samples, steps), times its architecture's cost per
    unit when ``cost_per_unit`` (member -> cost) is given."""
    if cost_per_unit is None:
        return [float(n) for n in units]
    return [float(n) * cost_per_unit[member] for n, member in zip(units, members, strict=True)]


def estimated_client_work(config: Config, info: PartitionInfo, step_seconds: dict[str, float] | None = None
                          ) -> tuple[list[float], str]:
    """Every client's estimated work by ``runtime.placement_work``, and its unit: its training
    samples; or its samples times its architecture's forward FLOPs per sample (counted on the meta
    device, so every rank gets the same number); or (``timed``, with ``step_seconds``: member ->
    seconds of one SGD step, measured on rank 0) its local steps per round times its step time."""
    samples = info.class_counts[: config.num_clients].sum(axis=1)  # unseen clients (eval.new_clients) never train
    members = [architecture_for_client(config.model.group, cid) for cid in range(config.num_clients)]
    basis = config.runtime.placement_work
    if basis == "samples":
        return client_work(samples, members, None), "samples"
    if basis == "flops":
        flops = {member: forward_flops_per_sample(member, num_classes=info.num_classes,
                                                  feature_dim=config.model.feature_dim,
                                                  inputs=info.inputs(), options=config.model.options)
                 for member in set(members)}
        return client_work(samples, members, flops), "FLOPs"
    if step_seconds is None:
        raise ValueError("placement_work=timed needs the members' measured step times")
    return client_work(local_steps(samples, config.train), members, step_seconds), "timed seconds"


def local_steps(samples: Sequence[int], train: TrainConfig) -> list[int]:
    """Each client's SGD steps in a round: epochs × its batches (the partial last one as trained)."""
    return [train.local_epochs * math.ceil(samples_per_epoch(int(n), train) / train.batch_size) for n in samples]


def idle_shares(compute_seconds: Sequence[float]) -> list[float]:
    """Per client rank, the share of the round's compute phase it spent waiting for the slowest
    one: (slowest − own) / slowest. What a better placement would win back (metrics.jsonl's
    ``rank_idle_share``; bench/placement.py projects it from estimated loads)."""
    slowest = max(compute_seconds, default=0.0)
    if slowest <= 0:
        return [0.0 for _ in compute_seconds]
    return [round((slowest - own) / slowest, 4) for own in compute_seconds]


def client_ranks(world_size: int, server_hosts: bool = False) -> list[int]:
    """The ranks hosting clients: every rank when rank 0 hosts clients (always at world size 1),
    else 1..W−1."""
    return list(range(world_size)) if world_size == 1 or server_hosts else list(range(1, world_size))


def sample_participants(seed: int, round_index: int, num_clients: int, join_ratio: float,
                        random_join: bool = False) -> list[int]:
    """int(N·ρ) clients (at least one; with ``random_join``, HtFLlib's -rjr, a count drawn from
    int(N·ρ)..N each round), drawn without replacement from the (seed, round) stream."""
    return _seeded_subset(seed, "participants", round_index, num_clients,
                          join_count(seed, round_index, num_clients, join_ratio, random_join))


def evaluated_clients(seed: int, round_index: int, num_clients: int, fraction: float, last_round: bool) -> list[int]:
    """The clients an evaluation round tests (``eval.clients_fraction``): all of them at fraction 1
    and on the last round, else int(N·f) (at least one) drawn from the (seed, round) stream."""
    count = num_clients if last_round else max(1, int(num_clients * fraction))
    return _seeded_subset(seed, "evaluated", round_index, num_clients, count)


def _seeded_subset(seed: int, stream: str, round_index: int, num_clients: int, count: int) -> list[int]:
    """``count`` of the clients 0..N−1 in id order, drawn without replacement from the (seed,
    stream, round) stream; all of them, drawing nothing, when ``count`` ≥ N."""
    if count >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, stream, round_index).choice(num_clients, size=count, replace=False)
    return sorted(int(c) for c in chosen)
