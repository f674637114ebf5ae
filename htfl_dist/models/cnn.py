"""Small plain CNNs: FedAvg's 4-layer CNN (``cnn``) and the HtCNN8 set (``htcnn1``..``htcnn8``).

All share one pattern, so one builder makes them all: a stack of
``conv5x5 (no padding) -> ReLU -> 2x2 max pool`` blocks, flatten, then fully connected layers
each followed by ReLU. The output of the last fc (after its ReLU) is the feature vector, so
its width is K (``feature_dim``); the head is a fresh ``Linear(K, C)``.

``htcnnN`` follows FedTGP appendix Table 9 (written for 1-channel 28x28 Fashion-MNIST, K = 512,
10-d fc head). When ``feature_dim`` differs from 512, only the *last* extractor fc changes width
(to K); the earlier fc widths stay as in the table.

``cnn`` is the 4-layer CNN of FedAvg / HtFLlib: conv5-32, pool, conv5-64, pool, fc-K (the same
layers as ``htcnn2``; kept as its own name because HtFE groups refer to it).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from htfl_dist.errors import ConfigError

from .base import SplitModel, linear_head
from .registry import register_architecture

KERNEL = 5
POOL = 2


def _spatial_after_blocks(image_size: int, num_blocks: int) -> int:
    """Side length after ``num_blocks`` x (valid 5x5 conv, 2x2 floor max pool); 0 if it vanishes."""
    size = image_size
    for _ in range(num_blocks):
        size = size - (KERNEL - 1)
        if size < POOL:
            return 0
        size //= POOL
    return size


def _min_image_size(num_blocks: int) -> int:
    size = 1
    while _spatial_after_blocks(size, num_blocks) < 1:
        size += 1
    return size


def plain_cnn(
    name: str,
    conv_channels: Sequence[int],
    fc_widths: Sequence[int],
    *,
    num_classes: int,
    feature_dim: int,
    in_channels: int,
    image_size: int,
) -> SplitModel:
    """Build conv blocks ``conv_channels`` then fcs ``fc_widths`` (last one replaced by K).

    The flatten width is computed by arithmetic from ``in_channels``/``image_size`` (no dry run,
    so construction draws from the RNG only for parameters).
    """
    side = _spatial_after_blocks(image_size, len(conv_channels))
    if side < 1:
        raise ConfigError(
            f"image_size {image_size} is too small for architecture {name!r} "
            f"(needs >= {_min_image_size(len(conv_channels))})"
        )
    layers: list[nn.Module] = []
    channels = in_channels
    for out_channels in conv_channels:
        layers += [
            nn.Conv2d(channels, out_channels, kernel_size=KERNEL, padding=0, bias=True),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=POOL),
        ]
        channels = out_channels
    layers.append(nn.Flatten(1))
    width = channels * side * side
    for out_width in [*fc_widths[:-1], feature_dim]:
        layers += [nn.Linear(width, out_width), nn.ReLU(inplace=True)]
        width = out_width
    return SplitModel(nn.Sequential(*layers), linear_head(feature_dim, num_classes), feature_dim, arch=name)


# FedTGP appendix Table 9: (conv output channels, fc widths); the last fc is the feature.
HTCNN8_TABLE: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "htcnn1": ((32,), (512,)),
    "htcnn2": ((32, 64), (512,)),
    "htcnn3": ((32,), (512, 512)),
    "htcnn4": ((32, 64), (512, 512)),
    "htcnn5": ((32,), (1024, 512)),
    "htcnn6": ((32, 64), (1024, 512)),
    "htcnn7": ((32,), (1024, 512, 512)),
    "htcnn8": ((32, 64), (1024, 512, 512)),
}


@register_architecture("cnn")
def build_cnn(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
    """FedAvg 4-layer CNN: conv5-32, pool, conv5-64, pool, fc-K."""
    return plain_cnn(
        "cnn", (32, 64), (512,),
        num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels, image_size=image_size,
    )


def _register_htcnn(name: str, conv_channels: tuple[int, ...], fc_widths: tuple[int, ...]) -> None:
    @register_architecture(name)
    def build(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
        return plain_cnn(
            name, conv_channels, fc_widths,
            num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels, image_size=image_size,
        )

    build.__name__ = f"build_{name}"
    build.__doc__ = f"HtCNN8 member {name}: convs {conv_channels}, fcs {fc_widths} (FedTGP Table 9)."


for _name, (_convs, _fcs) in HTCNN8_TABLE.items():
    _register_htcnn(_name, _convs, _fcs)
