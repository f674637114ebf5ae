"""How much training one sample costs on an architecture, for placing clients on ranks.

Placement must be the same on every rank without a message, so the cost is counted, not timed:
the forward pass of the model built on the meta device (no memory, no compute) under torch's
``FlopCounterMode``, per sample. A training step is about three forward passes (forward, and a
backward that costs about two), the same factor for every architecture, so the forward count
ranks architectures as training does. The HtCNN8 members differ about 2x in it; optimizer and
per-step overheads, which grow with the parameter count and the number of batches rather than
with samples, are not counted (bench/arch_cost.py compares the count with measured step times).
"""
from __future__ import annotations

import functools

import torch
from torch.utils.flop_counter import FlopCounterMode

from .registry import build_model


@functools.cache
def forward_flops_per_sample(member: str, *, num_classes: int, feature_dim: int, in_channels: int,
                             image_size: int) -> float:
    """Floating-point operations of one sample's forward pass through ``member`` (ARCH or
    ARCH:HEAD), counted on the meta device in eval mode (BatchNorm needs no batch statistics)."""
    with torch.device("meta"):
        model = build_model(member, num_classes=num_classes, feature_dim=feature_dim,
                            in_channels=in_channels, image_size=image_size)
        sample = torch.empty(1, in_channels, image_size, image_size)
    model.eval()
    with FlopCounterMode(display=False) as counter:
        model(sample)
    return float(counter.get_total_flops())
