"""``train.cuda_graphs`` (issue 45 item 4) on the CPU: the schedule of recorded steps (warm-up,
recording, replays, eager partial batches) through a backend that records without running and
replays by running, as a CUDA graph does, so a client trained through it must equal eager bit
for bit; the fallback when a step cannot be recorded; and what start-up resolves and refuses.
The CUDA backend itself is compared with eager by the GPU suite."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, training
from htfl_dist.algorithms.class_rows import dense_prototypes
from htfl_dist.algorithms.fedproto import PrototypeOptions, prototype_regulariser
from htfl_dist.algorithms.step_graphs import WARMUP_STEPS
from htfl_dist.algorithms.training import gradient_clipper, run_local_training
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel
from htfl_dist.resolution import resolved_config
from htfl_dist.runtime.startup import step_graphs
from htfl_dist.seeding import torch_generator


class PlainGraphs:
    """Records nothing and runs nothing at the recording; each replay runs the step on whatever
    the static buffers hold then, which is what a CUDA graph's replay does."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.recordings = self.replays = self.warmups = 0

    @contextlib.contextmanager
    def warmup(self):
        self.warmups += 1
        yield

    def record(self, step, clear_gradients):
        self.recordings += 1
        if self.fails:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

        outputs: list[torch.Tensor] = []

        def replay():  # like a graph's: the same output tensors every time, overwritten in place
            self.replays += 1
            clear_gradients()  # a graph recorded from cleared gradients writes them afresh
            for index, value in enumerate(step()):
                outputs.append(value.clone()) if len(outputs) <= index else outputs[index].copy_(value)
            return tuple(outputs)
        return replay


def _client(seed: int = 0, count: int = 47) -> ClientState:
    torch.manual_seed(seed)
    model = SplitModel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2)), nn.Linear(8, 3), feature_dim=8)
    x = torch.randn(count, 4, generator=torch.Generator().manual_seed(seed))
    y = torch.arange(count) % 3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return ClientState(seed, "mlp", model, optimizer, x, y, x, y, torch.device("cpu"))


def _context(graphs: bool, epochs: int = 2, mode: str = "auto") -> AlgorithmContext:
    return AlgorithmContext(num_classes=3, feature_dim=8, seed=0, step_graphs=graphs,
                            train=TrainConfig(batch_size=10, local_epochs=epochs, cuda_graphs=mode), options=None)


def _train(client: ClientState, context: AlgorithmContext, seen_batches: list | None = None):
    torch.manual_seed(7)  # dropout's draws: the same stream on both sides
    clip = gradient_clipper(client.model.parameters(), 1.0)
    on_batch = None if seen_batches is None else seen_batches.append
    return run_local_training(client, context, lambda b: F.cross_entropy(b.logits, b.labels),
                              torch_generator(3, "batches"), before_step=clip, on_batch=on_batch)


def _same_client(a: ClientState, b: ClientState) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


@pytest.fixture
def backend(monkeypatch):
    made = PlainGraphs()
    monkeypatch.setattr(training, "CudaGraphs", lambda: made)
    return made


def test_a_recorded_client_trains_bit_for_bit_as_eager(backend):
    # 47 samples in batches of 10, two epochs: 4 full batches and a partial one per epoch, the
    # second epoch's full batches replayed after an eager partial batch in between
    recorded, eager = _client(), _client()
    recorded_batches, eager_batches = [], []
    assert _train(recorded, _context(True), recorded_batches) == _train(eager, _context(False), eager_batches)
    assert _same_client(recorded, eager)
    for a, b in zip(recorded.optimizer.state.values(), eager.optimizer.state.values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    for a, b in zip(recorded_batches, eager_batches, strict=True):  # what on_batch sees, batch by batch
        assert torch.equal(a.x, b.x) and torch.equal(a.features, b.features) and torch.equal(a.logits, b.logits)
    assert (backend.warmups, backend.recordings) == (WARMUP_STEPS, 1)
    assert backend.replays == 8 - WARMUP_STEPS  # every full batch after the warm-up, the recorded one included


def test_the_replays_hand_out_copies_that_the_next_replay_does_not_overwrite(backend):
    kept = []
    _train(_client(), _context(True, epochs=1), kept)
    features = [batch.features for batch in kept[:4]]
    assert all(not torch.equal(features[i], features[i + 1]) for i in range(3))


def test_a_step_that_cannot_be_recorded_trains_eagerly_and_says_so_once(monkeypatch, capsys):
    failing = PlainGraphs(fails=True)
    monkeypatch.setattr(training, "CudaGraphs", lambda: failing)
    monkeypatch.setattr(training, "_SAID_UNRECORDABLE", [])
    fallen, eager = _client(), _client()
    assert _train(fallen, _context(True)) == _train(eager, _context(False))
    assert _same_client(fallen, eager)
    _train(_client(1), _context(True))
    assert failing.recordings == 2  # one try per client and round, then eager to its end
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["train.cuda_graphs=auto: the local step cannot be recorded as a CUDA graph (operation not "
                     "permitted when stream is capturing); its clients train eagerly"]
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs=on: the local step cannot be recorded"):
        _train(_client(), _context(True, mode="on"))


def _config(*overrides: str):
    return resolved_config(None, list(overrides))


def test_start_up_records_only_where_it_can_and_on_refuses_in_one_line():
    cuda = torch.device("cuda")  # a device object needs no GPU: nothing runs on it here
    assert step_graphs(_config(), get_algorithm("fedproto"), cuda) == (False, "")  # off by default
    assert step_graphs(_config("train.cuda_graphs=auto"), get_algorithm("fedproto"), cuda) == (True, "")
    recorded, why = step_graphs(_config("train.cuda_graphs=auto"), get_algorithm("fedproto"), torch.device("cpu"))
    assert not recorded and why == "the device is cpu, not a CUDA GPU"
    recorded, why = step_graphs(_config("algorithm=fedgen", "train.cuda_graphs=auto"), get_algorithm("fedgen"), cuda)
    assert not recorded and why == "fedgen's local step is not declared capturable (these are: fedproto, fedtgp, local)"
    assert step_graphs(_config("algorithm=fedtgp", "train.cuda_graphs=auto"), get_algorithm("fedtgp"), cuda) == \
        (True, "")  # FedTGP's clients take FedProto's step; FedOC's and FPL's, with losses of their own, do not
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs=on cannot record the local steps: the device is "
                                          r"cpu, not a CUDA GPU; train\.compile is on"):
        step_graphs(_config("train.cuda_graphs=on", "train.compile=default"), get_algorithm("fedproto"),
                    torch.device("cpu"))


