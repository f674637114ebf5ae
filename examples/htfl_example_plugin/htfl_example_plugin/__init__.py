"""An htfl_dist plugin: everything here registers through the engine's public registration
functions, the way the built-in algorithms, models and datasets do, and no file of htfl_dist is
touched.

- ``example_fedper``: FedPer (FedAvg over the feature extractor, each client keeps its own head),
  on the engine's model-part block;
- ``tiny_cnn``: a one-block CNN for small grey images, and the model group ``example_tiny``:
  one extractor, two different heads (the heads stay local, so they may differ);
- ``shapes4``: a dataset of 16x16 grey images of four shapes, read from ``ROOT/shapes4.npz``
  (``write_shapes4`` draws one).
"""
from htfl_example_plugin import dataset, fedper, model  # noqa: F401  (registration side effects)
from htfl_example_plugin.dataset import write_shapes4

__all__ = ["write_shapes4"]
