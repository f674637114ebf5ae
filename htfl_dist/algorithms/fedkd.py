"""FedKD (Wu et al. 2022; HtFLlib ``FedKD``): a mentor per client, an SVD-compressed shared mentee.

Each client keeps, across rounds (in ``client.modules``, so they are checkpointed): its mentor
M_i (the local model, the only one evaluated), a mentee G_i of the shared architecture (``shared_model``; all
mentees start as the same seeded initial G) and W_h = Linear(K, K, bias=False). Per batch, with
r = f_i(x), r_g = f_g(x), z = h_i(r), z_g = h_g(r_g) and S = CE(z, y) + CE(z_g, y) (not detached),

    L   = CE(z, y)   + KL(p_g ‖ p)/S + MSE(r, W_h r_g)/S
    L_g = CE(z_g, y) + KL(p ‖ p_g)/S + MSE(r, W_h r_g)/S

(KL averaged over B·C with targets not detached, MSE over B·K; the hidden loss counted twice as
in the official code), one backward of L + L_g, ``clip_grad_norm_(·, 10)`` on each of M_i, G_i and
W_h, and a step of three optimisers (the client's for M_i, new ones each round: plain SGD with
``mentee_lr`` for G_i, and for W_h plain SGD with ``wh_lr`` or, unset, one built as the client's at
the round's client lr, ``optimizers.companion_optimizer``).

After training the client SVD-compresses (``compression``) with energy
T_t = T_start + (t/R)(T_end − T_start) either its mentee's update ΔG_i = G_i − G_sync
(``compress: update``, default [P], official FedKD) or the mentee itself (``weights``, HtFLlib).
The server recovers every upload, takes the uniform mean over the uploaders, re-compresses it with
T_t and sends it to every client, which overwrites its mentee's parameters with the recovered
tensors (``update``: G_sync ← G_sync + Δ̄, so all mentees stay identical; the mentee's BatchNorm
buffers stay local). A client installs a download at the start of training and before evaluation
(the runtime's two deliveries of the server's knowledge), at most once per server update.

Wire: ``ranks`` (−1 = raw) and per parameter i the flattened factors ``p{i}.u/s/v``; the download
also carries ``version`` (the number of server updates so far; 0 = nothing to install yet, the
clients already hold the initial G). Floats each way = Σ_p cost_p.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.compression import (
    RankRule,
    check_compressed,
    compress_tensors,
    compressed_fields,
    empty_compressed,
    float_count,
    payload_cost,
    recover_tensors,
)
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.losses import fedkd_losses
from htfl_dist.algorithms.optimizers import companion_optimizer
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.shared_model import (
    build_shared_model,
    check_member_name,
    check_shared_model,
    clip_gradients,
    parameter_shapes,
)
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import bounded
from htfl_dist.errors import HtflError, ProtocolError
from htfl_dist.models.base import SplitModel
from htfl_dist.payload import Field, Payload, PayloadSpec

Compress = Literal["update", "weights"]


@dataclass
class FedKDOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes HtFLlib HEAD's value (svd_rank=htfllib, compress=weights)."""
    svd_rank: RankRule | None = None
    """fixed (default [I]): r = min{n ≥ 1: Σ_{j≤n} σ² ≥ T·Σσ²} on [shape[0], rest], raw when cheaper;
    htfllib ([C]): per-slice conv SVD and the off-by-one rule that can give rank 0 (zeros)."""
    compress: Compress | None = None
    """update (default [P], official FedKD): compress ΔG = G_i − G_sync; weights ([C] HtFLlib): G_i itself."""
    t_start: float = bounded(0.95, above=0, at_most=1)
    """T_start (-Ts): energy kept in round 0."""
    t_end: float = bounded(0.98, above=0, at_most=1)
    """T_end (-Te; total.sh 0.98, the FedTGP appendix says 0.95)."""
    global_rounds: int = bounded(2000, at_least=1)
    """R of the energy schedule T_t = T_start + (t/R)(T_end − T_start) (HtFLlib -gr default 2000)."""
    mentee_lr: float = bounded(0.01, above=0)
    """-mlr: SGD learning rate of the mentee."""
    wh_lr: float | None = bounded(None, above=0, optional=True)
    """SGD learning rate of W_h (default: the client's optimizer and round lr, as HtFLlib)."""
    shared_model: str | None = None
    """The mentee's architecture (ARCH or ARCH:HEAD); default client 0's group member (HtFLlib)."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.svd_rank is None:
            self.svd_rank = "htfllib" if reference else "fixed"
        if self.compress is None:
            self.compress = "weights" if reference else "update"
        check_member_name(self.shared_model)


def energy_at(options: FedKDOptions, round_index: int) -> float:
    """T_t = T_start + (t/R)(T_end − T_start) for the 0-based round t; [I] t is capped at R, so T
    stays between T_start and T_end in runs longer than ``global_rounds``."""
    progress = min(round_index, options.global_rounds) / options.global_rounds
    return options.t_start + progress * (options.t_end - options.t_start)


class SyncState(nn.Module):
    """A client's record of the server's shared model: ``version`` = server updates installed,
    ``row`` = G_sync's parameters (``compress: update`` only; empty otherwise). Buffers, so the
    runtime checkpoints them with the client."""

    version: torch.Tensor  # buffers (register_buffer)
    row: torch.Tensor

    def __init__(self, row: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("version", torch.zeros((), dtype=torch.int64))
        self.register_buffer("row", row)


def _sync(client: ClientState) -> SyncState:
    """The client's :class:`SyncState` (``init_client`` puts it among the client's modules)."""
    return cast(SyncState, client.modules["sync"])


def _mentee(client: ClientState) -> SplitModel:
    """The client's mentee, the shared model G (``init_client`` puts it among the client's modules)."""
    return cast(SplitModel, client.modules["mentee"])


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class FedKDClient(ClientAlgorithm):
    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.shapes = parameter_shapes(context)
        self.costs: dict[int, int] = {}  # client id → floats of its last upload (Σ cost_p)

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        check_shared_model(context, "FedKD")

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return compressed_fields(parameter_shapes(context))

    def init_client(self, client: ClientState) -> None:
        """Mentee = the seeded initial G (identical on every client), W_h from the client's own
        seeded stream, the sync record at version 0."""
        mentee = build_shared_model(self.context)
        row = parameters.parameter_row(mentee).reshape(-1) if self.options.compress == "update" else torch.empty(0)
        w_h = nn.Linear(self.context.feature_dim, self.context.feature_dim, bias=False)
        client.modules.update(mentee=mentee.to(client.device), w_h=w_h.to(client.device), sync=SyncState(row))

    @torch.no_grad()
    def install(self, client: ClientState, knowledge: Payload) -> None:
        """Overwrite the mentee's parameters with the downloaded shared model, once per server update."""
        sync = _sync(client)
        version, installed = int(knowledge["version"][0]), int(sync.version)
        if version <= installed:
            return
        update = self.options.compress == "update"
        if update and version != installed + 1:
            raise HtflError(
                f"FedKD client {client.client_id} holds server update {installed} but received update {version}: "
                f"with algo.compress=update every client must receive every update; use eval_every=1 or "
                f"join_ratio=1, or algo.compress=weights")
        received = _flat(recover_tensors({k: v.cpu() for k, v in knowledge.items()}, self.shapes,
                                         self.options.svd_rank))
        if update:
            sync.row += received  # G_sync ← G_sync + Δ̄ (the same float32 sum on every client)
            received = sync.row
        parameters.load_parameter_row(client.modules["mentee"], received.to(client.device))
        sync.version.fill_(version)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options = self.options
        self.install(client, knowledge)
        mentee, w_h, sync = _mentee(client), client.modules["w_h"], _sync(client)
        mentee.train()
        w_h.train()
        mentee_optimizer = torch.optim.SGD(mentee.parameters(), lr=options.mentee_lr)
        projection_optimizer = (companion_optimizer(client, w_h.parameters(), self.context.train)
                                if options.wh_lr is None else torch.optim.SGD(w_h.parameters(), lr=options.wh_lr))

        def loss_fn(batch: Batch) -> torch.Tensor:
            shared_features, shared_logits = mentee.forward_with_features(batch.x)
            local, shared = fedkd_losses(batch.features, batch.logits, shared_logits, w_h(shared_features),
                                         batch.labels)
            return local + shared

        def before_step() -> None:
            for module in (client.model, mentee, w_h):
                clip_gradients(module)

        loss_sum, seen = run_local_training(
            client, self.context, loss_fn, generator, before_step=before_step,
            optimizers=[client.optimizer, mentee_optimizer, projection_optimizer])
        tensors = [p.detach().cpu() for p in mentee.parameters()]
        if options.compress == "update":
            base = sync.row.split([math.prod(shape) for shape in self.shapes])
            tensors = [tensor - start.view_as(tensor) for tensor, start in zip(tensors, base, strict=True)]
        upload, cost = compress_tensors(tensors, energy_at(options, round_index), options.svd_rank)
        self.costs[client.client_id] = cost
        return TrainResult(upload, loss_sum, seen)

    def theory_upload_floats(self, client: ClientState) -> int:
        """Σ_p cost_p of this client's last upload (r(m+n+1), o·i·r(kh+kw+1) or numel)."""
        return self.costs.get(client.client_id, 0)

    def prepare_evaluation(self, client: ClientState, knowledge: Payload) -> None:
        """The server sends to every client: install it now, though only M_i is evaluated."""
        self.install(client, knowledge)


