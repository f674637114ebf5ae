"""Clients lent to another rank for one round's training (``runtime.rebalance=round``).

Start-up places every client on a home rank by its estimated work, but a round trains only its
sampled participants, and the sample rarely falls evenly on the homes: with pfl-research's
workload (1,000 clients, 50 a round, equal work) two client ranks trained up to 160 and 90
steps where 125 each was possible. ``placement.round_trainers`` moves just enough participants
to even the round; here the home rank sends each moved client's state to the rank that trains
it, which sends it back after training, before evaluation. Homes never change, so evaluation,
reports, checkpoints and failure lines stay as they were, and since every stream is keyed by
(seed, client, round) the numbers do not depend on who trained whom.

A client's state travels as the record a checkpoint holds (``client_store.client_record``, less
what the next download replaces), in ``torch.save``'s format and loaded with
``weights_only=True`` like a checkpoint; a client never trained travels as one word (the trainer
builds it from the seed). Every rank walks the round's moves in client-id order, so each
send meets its receive. Algorithms never see any of this.
"""
from __future__ import annotations

import io
from collections.abc import Callable

import torch

from htfl_dist.algorithms import ClientState
from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.client_store import ClientRecord, ClientStore
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.wire import Encoded

FRESH, RECORD = 0, 1
"""Header of a lent client's message: never trained (build it from the seed), or a record follows."""

Move = tuple[int, int, int]
"""(client id, home rank, training rank) of a participant trained away from home this round."""


def encode_record(record: ClientRecord | None) -> Encoded:
    if record is None:
        return Encoded(torch.tensor([FRESH]), torch.empty(0, dtype=torch.uint8))
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return Encoded(torch.tensor([RECORD]), torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))


def decode_record(message: Encoded, client_id: int, sender: str) -> ClientRecord | None:
    """The record ``sender`` sent for ``client_id`` (None: never trained); one line naming the
    sender for anything else."""
    header = message.header.tolist()
    if header == [FRESH] and not message.body.numel():
        return None
    if header != [RECORD]:
        raise ProtocolError(f"{sender} sent client {client_id}'s state with header {header}, expected [{RECORD}]")
    try:
        record = torch.load(io.BytesIO(message.body.numpy().tobytes()), map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure of a peer's bytes is that peer's fault
        raise ProtocolError(f"{sender} sent client {client_id}'s state that does not load "
                            f"({type(exc).__name__})") from None
    if not isinstance(record, dict) or record.get("client_id") != client_id:
        raise ProtocolError(f"{sender} sent another client's state for client {client_id}")
    return record


class Lending:
    """One rank's side of a round's moves: lend its clients out, borrow others', give them back."""

    def __init__(self, transport: Transport, store: ClientStore, describe_rank: Callable[[int], str],
                 forget_data: Callable[[int], None]) -> None:
        self.transport = transport
        self.store = store
        self.describe_rank = describe_rank
        self.forget_data = forget_data
        """Drops a borrowed client's data split once it went home (a rank keeps only its own)."""

    def lend(self, moves: list[Move]) -> dict[int, ClientState]:
        """Send this rank's moved clients to their trainers; return the clients lent to it."""
        borrowed: dict[int, ClientState] = {}
        rank = self.transport.rank
        for client_id, home, trainer in moves:
            if rank == home:
                self.transport.send(encode_record(self.store.lend(client_id)), trainer)
            elif rank == trainer:
                record = self._receive(client_id, home)
                borrowed[client_id] = self.store.borrow(client_id, record, f"{self.describe_rank(home)}'s record")
        return borrowed

    def give_back(self, moves: list[Move], borrowed: dict[int, ClientState]) -> None:
        """Send the trained borrowed clients home; take this rank's own back into its store."""
        rank = self.transport.rank
        for client_id, home, trainer in moves:
            if rank == trainer:
                self.transport.send(encode_record(self.store.compact_record(borrowed.pop(client_id))), home)
                self.forget_data(client_id)
            elif rank == home:
                record = self._receive(client_id, trainer)
                if record is None:
                    raise ProtocolError(f"{self.describe_rank(trainer)} returned client {client_id} untrained")
                self.store.restore(client_id, record, f"{self.describe_rank(trainer)}'s record")

    def _receive(self, client_id: int, source: int) -> ClientRecord | None:
        message = self.transport.receive(source, self.transport.max_message_bytes)
        return decode_record(message, client_id, self.describe_rank(source))
