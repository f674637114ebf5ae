"""Moving encoded messages between the server (rank 0) and the client ranks.

One interface, three implementations:

* ``LocalTransport``: world size 1, server and clients share the process (the reference path).
* ``TorchTransport``: torch.distributed point-to-point + broadcast (Gloo or NCCL).
* ``MPITransport``: mpi4py buffer operations (no pickle: ``Send``/``Recv``/``Bcast`` on arrays).

Every operation moves an :class:`~htfl_dist.runtime.wire.Encoded` message: first a 2-value
size tensor, then the header and the body, so variable-size payloads need no padding.
Algorithms never see this module.
"""
from __future__ import annotations

import abc
import datetime
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.liveness import StoreAddress, open_store
from htfl_dist.runtime.wire import Encoded

_ABORT_DRAIN_S = 1.0  # long enough for mpirun to forward a rank's last stderr line
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


def checked_sizes(sizes: list[int], source: int, limit_bytes: int,
                  protocol_bytes: int | None = None) -> tuple[int, int]:
    """The (header values, body bytes) a rank announced, refused before anything is allocated
    when negative, headerless, larger than ``limit_bytes`` (runtime.max_message_mb) or than
    ``protocol_bytes``, the most this rank's message can truthfully hold this time (its entries
    times every field's declared ``max_rows``): a peer's word alone must not make rank 0 allocate
    gigabytes or crash on a negative size."""
    header_len, body_len = (int(v) for v in sizes)
    announced = header_len * 8 + body_len
    if header_len < 1 or body_len < 0 or announced > limit_bytes:
        raise ProtocolError(
            f"rank {source} announced a message of {header_len} header values and {body_len} body bytes; "
            f"refused before allocating it (limit: runtime.max_message_mb={limit_bytes >> 20})")
    if protocol_bytes is not None and announced > protocol_bytes:
        raise ProtocolError(
            f"rank {source} announced a message of {header_len} header values and {body_len} body bytes; "
            f"refused before allocating it: what it hosts can send at most {protocol_bytes} bytes")
    return header_len, body_len


