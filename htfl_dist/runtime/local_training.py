"""The spine's train phase: which rank trains each participant this round, and the training of
this rank's share (its own participants and those lent to it), each client's batches drawn from
its own stream (seed, client, round), so the numbers do not depend on where a client trains."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from htfl_dist.algorithms import ClientState, TrainResult
from htfl_dist.algorithms.interface import release_gradients, seed_training
from htfl_dist.algorithms.optimizers import begin_local_training
from htfl_dist.metrics.writer import TrainingProgress
from htfl_dist.models import architecture_for_client
from htfl_dist.payload import Payload
from htfl_dist.privacy.startup import begin_round
from htfl_dist.runtime.concurrent_training import WIDTHS, ConcurrentTraining
from htfl_dist.runtime.placement import round_trainers
from htfl_dist.runtime.startup import concurrent_clients
from htfl_dist.seeding import torch_generator

if TYPE_CHECKING:
    from htfl_dist.runtime.session import Session


@dataclass
class TrainedShare:
    """What this rank's training produced in one round."""

    uploads: dict[int, Payload] = field(default_factory=dict)
    train_rows: dict[int, list[float]] = field(default_factory=dict)
    """[loss sum, samples] per trained client (none for a private client: they stay on it)."""
    theory_bytes: int = 0
    """The paper's count of this rank's upload bytes."""


def owned_upload(upload: Payload, client: ClientState, knowledge: Payload) -> Payload:
    """``upload`` with every tensor that shares storage with what outlives the round on this side
    (the client's model, optimizer state and modules, the data, the round's knowledge) replaced by
    a copy, so that whoever receives it may keep it while the client trains on: the exchange
    within one process then hands uploads over instead of copying each (most uploads are fresh
    already: a parameter row, a prototype table), and on any world size a client the store lets
    go may give its model to the next one before its upload is encoded (``ClientStore.finished_with``)."""
    kept = _storages(client.model.state_dict(keep_vars=True).values(), knowledge.values(),
                     (client.train_x, client.train_y, client.test_x, client.test_y),
                     *(module.state_dict(keep_vars=True).values() for module in client.modules.values()),
                     (value for state in client.optimizer.state.values() for value in state.values()))
    return {name: tensor.detach().clone() if _storage_of(tensor) in kept else tensor
            for name, tensor in upload.items()}


