"""Turn any torchvision classifier into feature extractor + head with a K-dimensional interface.

The idea (from HtFLlib, re-implemented here): heterogeneous architectures end in penultimate
vectors of different widths (ResNet18: 512, ResNet50+: 2048, GoogLeNet: 1024, MobileNetV2: 1280,
truncated ResNets: 64/128/256). To give every client the same feature space R^K without adding
parameters, the architecture's final classifier is replaced by a *parameter-free* average pool
over the feature axis to exactly K values, and a fresh ``Linear(K, C)`` becomes the head.

Pooling rule (identical to ``F.adaptive_avg_pool1d`` over the feature axis, width L -> K):
output i is the mean of inputs ``[floor(i*L/K), ceil((i+1)*L/K))``. Consequences:

* L == K: identity.
* L = m*K (ResNet50+ 2048 -> 512, m = 4; GoogLeNet 1024 -> 512, m = 2): mean of consecutive
  groups of m.
* K = r*L (64 -> 512, r = 8): every input is repeated r times in place (``repeat_interleave``),
  i.e. ``[a, a, ..., b, b, ...]``.
* otherwise (MobileNetV2 1280 -> 512): overlapping windows of 3 or 4 inputs, averaged.

We do not call ``F.adaptive_avg_pool1d`` itself: its CUDA backward uses atomic adds and raises
under ``torch.use_deterministic_algorithms(True)``. The divisible cases are computed with
reshape/mean and expand (exact and deterministic), the rest with a fixed averaging matrix.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .base import SplitModel, linear_head

# Attributes that hold the final classifier in torchvision-style models, in lookup order.
CLASSIFIER_ATTRIBUTES: tuple[str, ...] = ("fc", "classifier", "head", "heads")


def pooling_matrix(in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``(in_features, out_features)`` matrix M with ``x @ M`` = adaptive average pool of x."""
    matrix = torch.zeros(in_features, out_features, dtype=dtype)
    for i in range(out_features):
        start = (i * in_features) // out_features
        end = -((-(i + 1) * in_features) // out_features)  # ceil((i+1)*L/K)
        matrix[start:end, i] = 1.0 / (end - start)
    return matrix


class FeaturePool(nn.Module):
    """Parameter-free average pool of a ``(B, in_features)`` vector to ``(B, out_features)``.

    See the module docstring for the exact rule. The general-case matrix is a non-persistent
    buffer: it moves with ``.to(device)`` but is not written into checkpoints (it is derived
    from the two widths).
    """

    weight_matrix: Tensor | None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"FeaturePool widths must be >= 1, got {in_features} -> {out_features}")
        self.in_features = in_features
        self.out_features = out_features
        divisible = in_features % out_features == 0 or out_features % in_features == 0
        matrix = None if divisible else pooling_matrix(in_features, out_features)
        self.register_buffer("weight_matrix", matrix, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"FeaturePool expects (B, {self.in_features}) penultimate vectors, got {tuple(x.shape)}"
            )
        batch = x.shape[0]
        width, k = self.in_features, self.out_features
        if width == k:
            return x
        if width % k == 0:
            return x.reshape(batch, k, width // k).mean(dim=2)
        if k % width == 0:
            return x.unsqueeze(2).expand(batch, width, k // width).reshape(batch, k)
        assert self.weight_matrix is not None
        return x @ self.weight_matrix.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _find_classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """The attribute name of the final classifier and the last ``nn.Linear`` inside it."""
    for attr in CLASSIFIER_ATTRIBUTES:
        module = getattr(model, attr, None)
        if not isinstance(module, nn.Module):
            continue
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if linears:
            return attr, linears[-1]
    raise ValueError(
        f"{type(model).__name__} has no final classifier with an nn.Linear in any of {CLASSIFIER_ATTRIBUTES}"
    )


def split_classifier(
    model: nn.Module,
    *,
    feature_dim: int,
    num_classes: int,
    penultimate_dim: int | None = None,
    arch: str = "",
) -> SplitModel:
    """Split a torchvision-style classifier into ``SplitModel(feature_extractor, head)``.

    The whole classifier attribute (``fc``, ``classifier``, ...) is replaced by a
    :class:`FeaturePool` to ``feature_dim``; anything the architecture applies *before* that
    attribute stays in the extractor (e.g. GoogLeNet's dropout, which is a separate attribute),
    while a dropout *inside* the classifier (MobileNetV2's ``classifier[0]``) goes with it.
    The model is modified in place and becomes the feature extractor.

    Args:
        penultimate_dim: width of the vector that reaches the classifier; defaults to the
            ``in_features`` of the classifier's last ``Linear``. Pass it when the model was
            altered so the old classifier no longer matches (truncated ResNets).
    """
    attr, linear = _find_classifier(model)
    width = linear.in_features if penultimate_dim is None else penultimate_dim
    setattr(model, attr, FeaturePool(width, feature_dim))
    return SplitModel(model, linear_head(feature_dim, num_classes), feature_dim, arch=arch)


def adapt_input_channels(
    model: nn.Module, in_channels: int, init: Callable[[nn.Conv2d], None]
) -> nn.Module:
    """Make the stem accept ``in_channels`` (e.g. 1 for grayscale) by replacing the first conv.

    The replacement keeps out channels, kernel, stride, padding, dilation, groups and bias of the
    original; only its input width changes. It is allocated without running PyTorch's default
    init (``skip_init``, so no global RNG draws are wasted) and then initialised by ``init``,
    which must be the architecture's own scheme so a 1-channel model is initialised like a
    3-channel one. No-op when the stem already has ``in_channels`` inputs.
    """
    for name, module in model.named_modules():  # noqa: B007 (name is used after the loop)
        if isinstance(module, nn.Conv2d):
            break
    else:
        raise ValueError(f"{type(model).__name__} has no nn.Conv2d stem to adapt")
    old: nn.Conv2d = module
    if old.in_channels == in_channels:
        return model
    new = torch.nn.utils.skip_init(
        nn.Conv2d,
        in_channels,
        old.out_channels,
        kernel_size=old.kernel_size,
        stride=old.stride,
        padding=old.padding,
        dilation=old.dilation,
        groups=old.groups,
        bias=old.bias is not None,
        padding_mode=old.padding_mode,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )
    init(new)
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, new)
    return model
