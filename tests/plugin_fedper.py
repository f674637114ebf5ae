"""A plugin module as a user writes one, outside the package: FedPer (FedAvg over the feature
extractor, local heads) on the model-part block, registered on import as ``plugin_fedper``.

The suite does not import it at collection, so the real registry never holds it:
tests/algorithms/test_conformance_kit.py imports it into a scratch copy of the registry and runs
``htfl_dist.testing`` on it, and its launched ranks import it with ``--import plugin_fedper``."""
from __future__ import annotations

from fedper_parts import FedPerClient, FedPerOptions, FedPerServer

from htfl_dist.algorithms import register_algorithm
from htfl_dist.algorithms.registry import ConformanceHints

register_algorithm("plugin_fedper", server=FedPerServer, client=FedPerClient, options=FedPerOptions,
                   summary="FedAvg over the feature extractor, local heads (a plugin)", shares_parameters=True,
                   conformance=ConformanceHints(overrides=("model.group=cnn",)))  # identical extractors
