"""How much training one sample costs on an architecture, for placing clients on ranks.

Two estimates. Counted (``forward_flops_per_sample``): the same on every rank without a message,
the forward pass of the model built on the meta device (no memory, no compute) under torch's
``FlopCounterMode``, per sample. A training step is about three forward passes (forward, and a
backward that costs about two), the same factor for every architecture, so the forward count
ranks architectures as training does. The HtCNN8 members differ about 2x in it; optimizer and
per-step overheads, which grow with the parameter count and the number of batches rather than
with samples, are not counted (bench/arch_cost.py compares the count with measured step times).
Timed (``timed_step_seconds``): real SGD steps on the device, which see those costs too (on this
project's 2-core CPU a batch-10 step of the widest HtCNN8 members costs 2.3x the cheapest while
their FLOPs differ 2.1x, and members with equal FLOPs differ 1.7x); one rank times, the others
receive its figures.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from .inputs import InputSpec
from .registry import build_model

_FLOPS: dict[tuple[Any, ...], float] = {}
"""Counted forward FLOPs by (member, classes, K, inputs, model options as text): every rank asks
once per member at start-up and again for unseen clients and participation, never differently."""


def forward_flops_per_sample(member: str, *, num_classes: int, feature_dim: int, in_channels: int = 3,
                             image_size: int = 32, inputs: InputSpec | None = None,
                             options: Mapping[str, Any] | None = None) -> float:
    """Floating-point operations of one sample's forward pass through ``member`` (ARCH or
    ARCH:HEAD) for ``inputs`` (default: square pictures) and ``options`` (``model.options``, as
    in ``build_model``), counted in eval mode (BatchNorm needs no batch statistics) on the meta
    device (text models on the CPU: packing sequences reads lengths). Cached; the options enter
    the key as text, since their values (lists among them) need not be hashable."""
    inputs = inputs or InputSpec.image(in_channels, image_size)
    key = (member, num_classes, feature_dim, inputs, repr(sorted((options or {}).items())))
    if key not in _FLOPS:
        device = "cpu" if inputs.kind == "text" else "meta"
        with torch.random.fork_rng(devices=[]), torch.device(device):
            model = build_model(member, num_classes=num_classes, feature_dim=feature_dim, inputs=inputs,
                                options=options)
            sample = inputs.example(1, device)
        model.eval()
        with FlopCounterMode(display=False) as counter:
            model(sample)
        _FLOPS[key] = float(counter.get_total_flops())
    return _FLOPS[key]


TIMED_WARMUP_STEPS = 1
TIMED_PASSES = 7
TIMED_MIN_PASSES = 3
TIMED_BUDGET_S = 2.0
"""At most ``TIMED_PASSES`` timed passes over the members, and no more than ``TIMED_MIN_PASSES``
once the timed passes took ``TIMED_BUDGET_S``: HtCNN8 on a CPU gets all 7 in about a second,
while HtFE8's ResNet-152 (1.3 s a step on a CPU) would hold start-up for 29 s."""


def timed_step_seconds(members: list[str], *, num_classes: int, feature_dim: int, batch_size: int,
                       device: torch.device, in_channels: int = 3, image_size: int = 32,
                       inputs: InputSpec | None = None, options: Mapping[str, Any] | None = None
                       ) -> dict[str, float]:
    """Seconds of one plain-SGD cross-entropy step of each member at ``batch_size`` (at least 2,
    for BatchNorm) on ``device``, on random data of the config's shape: the fastest of up to
    ``TIMED_PASSES`` steps after warm-up (see ``TIMED_BUDGET_S``). The passes go over the members
    in turn, so a burst of background load hits them alike, and the fastest step is the one least
    disturbed by it (a median of 5 steps in a row swung from 18 to 28 ms for htcnn5 on a 2-core
    VM; this, 15.9 to 16.5). Torch's global RNG is restored afterwards, so timing never changes
    what a run computes. ``inputs`` and ``options`` as in ``build_model`` (default: square pictures,
    every option at its default)."""
    batch_size = max(batch_size, 2)
    inputs = inputs or InputSpec.image(in_channels, image_size)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        images = _random_inputs(inputs, batch_size).to(device)
        labels = torch.randint(num_classes, (batch_size,)).to(device)
        steps = {}
        for member in members:
            model = build_model(member, num_classes=num_classes, feature_dim=feature_dim,
                                inputs=inputs, options=options).to(device).train()
            steps[member] = _sgd_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), images, labels)
            for _ in range(TIMED_WARMUP_STEPS):
                steps[member]()
        fastest = dict.fromkeys(members, float("inf"))
        began_timing = time.perf_counter()
        for done in range(TIMED_PASSES):
            if done >= TIMED_MIN_PASSES and time.perf_counter() - began_timing > TIMED_BUDGET_S:
                break
            for member in members:
                began = time.perf_counter()
                steps[member]()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                fastest[member] = min(fastest[member], time.perf_counter() - began)
    return fastest


def _random_inputs(inputs: InputSpec, batch_size: int) -> torch.Tensor:
    """A batch of random samples of ``inputs``' kind (text: random ids, every length full)."""
    if inputs.kind != "text":
        return torch.randn(batch_size, *inputs.shape)
    rows = inputs.example(batch_size)
    rows[:, :-1] = torch.randint(inputs.vocab_size, (batch_size, inputs.shape[0]))
    return rows


def _sgd_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor,
              labels: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
