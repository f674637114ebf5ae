"""What the algorithm tests share: a context and a client built as the runtime builds them, on
tiny random data; parameter rows; a state round trip through the checkpoint loader; the session's
shared two-round smoke run of an algorithm (launched once, in tests/conftest.py's single_run)."""
from __future__ import annotations

import io

import torch
from torch import nn

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.config import TrainConfig
from htfl_dist.models import SplitModel, initial_client_model

GROUP = "HtCNN8"


def make_context(algorithm, *, num_classes=3, feature_dim=4, batch_size=4, lr=0.05, num_clients=2,
                 group=GROUP, **options):
    entry = get_algorithm(algorithm)
    context = AlgorithmContext(num_classes=num_classes, feature_dim=feature_dim, seed=0,
                               train=TrainConfig(batch_size=batch_size, lr=lr), options=parse_options(entry, options),
                               num_clients=num_clients, model_group=group)
    return entry, context


def make_client(context, client_id=0, samples=9, data_seed=0):
    """A client built as the runtime builds it, on random 28×28 images with every class present."""
    model = initial_client_model(context.model_group, client_id, context.seed, num_classes=context.num_classes,
                                 feature_dim=context.feature_dim, in_channels=1, image_size=28)
    generator = torch.Generator().manual_seed(data_seed)
    x = torch.randn(samples, 1, 28, 28, generator=generator)
    y = torch.arange(samples) % context.num_classes
    return ClientState(client_id=client_id, architecture=context.model_group, model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=context.train.lr),
                       train_x=x, train_y=y, test_x=x, test_y=y, device=torch.device("cpu"))


def head_row(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).reshape(1, -1)


def head_upload(values, num_samples):
    return {"head": torch.tensor([values], dtype=torch.float32), "num_samples": torch.tensor([num_samples])}


def launch_smoke(single_run, algorithm, *overrides):
    """Two rounds of ``algorithm`` in one process on the smoke config (the session's shared run,
    the one the conformance test compares with 3 ranks), checked for learning and bytes."""
    _, rows = single_run(f"algorithm={algorithm}", "rounds=2", *overrides)
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert row["test_acc"] > 0.2  # 10 classes: chance is 0.1
        assert 1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.05, row
    return rows


def roundtrip(state):
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``, as checkpoints go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def tiny_identity_client(x, y, num_classes=2, extractor=None, lr=0.0) -> ClientState:
    """features = extractor(x) (default: x itself); a zero head that the optimizer does not hold,
    so the logits stay 0, CE = ln C, and no CE gradient ever reaches the features."""
    head = nn.Linear(2, num_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = SplitModel(extractor or nn.Identity(), head, feature_dim=2)
    trained = list(model.feature_extractor.parameters()) or list(head.parameters())  # Identity has none
    x, y = torch.tensor(x), torch.tensor(y)
    return ClientState(0, "tiny", model, torch.optim.SGD(trained, lr=lr), x, y, x, y, torch.device("cpu"))
