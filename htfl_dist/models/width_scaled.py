"""Width-scaled model families for HeteroFL and FedRolex: one global model, members at a fraction of its width.

Why: HeteroFL (Diao et al., ICLR 2021) and FedRolex (Alam et al., NeurIPS 2022) give a client of
capacity p a sub-model holding ceil(p * W) of the W channels of every hidden layer of the global
model, so the server can average every global entry over the clients that hold it
(``algorithms.blocks.width_slice``). A member is built at its own width; which global channels it
holds is decided each round by the algorithm, not here.

Sources (reference code: dem123456789/HeteroFL-Computation-and-Communication-Efficient-Federated-
Learning-for-Heterogeneous-Clients, commit ea528c330ec832b141b2ad64ca299642c91685ae):

- levels a..e = rates 1, 1/2, 1/4, 1/8, 1/16 (``src/utils.py``, ``process_control``,
  ``cfg['model_split_rate']``); hidden widths ``[64, 128, 256, 512]`` for both ``conv`` and
  ``resnet`` (``cfg['conv']``, ``cfg['resnet']``), each scaled as ``ceil(rate * w)``;
- ``hetero_cnn``: ``src/models/conv.py`` (3x3 conv, Scaler, norm, ReLU, 2x2 max pool per block,
  no pool after the last, global average pool, linear);
- ``hetero_resnet18``: ``src/models/resnet.py`` (pre-activation blocks [2, 2, 2, 2], Scaler before
  each norm, final norm + ReLU + average pool, linear);
- the Scaler (``src/modules/modules.py``, ``Scaler``): activations divided by the rate in training
  only; on by default (``src/config.yml``, ``control.scale: '1'``);
- static BatchNorm (sBN): ``BatchNorm2d(momentum=None, track_running_stats=False)``; the official
  code builds every training model with ``track=False`` and norm ``bn`` (``config.yml``,
  ``control.norm: 'bn'``), so this is the default here (``norm="static_bn"``).

Departures: the last hidden width is the run's ``model.feature_dim`` (512 = the official width by
default), and the features are zero-padded to that width K, because every client of this
framework gives K-wide features; the head is ``Linear(K, C)`` whose columns past the member's
ceil(p * K) features are zero and stay zero (their input is always 0, so they get no gradient),
so the logits are exactly those of the official ``Linear(ceil(p * K), C)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .base import SplitModel
from .registry import register_architecture, register_model_group

Norm = Literal["static_bn", "bn", "none"]

LEVELS: dict[str, float] = {"a": 1.0, "b": 0.5, "c": 0.25, "d": 0.125, "e": 0.0625}
"""HeteroFL's model levels (``process_control``: ``model_split_rate``)."""

HIDDEN: tuple[int, int, int] = (64, 128, 256)
"""The first three hidden widths of both families (``cfg['conv']``, ``cfg['resnet']``); the fourth is K."""

FAMILIES = ("cnn", "resnet18")


def scaled(width: int, rate: float) -> int:
    """ceil(rate * width), the official ``int(np.ceil(model_rate * x))``, at least 1."""
    return max(1, math.ceil(rate * width))


class Scaler(nn.Module):
    """Divides activations by ``rate`` in training only (HeteroFL's ``Scaler``), so a narrow member's
    activations have the global model's scale while it trains; identity in evaluation."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = float(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate if self.training else x

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


class FeaturePad(nn.Module):
    """(B, k) -> (B, K): the member's k features followed by zeros, so every member gives K-wide features."""

    def __init__(self, kept: int, width: int) -> None:
        super().__init__()
        self.kept, self.width = kept, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, self.width - self.kept))


class WidthScaledModel(SplitModel):
    """A member of a width-scaled family: ``rate`` and ``kept_features`` (its ceil(rate * K) real
    features) tell the algorithm which part of the global model it can hold."""

    def __init__(self, feature_extractor: nn.Module, head: nn.Linear, feature_dim: int, *, family: str,
                 rate: float, kept_features: int) -> None:
        super().__init__(feature_extractor, head, feature_dim)
        self.family, self.rate, self.kept_features = family, float(rate), kept_features
        with torch.no_grad():
            head.weight[:, kept_features:] = 0.0
            head.bias.zero_()  # official init_param: Linear bias 0


def _norm(channels: int, norm: Norm) -> nn.Module:
    if norm == "none":
        return nn.Identity()
    return nn.BatchNorm2d(channels, momentum=None, track_running_stats=norm == "bn")


def _scaler(rate: float, on: bool) -> nn.Module:
    return Scaler(rate) if on else nn.Identity()


def hetero_cnn(rate: float, *, num_classes: int, feature_dim: int, in_channels: int, image_size: int,
               scaler: bool = True, norm: Norm = "static_bn") -> WidthScaledModel:
    """HeteroFL's ``conv`` at ``rate``: widths ceil(rate * (64, 128, 256, K))."""
    widths = [scaled(w, rate) for w in (*HIDDEN, feature_dim)]
    layers: list[nn.Module] = []
    channels = in_channels
    for index, width in enumerate(widths):
        layers += [nn.Conv2d(channels, width, 3, 1, 1), _scaler(rate, scaler), _norm(width, norm), nn.ReLU()]
        if index < len(widths) - 1:
            layers.append(nn.MaxPool2d(2))
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(1), FeaturePad(widths[-1], feature_dim)]
    return WidthScaledModel(nn.Sequential(*layers), nn.Linear(feature_dim, num_classes), feature_dim,
                            family="cnn", rate=rate, kept_features=widths[-1])


