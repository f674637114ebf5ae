"""FedPer (FedAvg over the feature extractor, local heads) on the model-part block, as a plugin
writes it: the classes only, registering nothing, so tests can register them in a scratch registry
(tests/algorithms/test_model_part.py) or as a plugin module does (tests/plugin_fedper.py)."""
from __future__ import annotations

from dataclasses import dataclass

from htfl_dist.algorithms.blocks.model_part import FEATURE_EXTRACTOR, Average, PartAveragingServer, PartSharingClient


@dataclass
class FedPerOptions:
    avg: Average = "sample_weighted"
    """Server mean of the uploaded extractors: n_i / Σn (FedAvg) | uniform."""


class FedPerClient(PartSharingClient):
    part = FEATURE_EXTRACTOR
    algorithm_name = "FedPer"


class FedPerServer(PartAveragingServer):
    part = FEATURE_EXTRACTOR
    average_option = "avg"
