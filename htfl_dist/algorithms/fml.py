"""FML (Shen et al. 2020; HtFLlib ``FML``): deep mutual learning with a shared model.

Every client keeps its own model M_i; a shared "meme" model G (one architecture, see
``shared_model``) travels.
Each round a participant loads the server's G into a scratch copy G_i (it keeps no copy between
rounds, [C]) and trains M_i and G_i jointly, per batch

    L   = α·CE(M_i(x), y) + (1−α)·KL(p_g ‖ p)
    L_g = β·CE(G_i(x), y) + (1−β)·KL(p ‖ p_g)          α = β = 0.5 (total.sh)

with one backward of L + L_g (``kd: dml``, default: constant KL targets and batch-mean KL, so
M_i descends ∇L and G_i ∇L_g; ``kd: htfllib``: KL averaged over B·C and targets not detached),
then ``clip_grad_norm_(·, 10)`` on each model and a step of each optimiser (the client's for
M_i, a new one each round built as the client's, at the round's client lr, for G_i:
``optimizers.companion_optimizer``). It uploads G_i's parameters; the server's G is
their uniform mean (``avg: sample_weighted`` weights by n_i). Inference: argmax M_i(x); G is
never evaluated. |G| floats each way.

[I] G_i's buffers (BatchNorm statistics, if the architecture has any) start every round from the
initial G's, as in HtFLlib, whose server buffers never change; only parameters travel
(|G| floats), so the server does not average buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from htfl_dist.algorithms.blocks.model_part import (
    Average,
    DownloadedCopy,
    part_upload,
    part_upload_fields,
)
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    TrainResult,
)
from htfl_dist.algorithms.losses import MutualKD, fml_losses
from htfl_dist.algorithms.optimizers import companion_optimizer
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.shared_model import (
    SHARED_MODEL,
    SharedModelServer,
    check_member_name,
    clip_gradients,
)
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import bounded
from htfl_dist.payload import Payload, PayloadSpec


@dataclass
class FMLOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes HtFLlib HEAD's value (kd=htfllib; avg is uniform either way)."""
    kd: MutualKD | None = None
    """dml (default [P]): KL targets are constants, KL is the batch mean; htfllib ([C]):
    nn.KLDivLoss() 'mean' (÷B·C) and targets not detached."""
    avg: Average = "uniform"
    """Server mean of the uploaded G_i: uniform (HtFLlib, default) | sample_weighted (n_i / Σn,
    puts num_samples on the wire)."""
    alpha: float = bounded(0.5, at_least=0, at_most=1)
    """α: weight of CE in the local model's loss (total.sh -al 0.5; the flag default 1 turns KD off)."""
    beta: float = bounded(0.5, at_least=0, at_most=1)
    """β: weight of CE in the shared model's loss (total.sh -bt 0.5)."""
    shared_model: str | None = None
    """G's architecture (ARCH or ARCH:HEAD); default client 0's group member (HtFLlib)."""

    def validate(self) -> None:
        if self.kd is None:
            self.kd = "htfllib" if self.compat == "reference" else "dml"
        check_member_name(self.shared_model)


class FMLClient(ClientAlgorithm):
    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.shared_copy = DownloadedCopy(SHARED_MODEL, context)  # G_i, refilled from every download
        self.shared_floats = SHARED_MODEL.floats(context)

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        SHARED_MODEL.check(context, "FML")

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return part_upload_fields(SHARED_MODEL, context, context.options.avg)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options = self.options
        shared = self.shared_copy.load(knowledge, client.device)
        shared.train()
        shared_optimizer = companion_optimizer(client, shared.parameters(), self.context.train)

        def loss_fn(batch: Batch) -> torch.Tensor:
            local, mutual = fml_losses(batch.logits, shared(batch.x), batch.labels, options.alpha, options.beta,
                                       options.kd)
            return local + mutual

        def before_step() -> None:
            clip_gradients(client.model)
            clip_gradients(shared)

        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator,
                                            optimizers=[client.optimizer, shared_optimizer], before_step=before_step)
        return TrainResult(part_upload(SHARED_MODEL, shared, client, options.avg), loss_sum, seen)

    def theory_upload_floats(self, client: ClientState) -> int:
        """|G|: the shared model's parameters (n_i is an integer and not counted)."""
        return self.shared_floats


register_algorithm("fml", server=SharedModelServer, client=FMLClient, options=FMLOptions,
                   summary="mutual learning of local models with an averaged shared model (Shen et al. 2020)",
                   shares_parameters=True,
                   conformance=ConformanceHints(ranks_covered_by="fedmrl"))  # the same downloaded-copy block