class Transport(abc.ABC):
    """Rank 0 broadcasts to and gathers from ranks 1..W-1 (and itself)."""

    rank: int
    world_size: int
    name: str
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """The largest message rank 0 accepts from one rank in a gather."""
    waiting_for: int | None = None
    """The rank this rank is blocked on right now (rank 0 in a gather: the rank it receives
    from; a client rank: 0), None outside a transfer: failure lines name it."""

    @abc.abstractmethod
    def broadcast(self, message: Encoded | None) -> Encoded:
        """Rank 0 passes the message; every rank returns it."""

    @abc.abstractmethod
    def gather(self, message: Encoded, bounds: Sequence[int | None] | None = None) -> list[Encoded] | None:
        """Every rank passes its message; rank 0 returns all of them ordered by rank.
        ``bounds[rank]`` (rank 0 only): the most bytes that rank's message may hold (None: no
        bound beyond ``max_message_bytes``)."""

    def send(self, message: Encoded, dest: int) -> None:
        """Point to point between client ranks (a client lent for a round's training): blocks
        until ``dest`` takes it. Every rank walks the round's transfers in one order, so each
        pair meets. World size 1 has no other rank."""
        raise ProtocolError(f"{self.name} transport has no rank {dest} to send to")

    def receive(self, source: int, limit_bytes: int) -> Encoded:
        """The message ``source`` sends with :meth:`send`, refused before allocation when it
        announces more than ``limit_bytes``."""
        raise ProtocolError(f"{self.name} transport has no rank {source} to receive from")

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def abort(self, exit_code: int) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Bring the whole job down quickly (other ranks may be blocked in a collective)."""

    def close(self) -> None: ...  # noqa: B027 (optional hook)


class LocalTransport(Transport):
    """World size 1: messages go through encode/decode but never leave the process."""

    rank = 0
    world_size = 1
    name = "local"

    def broadcast(self, message: Encoded | None) -> Encoded:
        assert message is not None
        return message

    def gather(self, message: Encoded, bounds: Sequence[int | None] | None = None) -> list[Encoded]:
        return [message]

    def barrier(self) -> None:
        return None


def _sizes(message: Encoded) -> torch.Tensor:
    return torch.tensor([message.header.numel(), message.body.numel()], dtype=torch.int64)


def _sent(message: Encoded | None) -> Encoded:
    """The message rank 0 broadcasts (the other ranks pass None)."""
    assert message is not None, "rank 0 passes the message it broadcasts"
    return message


class TorchTransport(Transport):
    """torch.distributed; tensors travel on ``comm_device`` (a GPU for NCCL, CPU for Gloo)."""

    def __init__(self, backend: str, rank: int, world_size: int, comm_device: torch.device,
                 timeout_s: float, address: StoreAddress) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world_size, self.name = rank, world_size, backend
        self.comm_device = comm_device
        self.address = address
        kwargs: dict[str, Any] = {"device_id": comm_device} if backend == "nccl" else {}
        serve = rank == 0 and address.hosted_by_rank0
        store = open_store(address, rank, world_size, timeout_s, serve=serve)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, store=store,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)

    def _to_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.comm_device)

    def broadcast(self, message: Encoded | None) -> Encoded:
        self.waiting_for = None if self.rank == 0 else 0
        dist = self._dist
        sizes = self._to_comm(_sizes(_sent(message)) if self.rank == 0 else torch.zeros(2, dtype=torch.int64))
        dist.broadcast(sizes, src=0)
        header_len, body_len = (int(v) for v in sizes.tolist())
        if self.rank == 0:
            sent = _sent(message)
            header, body = self._to_comm(sent.header), self._to_comm(sent.body)
        else:
            header = torch.empty(header_len, dtype=torch.int64, device=self.comm_device)
            body = torch.empty(body_len, dtype=torch.uint8, device=self.comm_device)
        dist.broadcast(header, src=0)
        if body_len:
            dist.broadcast(body, src=0)
        self.waiting_for = None
        return Encoded(header.cpu(), body.cpu())

    def gather(self, message: Encoded, bounds: Sequence[int | None] | None = None) -> list[Encoded] | None:
        dist = self._dist
        if self.rank != 0:
            self.waiting_for = 0
            dist.send(self._to_comm(_sizes(message)), dst=0)
            dist.send(self._to_comm(message.header), dst=0)
            if message.body.numel():
                dist.send(self._to_comm(message.body), dst=0)
            self.waiting_for = None
            return None
        received = [message]
        for source in range(1, self.world_size):
            self.waiting_for = source
            sizes = torch.empty(2, dtype=torch.int64, device=self.comm_device)
            dist.recv(sizes, src=source)
            header_len, body_len = checked_sizes(sizes.tolist(), source, self.max_message_bytes,
                                                 bounds[source] if bounds else None)
            header = torch.empty(header_len, dtype=torch.int64, device=self.comm_device)
            dist.recv(header, src=source)
            body = torch.empty(body_len, dtype=torch.uint8, device=self.comm_device)
            if body_len:
                dist.recv(body, src=source)
            received.append(Encoded(header.cpu(), body.cpu()))
        self.waiting_for = None
        return received

    def send(self, message: Encoded, dest: int) -> None:
        dist = self._dist
        self.waiting_for = dest
        dist.send(self._to_comm(_sizes(message)), dst=dest)
        dist.send(self._to_comm(message.header), dst=dest)
        if message.body.numel():
            dist.send(self._to_comm(message.body), dst=dest)
        self.waiting_for = None

    def receive(self, source: int, limit_bytes: int) -> Encoded:
        dist = self._dist
        self.waiting_for = source
        sizes = torch.empty(2, dtype=torch.int64, device=self.comm_device)
        dist.recv(sizes, src=source)
        header_len, body_len = checked_sizes(sizes.tolist(), source, self.max_message_bytes, limit_bytes)
        header = torch.empty(header_len, dtype=torch.int64, device=self.comm_device)
        dist.recv(header, src=source)
        body = torch.empty(body_len, dtype=torch.uint8, device=self.comm_device)
        if body_len:
            dist.recv(body, src=source)
        self.waiting_for = None
        return Encoded(header.cpu(), body.cpu())

    def barrier(self) -> None:
        if self.name == "nccl":
            self._dist.barrier(device_ids=[self.comm_device.index])
        else:
            self._dist.barrier()

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


class MPITransport(Transport):
    """mpi4py buffer operations on numpy views of CPU tensors."""

    name = "mpi"

    def __init__(self, comm) -> None:  # comm: mpi4py.MPI.Comm
        self._comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()

    def broadcast(self, message: Encoded | None) -> Encoded:
        self.waiting_for = None if self.rank == 0 else 0
        comm = self._comm
        sizes = _sizes(_sent(message)).numpy() if self.rank == 0 else np.zeros(2, dtype=np.int64)
        comm.Bcast(sizes, root=0)
        if self.rank == 0:
            sent = _sent(message)
            header, body = sent.header.numpy(), sent.body.numpy()
        else:
            header = np.empty(int(sizes[0]), dtype=np.int64)
            body = np.empty(int(sizes[1]), dtype=np.uint8)
        comm.Bcast(header, root=0)
        if body.size:
            comm.Bcast(body, root=0)
        self.waiting_for = None
        return Encoded(torch.from_numpy(header), torch.from_numpy(body))

    def gather(self, message: Encoded, bounds: Sequence[int | None] | None = None) -> list[Encoded] | None:
        comm = self._comm
        if self.rank != 0:
            self.waiting_for = 0
            comm.Send(_sizes(message).numpy(), dest=0, tag=1)
            comm.Send(message.header.numpy(), dest=0, tag=2)
            if message.body.numel():
                comm.Send(message.body.numpy(), dest=0, tag=3)
            self.waiting_for = None
            return None
        received = [message]
        for source in range(1, self.world_size):
            self.waiting_for = source
            sizes = np.empty(2, dtype=np.int64)
            comm.Recv(sizes, source=source, tag=1)
            header_len, body_len = checked_sizes(sizes.tolist(), source, self.max_message_bytes,
                                                 bounds[source] if bounds else None)
            header = np.empty(header_len, dtype=np.int64)
            comm.Recv(header, source=source, tag=2)
            body = np.empty(body_len, dtype=np.uint8)
            if body.size:
                comm.Recv(body, source=source, tag=3)
            received.append(Encoded(torch.from_numpy(header), torch.from_numpy(body)))
        self.waiting_for = None
        return received

    def send(self, message: Encoded, dest: int) -> None:
        comm = self._comm
        self.waiting_for = dest
        comm.Send(_sizes(message).numpy(), dest=dest, tag=4)
        comm.Send(message.header.numpy(), dest=dest, tag=5)
        if message.body.numel():
            comm.Send(message.body.numpy(), dest=dest, tag=6)
        self.waiting_for = None

    def receive(self, source: int, limit_bytes: int) -> Encoded:
        comm = self._comm
        self.waiting_for = source
        sizes = np.empty(2, dtype=np.int64)
        comm.Recv(sizes, source=source, tag=4)
        header_len, body_len = checked_sizes(sizes.tolist(), source, self.max_message_bytes, limit_bytes)
        header = np.empty(header_len, dtype=np.int64)
        comm.Recv(header, source=source, tag=5)
        body = np.empty(body_len, dtype=np.uint8)
        if body.size:
            comm.Recv(body, source=source, tag=6)
        self.waiting_for = None
        return Encoded(torch.from_numpy(header), torch.from_numpy(body))

    def barrier(self) -> None:
        self._comm.Barrier()

    def abort(self, exit_code: int) -> None:
        # mpirun forwards each rank's stderr asynchronously and MPI_Abort tears the job down at
        # once: without a short pause the one line that says *why* the job ended can be lost.
        sys.stderr.flush()
        time.sleep(_ABORT_DRAIN_S)
        self._comm.Abort(exit_code)
