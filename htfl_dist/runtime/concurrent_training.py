"""Several of a rank's participants trained at once (``train.concurrent_clients``, issue 45 item 5).

Why: on a GPU a batch-10 step of a small CNN launches hundreds of tiny kernels, and one client
training alone leaves the GPU idle between them (one process kept an H100 busy 11 % of the
time). Clients of one round are independent until their uploads meet, so N of them train side by
side, each in a thread of its own and, on a GPU, on a CUDA stream of its own: while one thread is
in Python, the others' kernels run. Torch releases the GIL inside its operators and graph
replays, so the threads overlap even on a CPU (where a rank usually has one core, and auto keeps
one at a time).

What keeps the numbers those of one at a time:

- every stream a client draws from explicitly is its own already (batches: (seed, client,
  round)); its model, optimiser and modules are its own; the knowledge is only read;
- torch's global RNG (dropout draws from it) is shared by the threads, so an architecture's first
  client of the run trains alone while the global generators are watched: if it drew, that
  architecture's clients train one at a time for the rest of the run (said once). A draw by a
  client that trains beside others is caught after the group (the generators' state moved) and
  ends the run naming the clients (:class:`DrewWhileConcurrent`); when nobody drew, the global RNG
  is left as one-at-a-time training leaves it (seeded for the last client);
- results are handed back in client-id order, and on a GPU each thread waits for its stream
  before handing its client back, so the round loop sees finished tensors.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from htfl_dist.algorithms.step_graphs import thread_stream
from htfl_dist.errors import DrewWhileConcurrent

Outcome = TypeVar("Outcome")

WIDTHS = (1, 2, 4, 8)
"""The widths auto tries, in order (each doubling what the last one ran)."""

GAIN_TO_GROW = 1.10
"""auto widens while the next width trains at least 10 % more samples a second; below that the
extra threads' Python and memory buy too little."""

WARMUP_GROUPS = 1
"""Groups at each width left out of auto's measure: the first pays one-off costs (CUDA's and
cuDNN's start, a graph pool's and the allocator's growth, new threads and streams)."""

OBSERVATIONS = 3
"""Groups measured at each width (after ``WARMUP_GROUPS``) before auto compares it, by their median."""


