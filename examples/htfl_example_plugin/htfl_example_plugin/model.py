"""A small architecture and a model group, registered as the built-in ones are."""
from __future__ import annotations

from htfl_dist.api import SplitModel, plain_cnn, register_architecture, register_model_group


@register_architecture("tiny_cnn")
def build_tiny_cnn(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel:
    """One conv5-8 block, max pool, then the K-wide feature layer: enough for 16x16 shapes."""
    return plain_cnn("tiny_cnn", (8,), (feature_dim,), num_classes=num_classes, feature_dim=feature_dim,
                     in_channels=in_channels, image_size=image_size)


register_model_group("example_tiny", ("tiny_cnn", "tiny_cnn:fc512"))
"""Client i gets tiny_cnn with the plain head (even i) or a two-layer head (odd i): FedPer shares
the extractor, which is the same architecture for all, and leaves the heads local."""
