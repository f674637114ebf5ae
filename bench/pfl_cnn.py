"""The CNN of pfl-research's CIFAR-10 benchmark, as our own torch module (torch only: both our
plugin, bench/pfl_workload.py, and the pfl runner, bench/pfl_runner.py, build it, so both sides
train the same layers). Read from apple/pfl-research commit c9d1f32f6e84,
``benchmarks/model/pytorch/cnn.py`` ``simple_cnn``: Conv2d(C, 32, 3) · ReLU · Conv2d(32, 64, 3) ·
ReLU · MaxPool2d(2) · Dropout(0.25) · Flatten · Linear(14·14·64, 128) · ReLU · Dropout(0.5) ·
Linear(128, 10), conv and linear weights Glorot-uniform, biases at torch's default. pfl's model
takes NHWC pictures and transposes them first (its ``Transpose2D``); these layers take NCHW."""
from __future__ import annotations

from torch import nn

HIDDEN = 128
"""pfl's dense width, which is K (``model.feature_dim``) in our split."""


def pfl_cnn_layers(*, in_channels: int, image_size: int, hidden: int, num_classes: int
                   ) -> tuple[nn.Sequential, nn.Linear]:
    """(everything up to the second dropout, the last Linear): the cut our SplitModel needs."""
    pooled = (image_size - 4) // 2  # two unpadded 3x3 convolutions, then a 2x2 max pool
    if pooled < 1:
        raise ValueError(f"pfl's CNN needs pictures of at least 6 x 6, not {image_size} x {image_size}")
    extractor = nn.Sequential(
        nn.Conv2d(in_channels, 32, kernel_size=3), nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
        nn.Linear(pooled * pooled * 64, hidden), nn.ReLU(), nn.Dropout(0.5))
    head = nn.Linear(hidden, num_classes)
    for module in (extractor, head):
        for layer in module.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(layer.weight)
    return extractor, head