class PreActBlock(nn.Module):
    """HeteroFL's ``Block``: relu(n1(scale(x))) -> conv1 -> relu(n2(scale(.))) -> conv2, plus the
    shortcut (a 1x1 conv of the pre-activation where the shape changes, else x)."""

    def __init__(self, in_planes: int, planes: int, stride: int, rate: float, scaler: bool, norm: Norm) -> None:
        super().__init__()
        self.n1, self.n2 = _norm(in_planes, norm), _norm(planes, norm)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.scaler = _scaler(rate, scaler)
        self.shortcut = (nn.Conv2d(in_planes, planes, 1, stride, bias=False)
                         if stride != 1 or in_planes != planes else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.n1(self.scaler(x)))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv2(F.relu(self.n2(self.scaler(self.conv1(out)))))
        return out + shortcut


class PreActTail(nn.Module):
    """relu(n4(scale(x))), global average pool, flatten, pad to K."""

    def __init__(self, width: int, feature_dim: int, rate: float, scaler: bool, norm: Norm) -> None:
        super().__init__()
        self.n4, self.scaler, self.pad = _norm(width, norm), _scaler(rate, scaler), FeaturePad(width, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pad(F.adaptive_avg_pool2d(F.relu(self.n4(self.scaler(x))), 1).flatten(1))


def hetero_resnet18(rate: float, *, num_classes: int, feature_dim: int, in_channels: int, image_size: int,
                    scaler: bool = True, norm: Norm = "static_bn") -> WidthScaledModel:
    """HeteroFL's pre-activation ``resnet18`` at ``rate``: widths ceil(rate * (64, 128, 256, K))."""
    widths = [scaled(w, rate) for w in (*HIDDEN, feature_dim)]
    modules: list[nn.Module] = [nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)]
    planes_in = widths[0]
    for stage, width in enumerate(widths):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            modules.append(PreActBlock(planes_in, width, stride, rate, scaler, norm))
            planes_in = width
    modules.append(PreActTail(widths[-1], feature_dim, rate, scaler, norm))
    return WidthScaledModel(nn.Sequential(*modules), nn.Linear(feature_dim, num_classes), feature_dim,
                            family="resnet18", rate=rate, kept_features=widths[-1])


_BUILDERS = {"cnn": hetero_cnn, "resnet18": hetero_resnet18}


def architecture_name(family: str, level: str) -> str:
    return f"hetero_{family}_{level}"


def member_of(arch: str) -> tuple[str, float] | None:
    """(family, rate) of a registered width-scaled member name (``hetero_cnn_c`` -> ("cnn", 0.25)),
    None for any other architecture (including ``ARCH:HEAD``: another head is not the family's)."""
    for family in FAMILIES:
        for level, rate in LEVELS.items():
            if arch.lower() == architecture_name(family, level):
                return family, rate
    return None


def slice_plan(global_model: WidthScaledModel, member: WidthScaledModel) -> dict[str, tuple[int | None, ...]]:
    """Per parameter of the global model, per dimension: the global width the member's entries are
    drawn from (sliced), or None (held whole). A dimension is sliced where the member is narrower,
    and the head's input where the member has fewer real features than K (its padding)."""
    members = dict(member.named_parameters())
    plan: dict[str, tuple[int | None, ...]] = {}
    for name, tensor in global_model.named_parameters():
        mine = members[name].shape
        dims: list[int | None] = [None if size == mine[dim] else size for dim, size in enumerate(tensor.shape)]
        if name == "head.weight" and member.kept_features < global_model.kept_features:
            dims[1] = global_model.kept_features
        plan[name] = tuple(dims)
    return plan


@dataclass
class WidthScaledOptions:
    """``model.options`` of every width-scaled member: HeteroFL's two tricks, official defaults."""

    scaler: bool = True
    """Divide activations by the rate in training (``config.yml`` ``control.scale: '1'``)."""
    norm: Norm = "static_bn"
    """static_bn: BatchNorm with batch statistics only (sBN, ``track=False``, the official
    training models); bn: running statistics kept locally; none (``control.norm``)."""


def _register(family: str, level: str, rate: float) -> None:
    builder = _BUILDERS[family]

    def build(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int,
              options: WidthScaledOptions) -> SplitModel:
        return builder(rate, num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels,
                       image_size=image_size, scaler=options.scaler, norm=options.norm)

    build.__doc__ = f"HeteroFL {family} at level {level} (rate {rate})."
    register_architecture(architecture_name(family, level), options=WidthScaledOptions)(build)


for _family in FAMILIES:
    for _level, _rate in LEVELS.items():
        _register(_family, _level, _rate)

GROUPS: dict[str, tuple[str, ...]] = {
    "HeteroCNN-a-e": tuple(architecture_name("cnn", level) for level in LEVELS),
    "HeteroResNet18-a-e": tuple(architecture_name("resnet18", level) for level in LEVELS),
}
"""HeteroFL's ``model_mode`` ``a1-b1-c1-d1-e1`` (equal shares of the five levels): client i gets
level ``"abcde"[i mod 5]`` (the official ``fix`` mode gives contiguous blocks of clients each level)."""
for _name, _members in GROUPS.items():
    register_model_group(_name, _members)

