"""The logical clients a rank hosts, with at most ``runtime.resident_clients`` of them in memory.

With 1000 clients of HtCNN8 (10 MB of weights each on average) a rank cannot keep every model
resident, yet a round with ρ = 0.1 trains only 100 of them. The store keeps the most recently
used clients materialised (an LRU) and *parks* the others: their state (the checkpoint's
per-client record: model, optimizer, algorithm modules) goes to a per-rank scratch directory on
disk when the rank computes on the CPU, or to host memory when it computes on a GPU. A client
never touched yet is not parked at all: its initial state is a function of (seed, client id),
so it is built when first needed. A parked client is rebuilt on the meta device (no weight
initialisation) and takes its parked state back, so it continues bit for bit.

Results never depend on the limit: every stream is keyed by (seed, client id, round), and a
client comes back exactly as it was parked. Data splits stay resident (their total is the
dataset's size, whatever the number of clients). Checkpoints read parked clients' states from
the store, one at a time, so they stay per client id.

``resident_clients = 0`` (the default) keeps every client once built. Either way a client is
built when first needed, not at start-up: 1,000 clients of pfl-research's CNN took 25 s to build
before the first step, most of them not trained for many rounds.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from htfl_dist.algorithms import ClientState
from htfl_dist.errors import HtflError

ClientRecord = dict[str, Any]
"""One client's state as the checkpoint stores it (``client_record``)."""


REPLACED = "replaced_by_download"
"""A parked record's list of the model entries it leaves out (``client_record``'s ``leave_out``)."""


def client_record(client: ClientState, leave_out: frozenset[str] = frozenset()) -> ClientRecord:
    """What survives a client leaving memory: the same record a checkpoint writes per client id,
    less the model entries ``leave_out`` names (what the next download replaces, listed in the
    record so that a restore knows which entries may be missing)."""
    model = client.model.state_dict()
    record = {
        "client_id": client.client_id,
        "architecture": client.architecture,
        "model": {name: value for name, value in model.items() if name not in leave_out},
        "optimizer": client.optimizer.state_dict(),
        "modules": {name: module.state_dict() for name, module in client.modules.items()},
    }
    if leave_out:
        record[REPLACED] = sorted(name for name in model if name in leave_out)
    return record


def restore_client(client: ClientState, record: ClientRecord, origin: str) -> None:
    """Put ``record`` back into ``client``; ``origin`` names where it came from in errors. Entries
    a record lists as replaced by the download are zeroed: deterministic, and overwritten before
    any use."""
    if record["architecture"] != client.architecture:
        raise HtflError(f"{origin}: client {client.client_id} is a {record['architecture']}, config says "
                        f"{client.architecture}")
    replaced = set(record.get(REPLACED, ()))
    if replaced:
        state = client.model.state_dict()
        if not replaced <= set(state) or replaced & set(record["model"]):
            raise HtflError(f"{origin}: client {client.client_id}'s record leaves out model entries "
                            f"{sorted(replaced)} that its {client.architecture} does not have apart")
        record = {**record, "model": {**record["model"], **{name: torch.zeros_like(state[name]) for name in replaced}}}
    client.model.load_state_dict(record["model"])
    client.optimizer.load_state_dict(record["optimizer"])
    saved_modules = record.get("modules", {})
    if set(saved_modules) != set(client.modules):
        raise HtflError(f"{origin}: client {client.client_id} holds algorithm modules {sorted(saved_modules)}, "
                        f"this algorithm has {sorted(client.modules)}")
    for name, module in client.modules.items():
        module.load_state_dict(saved_modules[name])


class _DiskParking:
    """Parked records as files in a private scratch directory, removed when the store closes."""

    def __init__(self, parent: Path | None, rank: int) -> None:
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix=f"htfl_dist_rank{rank}_clients_", dir=parent))
        # removed on close, or when the process exits without closing (an exception mid-run)
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)

    def put(self, client_id: int, record: ClientRecord) -> None:
        path = self.directory / f"client_{client_id}.pt"
        partial = path.with_suffix(".partial")
        torch.save(record, partial)
        os.replace(partial, path)

    def get(self, client_id: int, device: torch.device) -> ClientRecord:
        return torch.load(self.directory / f"client_{client_id}.pt", map_location=device, weights_only=True)

    def close(self) -> None:
        self._remove()


class _HostParking:
    """Parked records as CPU tensors (pinned where a GPU can use that), for ranks computing on a GPU."""

    def __init__(self) -> None:
        self.records: dict[int, ClientRecord] = {}

    def put(self, client_id: int, record: ClientRecord) -> None:
        pin = torch.cuda.is_available()
        self.records[client_id] = _map_tensors(record, lambda t: t.detach().to("cpu", copy=True).pin_memory()
                                               if pin else t.detach().to("cpu", copy=True))

    def get(self, client_id: int, device: torch.device) -> ClientRecord:
        return _map_tensors(self.records[client_id], lambda t: t.to(device, non_blocking=True))

    def close(self) -> None:
        self.records.clear()


