"""Local SGD steps recorded once as a CUDA graph and replayed (``train.cuda_graphs``, issue 45
item 4).

Why: a batch-10 step of HtFLlib's small CNNs launches a few hundred tiny kernels, and on a GPU
the step waits on those launches and the Python around them, not on arithmetic (one process kept
an H100 busy 11 % of the time). A graph replays the whole step — forward, the algorithm's loss,
backward, clipping, every optimiser's step — as one launch.

How, per client and round (``run_local_training`` drives it):

- the first ``WARMUP_STEPS`` full batches train eagerly on a side stream (what capture needs:
  lazily built optimiser state, cuBLAS workspaces); they are ordinary steps;
- the next full batch is copied into static input buffers and the step recorded; recording runs
  nothing, so the graph is then replayed for that batch, and for every later full batch after its
  rows are copied into the same buffers;
- a trailing partial batch runs eagerly in its place in the order (the graph's shapes are fixed).

Recording once per (client, round) rather than once per client means nothing the loss reads has
to stay at one address across rounds: the round's knowledge (global prototypes, guides) is fixed
while a client trains, and so is its learning rate, which SGD bakes into the graph. The cost, a
few eager steps and a capture per client-round, is small beside the hundreds of steps a
client-round takes. A step that cannot be recorded (a host sync in the loss, an optimiser that
is not capturable) raises in the recording; the caller then trains eagerly and says so once.

The recording is behind :class:`GraphBackend` so that the schedule — which batch is eager, which
is recorded, which replayed, and that results equal eager — is tested on a CPU with a backend that
simply runs the step; the CUDA backend is exercised by the GPU suite.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

WARMUP_STEPS = 2
"""Eager full-batch steps before the recording (PyTorch's CUDA-graph notes warm up on a side
stream before capturing; optimiser state and library workspaces are built there)."""

StepOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(loss, features, logits) of one step, detached."""


class GraphBackend(Protocol):
    """How steps are warmed up and recorded: CUDA graphs on a GPU, plain calls in the CPU tests."""

    def warmup(self) -> contextlib.AbstractContextManager[None]:
        """Where the eager warm-up steps run."""
        ...

    def record(self, step: Callable[[], StepOutputs], clear_gradients: Callable[[], None]
               ) -> Callable[[], StepOutputs]:
        """Record ``step`` (which reads the static buffers) without running it; returns the replay,
        which runs it and gives its outputs. Each replay's backward must write the gradients, not
        add to them: a CUDA graph recorded from cleared gradients does so by itself; a backend
        that runs ``step`` eagerly calls ``clear_gradients`` first."""
        ...


_THREAD_STREAMS = threading.local()


def thread_stream(purpose: str, device: torch.device | None = None) -> torch.cuda.Stream:
    """The calling thread's CUDA stream for ``purpose`` (on ``device``, else the current one),
    made on first use and kept: ``torch.cuda.Stream()`` hands out one of a fixed set of pooled
    streams in turn (32 per priority), so a stream asked for per call would in time be another
    thread's. Made once per thread and purpose, a run's streams stay a handful of the 32."""
    streams: dict[str, torch.cuda.Stream] = _THREAD_STREAMS.__dict__.setdefault("streams", {})
    if purpose not in streams:
        streams[purpose] = torch.cuda.Stream(device)
    return streams[purpose]