class FedKDServer(ServerAlgorithm):
    """Recover the uploads, take their uniform mean, re-compress it with T_t, send it to everyone."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return (Field("version", torch.int64, max_rows=1), *compressed_fields(parameter_shapes(context)))

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.shapes = parameter_shapes(context)
        self.version = 0
        self.payload = empty_compressed(self.shapes)

    def download(self) -> Payload:
        return {"version": torch.tensor([self.version], dtype=torch.int64), **self.payload}

    def theory_download_floats(self) -> int:
        """Σ_p cost_p of the current download (0 before the first update)."""
        return payload_cost(self.payload, self.shapes, self.options.svd_rank)

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        problem = check_compressed(upload, self.shapes, self.options.svd_rank)
        if problem is not None:
            raise ProtocolError(f"client {client_id} sent a malformed compressed shared model: {problem}")

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        rule = self.options.svd_rank
        client_ids = sorted(uploads)  # fixed order: the float64 sums do not depend on ranks
        sums = [torch.zeros(shape, dtype=torch.float64) for shape in self.shapes]
        for client_id in client_ids:
            for total, tensor in zip(sums, recover_tensors(uploads[client_id], self.shapes, rule), strict=True):
                total += tensor.double()
        mean = [(total / len(client_ids)).float() for total in sums]
        energy = energy_at(self.options, round_index)
        self.payload, cost = compress_tensors(mean, energy, rule)
        self.version += 1
        count = len(self.shapes)
        return {
            "energy": energy,
            "shared_floats": sum(math.prod(shape) for shape in self.shapes),
            "floats_up": sum(float_count(uploads[c], count) for c in client_ids),
            "floats_up_theory": sum(payload_cost(uploads[c], self.shapes, rule) for c in client_ids),
            "floats_down": float_count(self.payload, count),
            "floats_down_theory": cost,
            "ranks_down": self.payload["ranks"].tolist(),
            "mean_norm": float(_flat(mean).norm()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"version": torch.tensor(self.version, dtype=torch.int64),
                **{f"payload.{name}": tensor for name, tensor in self.payload.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.payload = {name: state[f"payload.{name}"].cpu() for name in empty_compressed(self.shapes)}


register_algorithm("fedkd", server=FedKDServer, client=FedKDClient, options=FedKDOptions,
                   summary="mentor/mentee distillation with an SVD-compressed shared mentee (Wu et al. 2022)",
                   shares_parameters=True,
                   # the conformance checks' mentee: the smallest HtCNN8 member (the default, htcnn1, spends
                   # 18 of each round's 25 s in float64 SVDs of its 512x4608 layer; htcnn2's is 512x1024),
                   # still compressed per layer and sent both ways; its messages travel as FedMRL's do
                   # (the same downloaded-copy block)
                   conformance=ConformanceHints(overrides=("algo.shared_model=htcnn2",), ranks_covered_by="fedmrl"))
