"""Local: every client trains alone on its own data (the lower bound FL must beat)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from htfl_dist.algorithms.interface import ClientAlgorithm, ClientState, ServerAlgorithm, TrainResult
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import batch_cross_entropy, run_batched_training, run_local_training
from htfl_dist.payload import Payload


@dataclass
class LocalOptions:
    """Local has no options."""


class LocalClient(ClientAlgorithm):
    capturable_step = True  # its loss has no host sync (written for vmap: torch.where and gathers)
    trains_concurrently = True  # keeps nothing on self

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        loss_sum, seen = run_local_training(client, self.context, batch_cross_entropy, generator)
        return TrainResult({}, loss_sum, seen)

    def train_group(self, clients: list[ClientState], knowledge: Payload, round_index: int,
                    generators: list[torch.Generator]) -> list[TrainResult]:
        totals = run_batched_training(clients, self.context, batch_cross_entropy, generators)
        return [TrainResult({}, loss_sum, seen) for loss_sum, seen in totals]


register_algorithm("local", server=ServerAlgorithm, client=LocalClient, options=LocalOptions,
                   summary="no federation: CE on local data only",
                   # it trains the prototype client's half and sends nothing
                   conformance=ConformanceHints(ranks_covered_by="fedproto"))
