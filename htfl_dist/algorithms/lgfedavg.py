"""LG-FedAvg (Liang et al. 2020; HtFLlib ``LG``): FedAvg over the head alone.

Clients share only their head: each round the global head replaces every client's head
(before evaluation and before training), participants train the whole model with CE and
upload the trained head (K·C + C floats) with their sample count n_i. The server sets the
global head to the sample-weighted mean of the uploaded heads (``head_avg: uniform`` is the
official code's plain mean). The global head starts as client 0's initial head. All heads must
have the same parameter names and shapes (checked at start-up).
"""
from __future__ import annotations

from dataclasses import dataclass

from htfl_dist.algorithms.blocks.model_part import HeadAveragingOptions, PartAveragingServer, PartSharingClient
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm


@dataclass
class LGFedAvgOptions(HeadAveragingOptions):
    """``compat: reference`` changes nothing here: HtFLlib's sample-weighted mean is the default."""


class LGFedAvgClient(PartSharingClient):
    algorithm_name = "LG-FedAvg"


register_algorithm("lgfedavg", server=PartAveragingServer, client=LGFedAvgClient, options=LGFedAvgOptions,
                   summary="sample-weighted average of client heads, local bases (Liang et al. 2020)",
                   shares_parameters=True,
                   conformance=ConformanceHints(ranks_covered_by="fedgen"))  # the same model-part block