class CudaGraphs:
    """The real backend: warm-up and recording on a side stream of the thread's own, every graph
    of a thread drawing on the thread's memory pool (a graph freed after its client's round
    returns its blocks to the pool for the next).

    Clients trained side by side (``train.concurrent_clients``) record in threads of their own,
    and nothing of one thread's recording may touch another's:

    - streams: ``torch.cuda.Stream()`` hands out one of a fixed set of pooled streams in turn (32
      per priority), so a stream asked for per call would in time be another thread's, even the
      one it records on; each thread's side stream is made once and kept (with the training
      threads' own, a handful of the 32);
    - memory: graphs replayed at the same time must not share a pool, so each thread has one. The
      handle (``torch.cuda.graph_pool_handle()``) is only an id: the allocator keeps the pool while
      a graph recorded into it lives, and a recording into a pool whose graphs are all gone fails
      an internal assert (``beginAllocateToPool``: ``use_count > 0``, torch 2.11 on an H200, with
      every client after a thread's first). So each thread keeps its latest graph until its next
      recording has begun: the pool always has a live graph, and at most one graph that will not
      be replayed again (a client's round is over before the thread's next client records);
    - recording: ``capture_begin``/``capture_end`` on the side stream, not ``torch.cuda.graph``,
      which synchronises the device and empties the allocator's cache before every recording
      (once per client and round: it would drain every other thread's work); recordings still
      take turns (one lock), and a pool thread records in ``thread_local`` mode, so the other
      threads' allocations do not invalidate it (the main thread keeps CUDA's ``global`` check).

    The warm-up's outputs are made on the side stream and read on the thread's stream, which
    waits for it; the side stream waits for the thread's stream before its next use, so memory
    freed from those outputs is not reused before they are read."""

    _slots = threading.local()
    """Per thread: its pool handle (``torch.cuda.graph_pool_handle()``), made on first use, and its
    latest graph (``latest``), which keeps the pool alive for the next recording."""
    _recording = threading.Lock()

    @staticmethod
    def side_stream() -> torch.cuda.Stream:
        """This thread's side stream (made once, kept)."""
        return thread_stream("graphs")

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        side = self.side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def record(self, step: Callable[[], StepOutputs], clear_gradients: Callable[[], None]
               ) -> Callable[[], StepOutputs]:
        slots = CudaGraphs._slots
        if getattr(slots, "pool", None) is None:
            slots.pool = torch.cuda.graph_pool_handle()
        side = self.side_stream()
        side.wait_stream(torch.cuda.current_stream())  # the static inputs were written on the thread's stream
        mode = "global" if threading.current_thread() is threading.main_thread() else "thread_local"
        graph = torch.cuda.CUDAGraph()
        with CudaGraphs._recording, torch.cuda.stream(side):
            graph.capture_begin(pool=slots.pool, capture_error_mode=mode)
            try:
                outputs = step()
            finally:
                graph.capture_end()
        slots.latest = graph  # the one it replaces is released now, its pool held by this one
        torch.cuda.current_stream().wait_stream(side)

        def replay() -> StepOutputs:
            graph.replay()
            return outputs
        return replay


class RecordedSteps:
    """One client's full-batch steps in one round: eager for the first ``WARMUP_STEPS``, then
    recorded on the next and replayed from then on. ``step(x, y)`` is the whole update on a batch
    (gradients are None when it starts: backward writes them, it does not add to them)."""

    def __init__(self, backend: GraphBackend, step: Callable[[torch.Tensor, torch.Tensor], StepOutputs],
                 clear_gradients: Callable[[], None]) -> None:
        self.backend = backend
        self.step = step
        self.clear_gradients = clear_gradients
        self.eager_steps = 0
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None
        self.replay: Callable[[], StepOutputs] | None = None
        self.replays = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> StepOutputs:
        if self.replay is None and self.eager_steps < WARMUP_STEPS:
            self.eager_steps += 1
            self.clear_gradients()
            with self.backend.warmup():
                return self.step(x, y)
        if self.static is None:
            static_x, static_y = x.clone(), y.clone()
            self.static = static_x, static_y
            self.clear_gradients()  # recorded from None: a replay's backward writes, never adds
            self.replay = self.backend.record(lambda: self.step(static_x, static_y), self.clear_gradients)
        else:
            self.static[0].copy_(x)
            self.static[1].copy_(y)
        assert self.replay is not None
        self.replays += 1
        loss, features, logits = self.replay()
        # the next replay overwrites the graph's outputs: hand out copies (FedProto keeps features)
        return loss.clone(), features.clone(), logits.clone()