def test_the_context_carries_the_resolution_and_the_mode_is_another_experiment():
    assert not AlgorithmContext(num_classes=2, feature_dim=2, seed=0, train=TrainConfig(), options=None).step_graphs
    assert "cuda_graphs" not in _config().experiment()["train"]
    assert _config("train.cuda_graphs=auto").experiment()["train"]["cuda_graphs"] == "auto"
    assert dataclasses.fields(AlgorithmContext)[-1].name == "step_graphs"


def _gpu_client(seed: int = 0) -> ClientState:
    """A conv client on the GPU without dropout: every kernel of its step is deterministic, so
    replays must give eager's bits."""
    torch.manual_seed(seed)
    model = SplitModel(nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 26 * 26, 32)),
                       nn.Linear(32, 10), feature_dim=32).cuda()
    x = torch.randn(95, 1, 28, 28, generator=torch.Generator().manual_seed(seed + 1)).cuda()
    y = (torch.arange(95) % 10).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return ClientState(seed, "conv", model, optimizer, x, y, x, y, torch.device("cuda"))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="CUDA graphs need a GPU: the GPU suite runs this test")


@needs_gpu
def test_on_a_gpu_recorded_steps_equal_eager_bit_for_bit():
    recorded, eager = _gpu_client(), _gpu_client()
    assert _train(recorded, _context(True, epochs=3)) == _train(eager, _context(False, epochs=3))
    assert _same_client(recorded, eager)


@needs_gpu
@pytest.mark.parametrize("where", ["main thread", "pool thread"])
def test_on_a_gpu_every_client_of_a_thread_records_after_the_last_ones_graph_is_gone(where):
    """A thread's clients one after another, each recording (``on``: a failure raises) after the
    previous client's steps and graph were dropped: torch 2.11 asserts in the allocator when a
    recording reuses a pool none of whose graphs lives, which left every client after a thread's
    first training eagerly."""
    def clients_one_after_another() -> list[bool]:
        same = []
        for seed in range(3):
            recorded, eager = _gpu_client(seed), _gpu_client(seed)
            same.append(_train(recorded, _context(True, mode="on")) == _train(eager, _context(False))
                        and _same_client(recorded, eager))
            del recorded, eager
            gc.collect()
        return same

    if where == "main thread":
        assert clients_one_after_another() == [True, True, True]
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert pool.submit(clients_one_after_another).result() == [True, True, True]


@needs_gpu
@pytest.mark.parametrize("client_reg", ["htfllib", "paper"])
def test_on_a_gpu_fedproto_steps_with_global_prototypes_record_bit_for_bit(client_reg):
    """FedProto's loss once global prototypes exist (CE + λ·φ, two classes without a prototype):
    recorded steps equal eager in loss and parameters (a round-2 train_loss once differed in its
    8th digit between recorded and eager clients of a run)."""
    options = PrototypeOptions(reg_weight=0.1, client_reg=client_reg)  # λ = 10 diverges at this client's lr
    class_ids = torch.tensor([0, 1, 2, 3, 5, 6, 7, 9])
    knowledge = {"class_ids": class_ids, "protos": torch.randn(8, 32, generator=torch.Generator().manual_seed(4))}
    table, available = dense_prototypes(knowledge, 10, "cuda")

    def loss_fn(batch):
        return F.cross_entropy(batch.logits, batch.labels) + prototype_regulariser(
            options, batch.features, batch.labels, table, available)

    def train(client: ClientState, graphs: bool):
        return run_local_training(client, _context(graphs, epochs=3, mode="on"), loss_fn, torch_generator(3, "batches"))

    recorded, eager = _gpu_client(), _gpu_client()
    recorded_loss, eager_loss = train(recorded, True), train(eager, False)
    assert math.isfinite(eager_loss[0])  # a diverged client would make the comparison meaningless
    assert _same_client(recorded, eager), "the parameters differ"
    assert recorded_loss == eager_loss, "the parameters agree; the loss sums differ"
