"""Model zoo: architectures split into a K-dimensional feature extractor and a head.

Public interface (the runtime relies on exactly this):

* :class:`SplitModel` — ``feature_extractor`` (images -> (B, K)), ``head`` ((B, K) -> logits),
  ``feature_dim`` (K), ``features(x)``, ``forward(x)``, ``forward_with_features(x)``.
* :func:`build_model` — a freshly initialised model of a registered architecture; draws from
  torch's global RNG, never seeds it.
* :func:`architecture_for_client` — ``group[client_id mod len(group)]``; a single architecture
  name is a homogeneous group of one.
* :func:`model_groups`, :func:`architectures`, :func:`register_architecture`.

Importing the package registers the built-in architectures (``cnn``, ``htcnn1``..``htcnn8``,
``googlenet``, ``mobilenet_v2``, ``resnet4/6/8/10/18/34/50/101/152``).
"""
from .base import SplitModel
from .head_split import FeaturePool, adapt_input_channels, split_classifier
from .registry import (
    architecture_for_client,
    architectures,
    build_model,
    model_groups,
    register_architecture,
    resolve_group,
)

# Imported for their side effect: registering the built-in architectures.
from . import cnn as _cnn  # noqa: E402,F401
from . import torchvision_zoo as _torchvision_zoo  # noqa: E402,F401

__all__ = [
    "FeaturePool",
    "SplitModel",
    "adapt_input_channels",
    "architecture_for_client",
    "architectures",
    "build_model",
    "model_groups",
    "register_architecture",
    "resolve_group",
    "split_classifier",
]
