"""``train.compile`` (issue 45 item 6): which steps take the compiled forward, that every client
of an architecture replays one graph, and that a compiled step trains as the eager one does.
Dynamo's ``aot_eager`` backend stands in for Inductor here: the same tracing and AOTAutograd
backward without generating kernels (Inductor's C++ build takes a minute on a 2-core CPU; the
GPU suite and bench/compile_step.py run the real modes)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms import AlgorithmContext, ClientState, training
from htfl_dist.algorithms.training import eager_forward, model_forward, run_local_training
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel
from htfl_dist.resolution import resolved_config
from htfl_dist.seeding import torch_generator


def _client(seed: int, count: int = 25) -> ClientState:
    torch.manual_seed(seed)
    model = SplitModel(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 3), feature_dim=8)
    x = torch.randn(count, 4, generator=torch.Generator().manual_seed(seed))
    y = torch.arange(count) % 3
    return ClientState(seed, "mlp", model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, x, y,
                       torch.device("cpu"))


def _context(compile_mode: str) -> AlgorithmContext:
    return AlgorithmContext(num_classes=3, feature_dim=8, seed=0,
                            train=TrainConfig(batch_size=10, compile=compile_mode), options=None)


def _cross_entropy(batch):
    return F.cross_entropy(batch.logits, batch.labels)


@pytest.fixture
def recording_compile(monkeypatch):
    """torch.compile replaced by a wrapper that counts the batch sizes it is called with."""
    calls: list[int] = []
    made: list[dict] = []

    def fake_compile(fn, **kwargs):
        made.append(kwargs)

        def compiled(model, x):
            calls.append(x.shape[0])
            return fn(model, x)
        return compiled
    monkeypatch.setattr(training, "_COMPILED_FORWARDS", {})
    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls, made


def test_off_is_the_eager_forward():
    assert model_forward("off", "cpu") is eager_forward


def test_full_batches_take_the_compiled_forward_and_the_trailing_one_stays_eager(recording_compile):
    calls, made = recording_compile
    client = _client(0)  # 25 samples in batches of 10: 10, 10 and an eager 5
    _, seen = run_local_training(client, _context("default"), _cross_entropy, torch_generator(0, "b"))
    assert seen == 25 and calls == [10, 10]
    run_local_training(_client(1), _context("default"), _cross_entropy, torch_generator(0, "b"))
    assert made == [{"mode": "default", "dynamic": False}]  # compiled once for the process, shapes static


def test_every_client_of_an_architecture_replays_one_graph_and_trains_as_eager(monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(training, "_COMPILED_FORWARDS", {})
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    compiled = [_client(seed) for seed in range(3)]
    eager = [_client(seed) for seed in range(3)]
    for mine, reference in zip(compiled, eager, strict=True):
        loss, _ = run_local_training(mine, _context("default"), _cross_entropy, torch_generator(mine.client_id, "b"))
        expected, _ = run_local_training(reference, _context("off"), _cross_entropy,
                                         torch_generator(reference.client_id, "b"))
        assert loss == pytest.approx(expected, rel=1e-5)
        for a, b in zip(mine.model.parameters(), reference.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1  # three clients, one architecture, one batch shape
    torch._dynamo.reset()


def test_compile_beside_batched_clients_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train\.compile=default compiles a client's own forward pass; "
                                          r"train\.client_batching=vmap"):
        TrainConfig(compile="default", client_batching="vmap").check()


def test_a_compiled_run_is_another_experiment():
    assert "compile" not in resolved_config(None, []).experiment()["train"]
    assert resolved_config(None, ["train.compile=reduce-overhead"]).experiment()["train"]["compile"] == \
        "reduce-overhead"
