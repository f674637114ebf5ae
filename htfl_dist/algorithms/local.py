"""Local: every client trains alone on its own data (the lower bound FL must beat)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.interface import ClientAlgorithm, ClientState, ServerAlgorithm, TrainResult
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import run_local_training
from htfl_dist.payload import Payload


@dataclass
class LocalOptions:
    """Local has no options."""


class LocalClient(ClientAlgorithm):
    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        loss_sum, seen = run_local_training(
            client, self.context, lambda batch: F.cross_entropy(batch.logits, batch.labels), generator
        )
        return TrainResult({}, loss_sum, seen)


register_algorithm("local", server=ServerAlgorithm, client=LocalClient, options=LocalOptions,
                   summary="no federation: CE on local data only")