def _storage_of(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _storages(*groups: Iterable[object]) -> set[tuple[str, int]]:
    return {_storage_of(value) for group in groups for value in group if isinstance(value, torch.Tensor)}


class LocalTraining:
    """One rank's train phase over its session."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.config = session.config
        where = "" if session.world_size == 1 else f"rank {session.rank}"
        self.progress = TrainingProgress(self.config.output.progress_every_s, where)
        self.concurrent = self._concurrent_training(where)

    def trainers(self, participants: list[int]) -> dict[int, int]:
        """The rank that trains each participant this round (``runtime.rebalance``)."""
        placement = self.session.placement
        if self.config.runtime.rebalance == "off":
            return {client_id: placement.rank_of(client_id) for client_id in participants}
        return round_trainers(participants, placement)

    def train(self, trainers: dict[int, int], knowledge: Payload, round_index: int) -> TrainedShare:
        """Train the participants ``trainers`` gives this rank: its own, and those lent to it for
        the round (given back before this returns)."""
        session = self.session
        share = TrainedShare()
        moves = [(client_id, session.placement.rank_of(client_id), rank) for client_id, rank in sorted(trainers.items())
                 if rank != session.placement.rank_of(client_id)]
        if session.is_server and moves:  # summary.json: how much rebalancing did
            summary = session.run.extra_summary
            summary["clients_trained_away_from_home"] = summary.get("clients_trained_away_from_home", 0) + len(moves)
        borrowed = session.lending.lend(moves)
        mine = [client_id for client_id in sorted(trainers) if trainers[client_id] == session.rank]
        self.progress.start(round_index + 1, len(mine))
        for group, results in self._trained_groups(mine, borrowed, knowledge, round_index):
            for client, result in results:
                share.uploads[client.client_id] = result.upload
                if session.privacy_plan is None:  # a private client's loss and count stay on the client
                    share.train_rows[client.client_id] = [result.loss_sum, float(result.samples)]
                share.theory_bytes += session.client_algorithm.theory_upload_floats(client) * 4
                self.progress.client_done()
            session.clients.finished_with(group)
        session.lending.give_back(moves, borrowed)
        return share

    def _trained_groups(self, client_ids: list[int], borrowed: dict[int, ClientState], knowledge: Payload,
                        round_index: int) -> Iterator[tuple[list[int], list[tuple[ClientState, TrainResult]]]]:
        """Each group of ``client_ids`` (client-id order) with its clients and their results, the
        gradients released and each upload owned (``owned_upload``): the groups of
        :meth:`_groups`, or, with ``train.concurrent_clients``, the groups trained side by side."""
        def client(client_id: int) -> ClientState:
            return borrowed[client_id] if client_id in borrowed else self.session.clients[client_id]

        def finished(member: ClientState, result: TrainResult) -> tuple[ClientState, TrainResult]:
            release_gradients(member)
            return member, dataclasses.replace(result, upload=owned_upload(result.upload, member, knowledge))

        if self.concurrent is None:
            for group in self._groups(client_ids):
                clients = [client(client_id) for client_id in group]
                results = self._train_group(clients, knowledge, round_index)
                yield group, [finished(member, result) for member, result in zip(clients, results, strict=True)]
            return
        def train_one(members: dict[int, ClientState], client_id: int) -> tuple[ClientState, TrainResult]:
            return finished(members[client_id], self._train_one(members[client_id], knowledge, round_index))

        def seed_for(client_id: int) -> None:
            seed_training(self.config.seed, client_id, round_index)

        pending = list(client_ids)
        while pending:
            group = self.concurrent.next_group(pending)
            members = {client_id: client(client_id) for client_id in group}  # resolved here: the store is not threaded
            self._begin(list(members.values()), round_index)
            yield group, self.concurrent.train(group, seed_for, functools.partial(train_one, members),
                                               lambda outcome: outcome[1].samples, round_index)

    def close(self) -> None:
        """Let the training threads go (the run is over)."""
        if self.concurrent is not None:
            self.concurrent.close()

    def _concurrent_training(self, where: str) -> ConcurrentTraining | None:
        """The rank's training threads when ``train.concurrent_clients`` lets more than one client
        train at once (None: one at a time, the groups of :meth:`_groups`)."""
        session = self.session
        width, _ = concurrent_clients(self.config, session.entry, session.device)
        if width == 1:
            return None
        store = session.clients
        cap = max(WIDTHS) if width == 0 else width
        cap = min(cap, store.limit) if store.bounded else cap  # a group is held in memory at once
        if cap == 1:
            return None
        return ConcurrentTraining(width, cap, session.device,
                                  lambda client_id: architecture_for_client(self.config.model.group, client_id), where)

    def _groups(self, client_ids: list[int]) -> list[list[int]]:
        """The clients that train together: each alone (``train.client_batching=off``), or this
        rank's participants of one architecture (``vmap``), in client-id order; a group is held in
        memory at once, so with ``runtime.resident_clients=K`` it holds at most K clients."""
        if self.config.train.client_batching == "off":
            return [[client_id] for client_id in client_ids]
        groups: dict[str, list[int]] = {}
        for client_id in client_ids:
            groups.setdefault(architecture_for_client(self.config.model.group, client_id), []).append(client_id)
        store = self.session.clients
        size = store.limit if store.bounded else len(client_ids)
        return [group[start : start + size] for group in groups.values() for start in range(0, len(group), size)]

    def _train_group(self, clients: list[ClientState], knowledge: Payload, round_index: int) -> list[TrainResult]:
        """One group's round of local training, each client's batches ordered by its own stream
        (seed, client, round); off: ``train`` of the one client, torch's global RNG seeded for it."""
        self._begin(clients, round_index)
        if self.config.train.client_batching == "vmap":
            generators = [self._batch_stream(client.client_id, round_index) for client in clients]
            return self.session.client_algorithm.train_group(clients, knowledge, round_index, generators)
        (client,) = clients
        seed_training(self.config.seed, client.client_id, round_index)
        return [self._train_one(client, knowledge, round_index)]

    def _begin(self, clients: list[ClientState], round_index: int) -> None:
        """Before a group trains: each private client's ledger decides whether it can afford the
        round, and every optimizer takes the round's learning rate."""
        begin_round(clients, round_index)
        begin_local_training(clients, self.config.train, round_index, self.config.rounds)

    def _train_one(self, client: ClientState, knowledge: Payload, round_index: int) -> TrainResult:
        """``train`` of one client (torch's global RNG seeded for it by the caller)."""
        generator = self._batch_stream(client.client_id, round_index)
        return self.session.client_algorithm.train(client, knowledge, round_index, generator)

    def _batch_stream(self, client_id: int, round_index: int) -> torch.Generator:
        return torch_generator(self.config.seed, "batches", client_id, round_index)
