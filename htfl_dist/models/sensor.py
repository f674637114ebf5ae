"""HtFLlib's sensor CNNs (HARCNN, HARCNN1, HARCNN3) for PFLlib's HAR and PAMAP2 windows.

Input: nine-channel windows ``9 x H x W`` (HAR: ``9 x 1 x 128``, PAMAP2: ``9 x 3 x 256``). Each
block is ``Conv2d(kernel (1, k), stride s) -> ReLU -> MaxPool2d(kernel (1, 2), stride 2)`` (the
pool's stride 2 applies to both axes, so the height shrinks too):

============  ======  ===========================  =========
member        k       conv channels                stride s
============  ======  ===========================  =========
harcnn_sS     9       32, 64                       1, 2, 3
harcnn1_sS    9       32                           1, 2, 3
harcnn3_sS    5       32, 64, 128                  1, 2
============  ======  ===========================  =========

Split as HtFLlib's BaseHeadSplit splits them: HARCNN's whole ``fc`` stack (two hidden layers,
1024 and 512 wide, then the classifier) is replaced by the parameter-free average pool, so the
feature vector is the flattened last conv map pooled to K (HAR at stride 1: 64 x 26 = 1664
values -> 512) and the head is ``Linear(K, C)``. The discarded hidden layers are still drawn
from the RNG, at the widths HtFLlib passes (``dim_hidden`` 1664 / 832 / 3328), and the head is
drawn where HARCNN's classifier is, so ``model.init=htfllib`` gives HtFLlib's weights at K = 512.
"""
from __future__ import annotations

from torch import Tensor, nn

from htfl_dist.errors import ConfigError

from .base import SplitModel, linear_head
from .head_split import FeaturePool
from .inputs import InputSpec
from .registry import InputNeed, register_architecture

SENSOR_CHANNELS = 9
"""HtFLlib builds every member as ``HARCNN(9, ...)``: the nine inertial signals of HAR/PAMAP2."""

SENSOR_WINDOWS = InputNeed("image", f"{SENSOR_CHANNELS}-channel sensor windows ({SENSOR_CHANNELS} x H x W)",
                           channels=SENSOR_CHANNELS)

POOL_WIDTH = 2
POOL_STRIDE = 2


class SensorCNN(nn.Module):
    """Conv blocks, flatten, then ``fc`` (after the split: the pool to K)."""

    def __init__(self, blocks: list[nn.Module], fc: nn.Module) -> None:
        super().__init__()
        self.convs = nn.Sequential(*blocks)
        self.fc = fc

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.convs(x).flatten(1))


def _conv_out(size: int, kernel: int, stride: int) -> int:
    return (size - kernel) // stride + 1


def flattened_width(inputs: InputSpec, channels: tuple[int, ...], kernel: int, stride: int) -> int:
    """Width of the flattened last conv map for ``inputs`` (0 if a block has nothing left)."""
    _, height, width = inputs.shape
    for _ in channels:
        height, width = _conv_out(height, 1, stride), _conv_out(width, kernel, stride)
        if height < 1 or width < POOL_WIDTH:
            return 0
        height, width = _conv_out(height, 1, POOL_STRIDE), _conv_out(width, POOL_WIDTH, POOL_STRIDE)
    return channels[-1] * height * width


def sensor_cnn(name: str, channels: tuple[int, ...], kernel: int, stride: int, dim_hidden: int, *,
               num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
    """One HARCNN-family member for ``inputs`` (see the module docstring)."""
    flat = flattened_width(inputs, channels, kernel, stride)
    if flat < 1:
        raise ConfigError(f"architecture {name!r} needs longer windows than {inputs.describe()} "
                          f"({len(channels)} blocks of a (1, {kernel}) conv at stride {stride} and a pool)")
    blocks: list[nn.Module] = []
    width_in = inputs.shape[0]
    for width_out in channels:
        blocks.append(nn.Sequential(
            nn.Conv2d(width_in, width_out, kernel_size=(1, kernel), stride=stride),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=(1, POOL_WIDTH), stride=POOL_STRIDE),
        ))
        width_in = width_out
    # HARCNN's fc hidden layers: drawn (RNG parity with HtFLlib), then dropped with the split.
    nn.Linear(dim_hidden, 1024)
    nn.Linear(1024, 512)
    head = linear_head(feature_dim, num_classes)  # where HARCNN's classifier Linear(512, C) is drawn
    return SplitModel(SensorCNN(blocks, FeaturePool(flat, feature_dim)), head, feature_dim, arch=name)


# name -> (conv channels, kernel, stride, HtFLlib's dim_hidden)
HARCNN_MEMBERS: dict[str, tuple[tuple[int, ...], int, int, int]] = {
    **{f"harcnn_s{stride}": ((32, 64), 9, stride, 1664) for stride in (1, 2, 3)},
    **{f"harcnn1_s{stride}": ((32,), 9, stride, 832) for stride in (1, 2, 3)},
    **{f"harcnn3_s{stride}": ((32, 64, 128), 5, stride, 3328) for stride in (1, 2)},
}


def _register(name: str, channels: tuple[int, ...], kernel: int, stride: int, dim_hidden: int) -> None:
    @register_architecture(name, needs=SENSOR_WINDOWS)
    def build(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
        return sensor_cnn(name, channels, kernel, stride, dim_hidden,
                          num_classes=num_classes, feature_dim=feature_dim, inputs=inputs)

    build.__name__ = f"build_{name}"
    build.__doc__ = f"HtFLlib sensor CNN: convs {channels}, kernel (1, {kernel}), stride {stride}."


for _name, (_channels, _kernel, _stride, _hidden) in HARCNN_MEMBERS.items():
    _register(_name, _channels, _kernel, _stride, _hidden)
