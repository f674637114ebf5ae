"""FedGH (Yi et al. 2023) (HtFLlib ``GH``): a server-trained global head.

Clients: the global head replaces h_i at round start (as in LG-FedAvg); the whole model is
trained with CE; afterwards the client uploads one prototype per class it holds,
P_i^c = mean of f_i(x) over its samples of class c, computed in eval mode without gradient on the
**post-update** model (m_i·K floats; no counts).

Server: a persistent global head H, initialised from client 0's initial head and never
re-averaged. Each round it is trained on every uploaded pair (P_i^c, c) with the batch-mean
CE(H(P), c): ``server_epochs`` (= 1, total.sh) shuffled epochs, mini-batches of the client
batch size, the last batch may be smaller, SGD(lr ``server_lr`` = 0.01) created afresh each
round. Every pair weighs the same. H goes to every client.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.blocks.model_part import HeadSharingOptions, PartServer, PartSharingClient
from htfl_dist.algorithms.class_rows import check_class_rows, class_means, class_row_fields
from htfl_dist.algorithms.interface import AlgorithmContext, ClientState
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import train_on_pairs
from htfl_dist.config import bounded
from htfl_dist.payload import Payload, PayloadSpec


@dataclass
class FedGHOptions(HeadSharingOptions):
    """``compat: reference`` changes nothing: the defaults are HtFLlib's with total.sh's flags
    (``-se 1``; the flag default of 100 epochs is not what the papers ran)."""

    server_epochs: int = bounded(1, at_least=1)
    """``-se``: epochs over the round's (prototype, class) pairs."""
    server_lr: float = bounded(0.01, above=0)
    """``-slr``: SGD learning rate of the server head."""
    server_batch_size: int | None = bounded(None, at_least=1, optional=True, note="or null: train.batch_size")
    """Mini-batch of pairs (default: the client batch size, as HtFLlib does)."""


class FedGHClient(PartSharingClient):
    """Uploads post-update class prototypes instead of the head.

    HtFLlib takes P_i^c over the HtFLlib training loader, whose ``drop_last`` leaves out the last
    n_i mod B samples. Our local training visits every training sample (it drops only a final
    batch of one), so the prototypes here are means over the client's **whole** training split
    (``class_rows.class_means``, eval mode, no gradient, after the update). Only the classes the
    client holds travel."""

    algorithm_name = "FedGH"

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return class_row_fields("protos", context.feature_dim, context.num_classes)

    def make_upload(self, client: ClientState) -> Payload:
        class_ids, protos = class_means(client, self.context.num_classes, "features")
        return {"class_ids": class_ids, "protos": protos.float()}

    def theory_upload_floats(self, client: ClientState) -> int:
        """m_i·K: one K-dim prototype per class the client holds."""
        return self.context.feature_dim * int(client.classes.numel())


class FedGHServer(PartServer):
    """The persistent head H (``head_module``) trained on the round's prototype pairs."""

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_class_rows(client_id, upload["class_ids"], upload["protos"], self.context.num_classes)

    def _pairs(self, uploads: dict[int, Payload]) -> tuple[torch.Tensor, torch.Tensor]:
        """All uploaded (P_i^c, c) pairs in client-id order (so the shuffle is world-size free)."""
        client_ids = sorted(uploads)
        rows = torch.cat([uploads[i]["protos"].float() for i in client_ids]).to(self.device)
        labels = torch.cat([uploads[i]["class_ids"] for i in client_ids]).to(self.device)
        return rows, labels

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        rows, labels = self._pairs(uploads)
        if rows.shape[0] == 0:
            return {}
        options, head = self.options, self.module
        optimizer = torch.optim.SGD(head.parameters(), lr=options.server_lr)  # re-created each round
        head.train()
        loss = train_on_pairs(rows, labels, lambda batch, batch_labels: F.cross_entropy(head(batch), batch_labels),
                              optimizer, epochs=options.server_epochs,
                              batch_size=options.server_batch_size or self.context.train.batch_size,
                              generator=generator)
        previous = self.row
        self.row = parameters.parameter_row(head)
        return {"server_loss": loss, "server_pairs": int(rows.shape[0]),
                "head_change": float((self.row - previous).norm())}


register_algorithm("fedgh", server=FedGHServer, client=FedGHClient, options=FedGHOptions,
                   summary="server trains a global head on client prototypes (Yi et al. 2023)",
                   shares_parameters=True, private_release=True,
                   conformance=ConformanceHints(ranks_covered_by="fedgen"))  # the same model-part block
