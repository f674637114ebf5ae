"""Local: every client trains alone on its own data (the lower bound FL must beat)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.base import (
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
    register_algorithm,
    run_local_training,
)
from htfl_dist.runtime.wire import Payload


@dataclass
class LocalOptions:
    """Local has no options."""


class LocalClient(ClientAlgorithm):
    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        loss_sum, seen = run_local_training(
            client, self.context, lambda features, logits, y: F.cross_entropy(logits, y), generator
        )
        return TrainResult({}, loss_sum, seen)


register_algorithm("local", server=ServerAlgorithm, client=LocalClient, options=LocalOptions,
                   summary="no federation: CE on local data only")
