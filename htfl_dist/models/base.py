"""The one model shape every algorithm sees: a feature extractor followed by a head.

Prototype-based HtFL methods (FedProto, FedTGP, FedOC, ...) exchange knowledge in the
K-dimensional feature space that every client's model shares, whatever its architecture.
So each client model is split into ``feature_extractor`` (input -> R^K, private and
architecture-specific) and ``head`` (R^K -> R^C, the same shape on every client).
"""
from __future__ import annotations

import re
from typing import Any

from torch import Tensor, nn

from htfl_dist.registry import Registry


class SplitModel(nn.Module):
    """A client model ``head(feature_extractor(x))`` with a K-dimensional feature interface.

    Attributes:
        feature_extractor: maps a batch of images ``(B, C_in, H, W)`` to features ``(B, K)``.
        head: maps features ``(B, K)`` to logits ``(B, num_classes)``.
        feature_dim: K, the width every client shares (prototypes live in R^K).
        arch: the ``ARCH`` or ``ARCH:HEAD`` string this model was built from ("" if built by hand).
    """

    def __init__(self, feature_extractor: nn.Module, head: nn.Module, feature_dim: int, arch: str = "") -> None:
        super().__init__()
        self.feature_extractor = feature_extractor
        self.head = head
        self.feature_dim = int(feature_dim)
        self.arch = arch

    def features(self, x: Tensor) -> Tensor:
        """Features ``(B, K)``: what prototypes are computed from."""
        return self.feature_extractor(x)

    def forward_with_features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(features, logits)`` from one pass, for losses that need both (CE + prototype term)."""
        feats = self.feature_extractor(x)
        return feats, self.head(feats)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, num_classes)``."""
        return self.head(self.feature_extractor(x))

    def extra_repr(self) -> str:
        return f"arch={self.arch!r}, feature_dim={self.feature_dim}"


def linear_head(feature_dim: int, num_classes: int) -> nn.Linear:
    """The fresh classifier every architecture gets: ``Linear(K, C)``, PyTorch's default init.

    Kept in one place so all architectures (torchvision, CNN, HtCNN) share the same head shape,
    which is what lets head-sharing baselines (LG-FedAvg, FedGH) aggregate heads across clients.
    Groups with heterogeneous heads (``ARCH:HEAD``, HtC4) break that on purpose; a head-sharing
    algorithm must reject them.
    """
    return nn.Linear(feature_dim, num_classes)


def natural_key(name: str) -> list[object]:
    """Sort key that orders ``resnet4 < resnet10 < resnet18`` (digits compared as numbers).

    Shared by the architecture and head registries so both list names the same way.
    """
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def check_new_name(taken: Registry[Any], name: str) -> None:
    """Shared rule of the architecture, head and model group registries: a name is free in
    ``taken`` (the one name rule of :mod:`htfl_dist.registry`), and holds neither ':' (it
    separates ARCH:HEAD) nor ',' (it separates the members of a custom group)."""
    taken.check_free(name)
    for separator, role in ((":", "ARCH:HEAD"), (",", "the members of a custom group")):
        if separator in name:
            raise ValueError(f"{taken.kind} name {name!r} must not contain {separator!r} (it separates {role})")


__all__ = ["SplitModel", "check_new_name", "linear_head", "natural_key"]
