"""A plugin module as a user writes one, outside the package: FedPer (FedAvg over the feature
extractor, local heads) on the model-part block, registered on import as ``plugin_fedper``.

The suite does not import it at collection, so the real registry never holds it:
tests/algorithms/test_conformance_kit.py imports it into a scratch copy of the registry and runs
``htfl_dist.testing`` on it, and its launched ranks import it with ``--import plugin_fedper``."""
from __future__ import annotations

from dataclasses import dataclass

from htfl_dist.algorithms import register_algorithm
from htfl_dist.algorithms.blocks.model_part import FEATURE_EXTRACTOR, Average, PartAveragingServer, PartSharingClient
from htfl_dist.algorithms.registry import ConformanceHints


@dataclass
class PluginFedPerOptions:
    avg: Average = "sample_weighted"
    """Server mean of the uploaded extractors: n_i / Σn (FedAvg) | uniform."""


class PluginFedPerClient(PartSharingClient):
    part = FEATURE_EXTRACTOR
    algorithm_name = "FedPer"


class PluginFedPerServer(PartAveragingServer):
    part = FEATURE_EXTRACTOR
    average_option = "avg"


register_algorithm("plugin_fedper", server=PluginFedPerServer, client=PluginFedPerClient, options=PluginFedPerOptions,
                   summary="FedAvg over the feature extractor, local heads (a plugin)", shares_parameters=True,
                   conformance=ConformanceHints(overrides=("model.group=cnn",)))  # identical extractors
