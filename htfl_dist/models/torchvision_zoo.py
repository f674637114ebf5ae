"""torchvision architectures (randomly initialised, never downloaded) as split models.

Each builder constructs the torchvision model with ``weights=None``, adapts the stem to
``in_channels`` (see :func:`adapt_input_channels`), and splits off the classifier with the
generic :func:`split_classifier` (penultimate vector average-pooled to K, fresh ``Linear(K, C)``).
The stems are the ImageNet ones, unchanged, as in the FedTGP/HtFLlib experiments; they still
run on 28x28 and 32x32 inputs (ResNets and MobileNetV2 end at 1x1 spatial maps; GoogLeNet
needs at least 15x15).

Caveat for training loops: at 28x28/32x32 the last BatchNorm layers of GoogLeNet, MobileNetV2
and ResNet10/18+ see 1x1 maps, so a *training-mode* batch of one sample raises PyTorch's
"Expected more than 1 value per channel when training". Drop (or skip) size-1 last batches.

ResNet4/6/8/10 are BasicBlock ResNets with one block per stage: ResNet10 has the four usual
stages ([1, 1, 1, 1]); ResNet8/6/4 keep only the first 3/2/1 stages (later stages become
``nn.Identity``), so their penultimate widths are 256/128/64 and get repeated up to K.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from types import ModuleType

from torch import nn

from htfl_dist.errors import ConfigError

from .base import SplitModel
from .head_split import FeaturePool, adapt_input_channels, split_classifier
from .heads import build_head
from .registry import register_architecture

# Smallest square input each family accepts (GoogLeNet's ceil-mode pools reach a 1x1 map at
# maxpool3 and the 2x2 maxpool4 then has nothing left below 15x15; measured with torchvision 0.29).
MIN_IMAGE_SIZE: dict[str, int] = {"googlenet": 15}


def _torchvision_models() -> ModuleType:
    """``torchvision.models``, imported on first use: importing torchvision costs every process
    about 1.5 s (it pulls in ``torch._dynamo``), and most runs build only HtCNN members."""
    return importlib.import_module("torchvision.models")


def _kaiming_fan_out(conv: nn.Conv2d) -> None:
    """ResNet / MobileNetV2 conv init (as torchvision does it)."""
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def _googlenet_init(conv: nn.Conv2d) -> None:
    """GoogLeNet conv init with ``init_weights=True`` (truncated normal, no scipy needed)."""
    nn.init.trunc_normal_(conv.weight, mean=0.0, std=0.01, a=-2, b=2)
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def _check_image_size(arch: str, image_size: int) -> None:
    minimum = MIN_IMAGE_SIZE.get(arch, 1)
    if image_size < minimum:
        raise ConfigError(f"image_size {image_size} is too small for architecture {arch!r} (needs >= {minimum})")


def _finish(
    arch: str,
    model: nn.Module,
    stem_init: Callable[[nn.Conv2d], None],
    *,
    num_classes: int,
    feature_dim: int,
    in_channels: int,
    penultimate_dim: int | None = None,
) -> SplitModel:
    """Adapt the stem to ``in_channels`` and split off the classifier (shared by all builders)."""
    adapt_input_channels(model, in_channels, stem_init)
    return split_classifier(
        model, feature_dim=feature_dim, num_classes=num_classes, penultimate_dim=penultimate_dim, arch=arch
    )


@register_architecture("googlenet")
def build_googlenet(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
    """GoogLeNet without auxiliary classifiers; 1024-d penultimate vector -> K (pairs averaged)."""
    _check_image_size("googlenet", image_size)
    model = _torchvision_models().googlenet(weights=None, aux_logits=False, init_weights=True, num_classes=num_classes)
    return _finish(
        "googlenet", model, _googlenet_init,
        num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels,
    )


@register_architecture("mobilenet_v2")
def build_mobilenet_v2(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
    """MobileNetV2; its whole ``classifier`` (dropout + linear) is replaced, 1280-d -> K."""
    model = _torchvision_models().mobilenet_v2(weights=None, num_classes=num_classes)
    return _finish(
        "mobilenet_v2", model, _kaiming_fan_out,
        num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels,
    )


# Standard torchvision ResNets (the factory in ``torchvision.models`` has the architecture's
# name): penultimate 512 (18/34) or 2048 (50/101/152, groups of 4 -> 512).
_TORCHVISION_RESNETS: tuple[str, ...] = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


def _register_torchvision_resnet(arch: str) -> None:
    @register_architecture(arch)
    def build(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
        model = getattr(_torchvision_models(), arch)(weights=None, num_classes=num_classes)
        return _finish(
            arch, model, _kaiming_fan_out,
            num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels,
        )

    build.__name__ = f"build_{arch}"
    build.__doc__ = f"torchvision {arch} (weights=None), fc replaced by the K-pool."


for _arch in _TORCHVISION_RESNETS:
    _register_torchvision_resnet(_arch)


# One-block-per-stage ResNets: architecture name -> number of stages kept.
_SHALLOW_RESNET_STAGES: dict[str, int] = {"resnet4": 1, "resnet6": 2, "resnet8": 3, "resnet10": 4}


def _register_shallow_resnet(arch: str, stages: int) -> None:
    @register_architecture(arch)
    def build(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
        resnet = importlib.import_module("torchvision.models.resnet")
        model = resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
        # Drop the stages after ``stages``; ResNet's forward calls layer1..layer4 in turn, so an
        # Identity passes the last kept stage's output straight to the global average pool.
        for index in range(stages + 1, 5):
            setattr(model, f"layer{index}", nn.Identity())
        return _finish(
            arch, model, _kaiming_fan_out,
            num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels,
            penultimate_dim=64 * 2 ** (stages - 1),
        )

    build.__name__ = f"build_{arch}"
    build.__doc__ = (f"BasicBlock ResNet with {stages} stage(s) of one block; "
                     f"penultimate width {64 * 2 ** (stages - 1)}.")


for _arch, _stages in _SHALLOW_RESNET_STAGES.items():
    _register_shallow_resnet(_arch, _stages)


# HtFLlib's HtM-img-10 ViTs: torchvision's ViT-B/16 and ViT-B/32 built for the data's image size
# (``vit_b_16(image_size=32, ...)`` there), their ``heads`` pooled 768 -> K, and the head HtFLlib
# gives every ViT (``Linear(K, 768), Tanh, Linear(768, C)``, registered as ``fc768_tanh``).
VIT_HEAD = "fc768_tanh"
_VIT_PATCHES: dict[str, int] = {"vit_b_16": 16, "vit_b_32": 32}


def _vit_stem_init(conv: nn.Conv2d) -> None:
    """ViT patch embedding init (as torchvision does it): truncated normal, std sqrt(1 / fan_in)."""
    fan_in = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
    nn.init.trunc_normal_(conv.weight, std=math.sqrt(1 / fan_in))
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def _register_vit(arch: str, patch: int) -> None:
    @register_architecture(arch, head=VIT_HEAD)
    def build(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
        if image_size % patch:
            raise ConfigError(f"image_size {image_size} does not suit architecture {arch!r}: its {patch}x{patch} "
                              f"patches need a side divisible by {patch}")
        model = getattr(_torchvision_models(), arch)(weights=None, image_size=image_size, num_classes=num_classes)
        adapt_input_channels(model, in_channels, _vit_stem_init)
        model.heads = FeaturePool(model.hidden_dim, feature_dim)
        return SplitModel(model, build_head(VIT_HEAD, feature_dim, num_classes), feature_dim, arch=arch)

    build.__name__ = f"build_{arch}"
    build.__doc__ = f"torchvision {arch} (weights=None) at the data's image size; class token pooled to K."


for _arch, _patch in _VIT_PATCHES.items():
    _register_vit(_arch, _patch)