def global_rng_state(device: torch.device) -> tuple[bytes, ...]:
    """Torch's process-wide generators as bytes: the CPU's, and the device's on a GPU. Any draw
    from them (dropout, ``torch.rand`` without a generator) changes this."""
    states = [torch.default_generator.get_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return tuple(bytes(state.numpy().tobytes()) for state in states)


class WidthTuner:
    """How many clients train at once: a fixed width, or auto's choice from measured samples per
    second — 1, then 2, 4, 8 while each trains at least ``GAIN_TO_GROW`` times faster than the
    best so far; the first width that does not is dropped and the best is kept for the run. A
    round in which no group as wide as the width tried ran (fewer clients on the rank, or
    architectures that train alone in between) ends the trial at the best so far.

    Limits, said: groups of different widths hold different clients, and in a group of several
    architectures their step costs differ, so a rate is the mix's; the median of
    ``OBSERVATIONS`` groups after a warm-up is what keeps one group's mix from deciding."""

    def __init__(self, asked: int, cap: int) -> None:
        self.cap = max(1, cap)
        self.fixed = min(asked, self.cap) if asked > 0 else None
        self.candidates = [width for width in WIDTHS if width <= self.cap] or [1]
        self.trying = 0
        self.groups: dict[int, int] = {}
        """Groups seen at each width, warm-up included."""
        self.rates: dict[int, list[float]] = {}
        self.best: tuple[int, float] | None = None
        self.settled: int | None = self.fixed
        self.full_group_this_round = False

    def width(self) -> int:
        return self.settled if self.settled is not None else self.candidates[self.trying]

    def observe(self, width: int, samples: int, seconds: float) -> None:
        """One group of ``width`` clients trained ``samples`` samples in ``seconds``."""
        if self.settled is not None or width != self.width() or seconds <= 0:
            return
        self.full_group_this_round = True
        self.groups[width] = self.groups.get(width, 0) + 1
        if self.groups[width] <= WARMUP_GROUPS:
            return
        rates = self.rates.setdefault(width, [])
        rates.append(samples / seconds)
        if len(rates) < OBSERVATIONS:
            return
        rate = statistics.median(rates)
        if self.best is None or rate >= self.best[1] * GAIN_TO_GROW:
            self.best = (width, rate)
            self.trying += 1
            if self.trying < len(self.candidates):
                return
        self.settled = self.best[0]

    def round_over(self) -> None:
        """A round ended: without a group as wide as the width tried, that width cannot be
        measured on this rank, and auto keeps the best so far (one at a time if none)."""
        if self.settled is None and not self.full_group_this_round:
            self.settled = self.best[0] if self.best is not None else 1
        self.full_group_this_round = False


class ConcurrentTraining:
    """A rank's training threads and the decisions around them (one per rank, kept for the run)."""

    def __init__(self, asked: int, cap: int, device: torch.device, architecture_of: Callable[[int], str],
                 where: str = "") -> None:
        self.device = device
        self.tuner = WidthTuner(asked, cap)
        self.architecture_of = architecture_of
        self.where = where
        self.draws: dict[str, bool] = {}
        """Per architecture: whether its first client's training drew from the global RNG."""
        self._pool: ThreadPoolExecutor | None = None
        self._said: set[str] = set()
        self._round: int | None = None

    def next_group(self, pending: list[int]) -> list[int]:
        """Take the next clients to train together off the front of ``pending`` (client-id
        order): one alone where its architecture is not known to draw nothing, else up to the
        width of consecutive ones whose architectures draw nothing."""
        group = [pending.pop(0)]
        if self.draws.get(self.architecture_of(group[0]), True):
            return group
        while pending and len(group) < self.tuner.width() and self.draws.get(self.architecture_of(pending[0])) is False:
            group.append(pending.pop(0))
        return group

    def train(self, client_ids: list[int], seed_for: Callable[[int], None], train_one: Callable[[int], Outcome],
              samples_of: Callable[[Outcome], int], round_index: int) -> list[Outcome]:
        """``train_one`` of each client of a group from :meth:`next_group`, in client-id order:
        one in this thread after ``seed_for`` it, or several side by side in the pool."""
        if round_index != self._round:
            if self._round is not None:
                self.tuner.round_over()
            self._round = round_index
        started = time.perf_counter()
        if len(client_ids) == 1:
            outcomes = [self._alone(client_ids[0], seed_for, train_one)]
        else:
            outcomes = self._together(client_ids, train_one, round_index)
            seed_for(client_ids[-1])  # the global RNG as one-at-a-time training leaves it
        self.tuner.observe(len(client_ids), sum(samples_of(outcome) for outcome in outcomes),
                           time.perf_counter() - started)
        self._say_width()
        return outcomes

    def _alone(self, client_id: int, seed_for: Callable[[int], None], train_one: Callable[[int], Outcome]) -> Outcome:
        architecture = self.architecture_of(client_id)
        seed_for(client_id)
        if architecture in self.draws:
            return train_one(client_id)
        before = global_rng_state(self.device)
        outcome = train_one(client_id)
        self.draws[architecture] = global_rng_state(self.device) != before
        if self.draws[architecture]:
            self._say(f"train.concurrent_clients: {architecture}'s training draws from torch's global RNG "
                      f"(dropout?), which threads share; its clients train one at a time")
        return outcome

    def _together(self, client_ids: list[int], train_one: Callable[[int], Outcome], round_index: int) -> list[Outcome]:
        before = global_rng_state(self.device)
        main_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        grad_mode = torch.is_grad_enabled()
        futures = [self._threads().submit(self._on_slot, train_one, client_id, main_stream, grad_mode)
                   for client_id in client_ids]
        outcomes, failure = [], None
        for future in futures:  # every thread finishes before anything is raised
            try:
                outcomes.append(future.result())
            except BaseException as error:
                failure = failure or error
        if failure is not None:
            raise failure
        if global_rng_state(self.device) != before:
            raise DrewWhileConcurrent(
                f"clients {client_ids} drew from torch's global RNG while training side by side in round "
                f"{round_index + 1} (train.concurrent_clients), so their draws depended on timing; their "
                f"architectures' first clients drew nothing. Use train.concurrent_clients=1")
        return outcomes

    def _on_slot(self, train_one: Callable[[int], Outcome], client_id: int, main_stream: torch.cuda.Stream | None,
                 grad_mode: bool) -> Outcome:
        """One client in a pool thread: on a GPU on the thread's own stream, which first waits
        for what the main stream queued (the download, the client's data) and is drained before
        the client is handed back."""
        with torch.set_grad_enabled(grad_mode):
            if main_stream is None:
                return train_one(client_id)
            stream = thread_stream("training", self.device)
            stream.wait_stream(main_stream)
            try:
                with torch.cuda.stream(stream):
                    return train_one(client_id)
            finally:
                stream.synchronize()  # failed or not: nothing of it still runs when the group ends

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            threads = torch.get_num_threads()  # OpenMP's thread count is per thread: new ones start at the default
            self._pool = ThreadPoolExecutor(max_workers=self.tuner.cap, thread_name_prefix="htfl-client",
                                            initializer=torch.set_num_threads, initargs=(threads,))
        return self._pool

    def _say_width(self) -> None:
        tuner = self.tuner
        if tuner.fixed is None and tuner.settled is not None and tuner.rates:
            rates = ", ".join(f"{width}: {statistics.median(rates):.0f}" for width, rates in tuner.rates.items())
            self._say(f"train.concurrent_clients=auto: {tuner.settled} at once (samples/s by width: {rates})")

    def _say(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            prefix = f"{self.where}: " if self.where else ""
            print(prefix + line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
