"""FML (Shen et al. 2020) as the baselines spec §5 describes it (HtFLlib ``FML``).

Every client keeps its own model M_i; a shared "meme" model G (one architecture, §7) travels.
Each round a participant loads the server's G into a scratch copy G_i (it keeps no copy between
rounds, [C]) and trains M_i and G_i jointly, per batch

    L   = α·CE(M_i(x), y) + (1−α)·KL(p_g ‖ p)
    L_g = β·CE(G_i(x), y) + (1−β)·KL(p ‖ p_g)          α = β = 0.5 (total.sh)

with one backward of L + L_g (``kd: dml``, default: constant KL targets and batch-mean KL, so
M_i descends ∇L and G_i ∇L_g; ``kd: htfllib``: KL averaged over B·C and targets not detached),
then ``clip_grad_norm_(·, 10)`` on each model and a step of each optimiser (the client's SGD for
M_i, a new SGD with the client lr for G_i). It uploads G_i's parameters; the server's G is
their uniform mean (``avg: sample_weighted`` weights by n_i). Inference: argmax M_i(x); G is
never evaluated. |G| floats each way.

[I] G_i's buffers (BatchNorm statistics, if the architecture has any) start every round from the
initial G's, as in HtFLlib, whose server buffers never change; only parameters travel (the spec's
|G| floats), so the server does not average buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.losses import MutualKD, fml_losses
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.shared_model import (
    build_shared_model,
    check_member_name,
    check_shared_model,
    clip_gradients,
    shared_model_template,
)
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec

Average = Literal["uniform", "sample_weighted"]


@dataclass
class FMLOptions:
    compat: Literal["paper", "htfllib"] = "paper"
    """htfllib: every knob left unset takes HtFLlib HEAD's value (kd=htfllib; avg is uniform either way)."""
    kd: MutualKD | None = None
    """dml (default [P]): KL targets are constants, KL is the batch mean; htfllib ([C]):
    nn.KLDivLoss() 'mean' (÷B·C) and targets not detached."""
    avg: Average = "uniform"
    """Server mean of the uploaded G_i: uniform (HtFLlib, default) | sample_weighted (n_i / Σn,
    puts num_samples on the wire)."""
    alpha: float = 0.5
    """α: weight of CE in the local model's loss (total.sh -al 0.5; the flag default 1 turns KD off)."""
    beta: float = 0.5
    """β: weight of CE in the shared model's loss (total.sh -bt 0.5)."""
    shared_model: str | None = None
    """G's architecture (ARCH or ARCH:HEAD); default client 0's group member (HtFLlib)."""

    def validate(self) -> None:
        if self.kd is None:
            self.kd = "htfllib" if self.compat == "htfllib" else "dml"
        for key in ("alpha", "beta"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"config key 'algo.{key}' must be in [0, 1], got {value}")
        check_member_name(self.shared_model)


def sample_count(client: ClientState) -> torch.Tensor:
    """n_i = size of the client's full training split, int64 [1] (not counted as floats)."""
    return torch.tensor([client.train_y.shape[0]], dtype=torch.int64)


def shared_field(context: AlgorithmContext) -> Field:
    return parameters.parameter_field("shared", shared_model_template(context))


class FMLClient(ClientAlgorithm):
    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.scratch: nn.Module | None = None  # G_i, refilled from the download every round
        self.initial_buffers: dict[str, torch.Tensor] = {}
        self.shared_floats = shared_field(context).row_numel()

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        check_shared_model(context, "FML")

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        counts = (Field("num_samples", torch.int64, max_rows=1),) if context.options.avg == "sample_weighted" else ()
        return (shared_field(context), *counts)

    @torch.no_grad()
    def download_shared(self, knowledge: Payload, device: torch.device) -> nn.Module:
        """G_i = the downloaded G: its parameters from the download, its buffers the initial G's."""
        if self.scratch is None:
            self.scratch = build_shared_model(self.context).to(device)
            self.initial_buffers = {name: b.detach().clone() for name, b in self.scratch.named_buffers()}
        scratch = self.scratch.to(device)
        parameters.load_parameter_row(scratch, knowledge["shared"].to(device))
        for name, buffer in scratch.named_buffers():
            buffer.copy_(self.initial_buffers[name])
        return scratch

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options = self.options
        shared = self.download_shared(knowledge, client.device)
        shared.train()
        shared_optimizer = torch.optim.SGD(shared.parameters(), lr=self.context.train.lr)

        def loss_fn(batch: Batch) -> torch.Tensor:
            local, mutual = fml_losses(batch.logits, shared(batch.x), batch.labels, options.alpha, options.beta,
                                       options.kd)
            return local + mutual

        def before_step() -> None:
            clip_gradients(client.model)
            clip_gradients(shared)

        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator,
                                            optimizers=[client.optimizer, shared_optimizer], before_step=before_step)
        upload = {"shared": parameters.parameter_row(shared)}
        if options.avg == "sample_weighted":
            upload["num_samples"] = sample_count(client)
        return TrainResult(upload, loss_sum, seen)

    def theory_upload_floats(self, client: ClientState) -> int:
        """|G|: the shared model's parameters (n_i is an integer and not counted)."""
        return self.shared_floats


class FMLServer(ServerAlgorithm):
    """G = Σ_{i∈U} w_i·G_i over parameters, w_i = 1/|U| (uniform) or n_i/Σn (sample_weighted);
    starts as the seeded initial G every client also builds."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return (shared_field(context),)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.shared = parameters.parameter_row(build_shared_model(context))  # float32 [1, |G|], CPU

    def download(self) -> Payload:
        return {"shared": self.shared}

    def theory_download_floats(self) -> int:
        """|G|."""
        return self.shared.shape[1]

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        if upload["shared"].shape[0] != 1:
            raise ProtocolError(f"client {client_id} sent {upload['shared'].shape[0]} shared-model rows, expected 1")
        if self.options.avg == "sample_weighted":
            counts = upload["num_samples"]
            if counts.shape[0] != 1 or int(counts[0]) <= 0:
                raise ProtocolError(f"client {client_id} sent num_samples={counts.tolist()}, expected one count > 0")

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        if not uploads:  # every upload screened out: keep G
            return {}
        client_ids = sorted(uploads)
        rows = [uploads[client_id]["shared"].float().cpu() for client_id in client_ids]
        weights = [float(uploads[c]["num_samples"][0]) for c in client_ids] \
            if self.options.avg == "sample_weighted" else None
        previous = self.shared
        self.shared = parameters.average_rows(rows, weights)
        return {"shared_uploads": len(uploads), "shared_change": float((self.shared - previous).norm())}

    def state_dict(self) -> dict[str, Any]:
        return {"shared": self.shared}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shared = state["shared"].float().cpu()


register_algorithm("fml", server=FMLServer, client=FMLClient, options=FMLOptions,
                   summary="mutual learning of local models with an averaged shared model (Shen et al. 2020)",
                   shares_parameters=True)
