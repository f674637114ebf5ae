"""HtFLlib's AmazonMLP (from KD3A) for PFLlib's Amazon Review rows (5000 word-count features).

``AmazonMLP(feature_dim=[h1, ..., hn])`` is ``Linear(F, h1) -> ReLU -> ... -> Linear(hn, 100) ->
ReLU`` (no hidden layer: ``Linear(F, 100) -> ReLU``) followed by a classifier. Split as HtFLlib's
BaseHeadSplit splits it: the classifier is replaced by the average pool, so the feature vector is
the 100-wide encoder output pooled to K (K = 512: each value repeated 5 or 6 times) and the head
is ``Linear(K, C)``. F is the data's width (HtFLlib fixes 5000, what PFLlib writes).

HtFLlib's classifier is ``Linear(100, 2)`` whatever the class count; it is not drawn here, so
``model.init=htfllib`` does not reproduce HtFLlib's head weights for these members.
"""
from __future__ import annotations

from torch import nn

from .base import SplitModel, linear_head
from .head_split import FeaturePool
from .inputs import InputSpec
from .registry import InputNeed, register_architecture

TABULAR = InputNeed("tabular", "tabular rows (N x F features, PFLlib's Amazon Review layout)")

ENCODER_WIDTH = 100
"""AmazonMLP's last encoder layer (its ``out_features``)."""


def amazon_mlp(name: str, hidden: tuple[int, ...], *, num_classes: int, feature_dim: int,
               inputs: InputSpec) -> SplitModel:
    layers: list[nn.Module] = []
    width = inputs.shape[0]
    for out_width in (*hidden, ENCODER_WIDTH):
        layers += [nn.Linear(width, out_width), nn.ReLU()]
        width = out_width
    layers.append(FeaturePool(ENCODER_WIDTH, feature_dim))
    return SplitModel(nn.Sequential(*layers), linear_head(feature_dim, num_classes), feature_dim, arch=name)


AMAZON_MLPS: dict[str, tuple[int, ...]] = {
    "amazon_mlp": (),
    "amazon_mlp_200": (200,),
    "amazon_mlp_500": (500,),
    "amazon_mlp_1000_500": (1000, 500),
    "amazon_mlp_1000_500_200": (1000, 500, 200),
}
"""Member name -> AmazonMLP's hidden widths, as HtFLlib's MLPs / MLP_1layer / MLP_layers use them."""


def _register(name: str, hidden: tuple[int, ...]) -> None:
    @register_architecture(name, needs=TABULAR)
    def build(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
        return amazon_mlp(name, hidden, num_classes=num_classes, feature_dim=feature_dim, inputs=inputs)

    build.__name__ = f"build_{name}"
    build.__doc__ = f"AmazonMLP with hidden widths {list(hidden)}, encoder out 100, pooled to K."


for _name, _hidden in AMAZON_MLPS.items():
    _register(_name, _hidden)