def _heap_trimmer() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``, or nothing elsewhere. Parking frees a model's tensors, and
    glibc's allocator raises its mmap threshold when large blocks are freed, so later models land
    in the heap and the freed space fragments it: at 1000 HtCNN8 clients with 64 resident the
    peak RSS grew 2.4 -> 2.8-3.1 GiB. Trimming returns the free pages to the system."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return lambda: None
    return lambda: trim(0)


_trim_heap = _heap_trimmer()


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_tensors(item, fn) for item in value]
    return value


class ClientStore(Mapping[int, ClientState]):
    """This rank's clients by id (a read-only mapping, iterated in id order).

    ``build(client_id, shell)`` makes a client with its data; ``shell=True`` means its weights
    are about to be overwritten by a parked record, so they need not be initialised (the meta
    device). Parked records go to host memory when ``park_in_memory`` (default: on a GPU), else
    to a scratch directory made in ``scratch_dir``. ``store[client_id]`` materialises the client
    (building or unparking it) and may park the least recently used one; a ``ClientState``
    obtained earlier must not be used after other clients were fetched (it may have been parked)."""

    def __init__(self, client_ids: list[int], build: Callable[[int, bool], ClientState], *,
                 resident: int, device: torch.device, rank: int, scratch_dir: Path | None = None,
                 park_in_memory: bool | None = None,
                 replaced_by_download: Callable[[ClientState], frozenset[str]] | None = None,
                 architecture_of: Callable[[int], str] | None = None,
                 recycle: Callable[[ClientState], None] | None = None) -> None:
        self.client_ids = sorted(client_ids)
        self._replaced_by_download = replaced_by_download or (lambda client: frozenset())
        self._architecture_of = architecture_of or (lambda client_id: "")
        self._fully_replaced: dict[str, bool] = {}
        """Per architecture: does the download replace every model entry (a fresh client's
        weights never matter)? Only asked when the algorithm says what its download replaces."""
        self._may_skip_initial_weights = replaced_by_download is not None
        """The algorithm's ``replaced_by_download``: what a parked record leaves out (FedAvg's whole
        model: its parked record holds the optimizer and buffers only)."""
        self._recycle = recycle or (lambda client: None)
        """Given each client :meth:`finished_with` lets go (the factory reuses its model as a shell)."""
        self._ids = set(self.client_ids)
        self._build = build
        self.limit = resident
        self.device = device
        self._resident: OrderedDict[int, ClientState] = OrderedDict()
        self._parked: set[int] = set()
        self._unchanged: set[int] = set()
        self._released: set[int] = set()
        """Clients let go by :meth:`finished_with` (they kept nothing); rebuilt as zeroed shells."""
        self._parking: _HostParking | _DiskParking | None = None
        if self.bounded:
            in_memory = device.type == "cuda" if park_in_memory is None else park_in_memory
            self._parking = _HostParking() if in_memory else _DiskParking(scratch_dir, rank)
        self._evictions = 0
        self.built = self.unparked = self.parked_count = 0
        """How often clients were built fresh, unparked and parked (benchmarks print them)."""

    @property
    def bounded(self) -> bool:
        return self.limit > 0

    @property
    def _parking_area(self) -> _HostParking | _DiskParking:
        """Where parked records go; only a bounded store parks (an unbounded one keeps every client resident)."""
        assert self._parking is not None, "an unbounded store parks nothing"
        return self._parking

    def __len__(self) -> int:
        return len(self.client_ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.client_ids)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._ids

    def __getitem__(self, client_id: int) -> ClientState:
        """The client, to be changed (trained, given knowledge): it is written out when parked."""
        client = self._fetch(client_id)
        self._unchanged.discard(client_id)
        return client

    def peek(self, client_id: int) -> ClientState:
        """The client, only to be read (evaluated without installing anything): if it leaves
        memory before anyone changes it, nothing needs writing."""
        arrives = client_id not in self._resident
        client = self._fetch(client_id)
        if arrives:  # a resident client keeps whatever state of change it has
            self._unchanged.add(client_id)
        return client

    def _fetch(self, client_id: int) -> ClientState:
        if client_id not in self._ids:
            raise KeyError(client_id)
        client = self._resident.get(client_id)
        if client is not None:
            self._resident.move_to_end(client_id)
            return client
        client = self._materialise(client_id)
        self._resident[client_id] = client
        while self.bounded and len(self._resident) > self.limit:
            self._park_oldest()
        return client

    def _materialise(self, client_id: int) -> ClientState:
        self._released.discard(client_id)
        if client_id not in self._parked:
            self.built += 1
            return self._fresh(client_id)
        client = self._build(client_id, True)
        restore_client(client, self._parking_area.get(client_id, self.device), f"parked client {client_id}")
        self.unparked += 1
        return client

    def _fresh(self, client_id: int) -> ClientState:
        """A client never used yet. Where the download replaces every entry of its model before
        any use (FedAvg), drawing initial weights is wasted: 50 fresh pfl CNNs a round took 1.9 s
        of a 13 s round. Then a shell with zeroed entries is as good and the same bits later; the
        architecture's answer is kept after its first client."""
        architecture = self._architecture_of(client_id)
        if not self._may_skip_initial_weights or self._fully_replaced.get(architecture) is False:
            return self._build(client_id, False)
        shell = self._build(client_id, True)
        if not self._download_replaces_whole_model(shell):
            return self._build(client_id, False)
        with torch.no_grad():
            for value in shell.model.state_dict().values():
                value.zero_()
        return shell

    def _download_replaces_whole_model(self, client: ClientState) -> bool:
        """Does the next download overwrite every model entry of ``client``? Asked once per
        architecture (the answer is the architecture's), so the round loop pays it once."""
        architecture = self._architecture_of(client.client_id)
        answer = self._fully_replaced.get(architecture)
        if answer is None:
            state = client.model.state_dict()
            answer = bool(state) and self._replaced_by_download(client) >= set(state)
            self._fully_replaced[architecture] = answer
        return answer

    def _park_oldest(self) -> None:
        """Evict the least recently used client; write its record unless it is unchanged since it
        was built from the seed or unparked (then what is parked, or the seed, still holds it)."""
        client_id, client = self._resident.popitem(last=False)
        if client_id in self._unchanged:
            self._unchanged.discard(client_id)
        else:
            self._parking_area.put(client_id, client_record(client, self._replaced_by_download(client)))
            self._parked.add(client_id)
            self.parked_count += 1
        del client  # the last reference: its tensors are freed before the trim below
        self._evictions += 1
        if self._evictions % self.limit == 0:  # once per K evictions: trimming every time cost 60 %
            _trim_heap()                       # of an evaluation round in page faults

    def finished_with(self, client_ids: Iterable[int]) -> None:
        """The caller holds these clients no longer (a trained group once its uploads are made, a
        tested client). One that keeps nothing between uses leaves memory: every model entry is
        replaced by the next download, and it has no optimizer state, no module state and no
        privacy ledger (FedAvg over the whole model with plain SGD). It comes back as the zeroed
        shell a fresh client is, where keeping it cost its whole model: pfl-research's 1,000 CNNs
        held 6.4 GB once every client had been tested. Its model goes to ``recycle`` (the factory
        makes it the next shell of its architecture): the caller's uploads never share its storage
        (``local_training.owned_upload``)."""
        if not self._may_skip_initial_weights:
            return
        for client_id in client_ids:
            client = self._resident.get(client_id)
            if client is None or not self._keeps_nothing(client):
                continue
            del self._resident[client_id]
            self._unchanged.discard(client_id)
            self._parked.discard(client_id)  # a parked record of it is stale now: it held nothing either
            self._released.add(client_id)
            self._recycle(client)

    def _keeps_nothing(self, client: ClientState) -> bool:
        return (self._download_replaces_whole_model(client) and client.private is None
                and not any(client.optimizer.state.values())
                and all(not module.state_dict() for module in client.modules.values()))

    def record(self, client_id: int) -> ClientRecord:
        """The client's current record, without making it resident (checkpoints read every client)."""
        client = self._resident.get(client_id)
        if client is not None:
            return client_record(client)
        if client_id in self._released:
            return self.compact_record(self._fresh(client_id))
        if client_id in self._parked:
            return self._parking_area.get(client_id, torch.device("cpu"))
        return client_record(self._build(client_id, False))

    def compact_record(self, client: ClientState) -> ClientRecord:
        """``client``'s record less what the next download replaces (what parking keeps)."""
        return client_record(client, self._replaced_by_download(client))

    def lend(self, client_id: int) -> ClientRecord | None:
        """The client's compact record, to train elsewhere this round (``runtime.lending``); None
        when it was never built (the borrower builds it from the seed). It stays here, and is
        not used until :meth:`restore` brings the trained state back."""
        if client_id not in self._ids:
            raise KeyError(client_id)
        client = self._resident.get(client_id)
        if client is not None:
            return self.compact_record(client)
        if client_id in self._parked:
            return self._parking_area.get(client_id, torch.device("cpu"))
        return None

    def borrow(self, client_id: int, record: ClientRecord | None, origin: str) -> ClientState:
        """Another rank's client, built here for one round's training from its ``record`` (None:
        from the seed); not one of this store's clients."""
        if record is None:
            return self._fresh(client_id)
        client = self._build(client_id, True)
        restore_client(client, record, origin)
        return client

    def restore(self, client_id: int, record: ClientRecord, origin: str) -> None:
        """Install a checkpoint's record for the client, parking it again if it is not resident."""
        client = self._resident.get(client_id)
        if client is not None:
            restore_client(client, record, origin)
            self._unchanged.discard(client_id)
            return
        shell = self._build(client_id, True)
        restore_client(shell, record, origin)  # checks architecture and modules before parking
        if not self.bounded:  # not built yet: it stays, as every client of an unbounded store does
            self._resident[client_id] = shell
            return
        self._parking_area.put(client_id, self.compact_record(shell))
        self._parked.add(client_id)

    def close(self) -> None:
        """Remove the parked records (scratch files); the store is not used afterwards."""
        if self._parking is not None:
            self._parking.close()
