"""FedPer (Arivazhagan et al., 2019): the server averages the clients' feature extractors; each
client keeps its head. The engine's model-part block does the work: pick the part, name the
option that chooses the mean, register."""
from __future__ import annotations

from dataclasses import dataclass

from htfl_dist.api import FEATURE_EXTRACTOR, Average, PartAveragingServer, PartSharingClient, register_algorithm


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


register_algorithm("example_fedper", server=FedPerServer, client=FedPerClient, options=FedPerOptions,
                   summary="FedAvg over the feature extractor, local heads (example plugin)",
                   shares_parameters=True)
