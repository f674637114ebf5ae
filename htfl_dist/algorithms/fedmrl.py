"""FedMRL (Yi et al., NeurIPS 2024, arXiv 2406.00488; HtFLlib ``FedMRL``): federated
model-heterogeneous Matryoshka representation learning.

Every client k keeps its own heterogeneous model F_k = F_k^hd ∘ F_k^ex (K-wide features) and a
personal projector P_k = Linear(d1 + K, K). A small homogeneous model G = G^hd ∘ G^ex, whose
representation is d1 ≤ K wide, is shared. A participant starts the round from the downloaded G
and trains all three on each batch:

    R^G = G^ex(x) ∈ R^d1,   R^F = F_k^ex(x) ∈ R^K
    R̃   = P_k([R^G ; R^F]) ∈ R^K                      adaptive representation fusion
    ŷ^G = G^hd(R̃[:d1]),     ŷ^F = F_k^hd(R̃)            nested (Matryoshka) representations
    ℓ   = m1·CE(ŷ^G, y) + m2·CE(ŷ^F, y)                m1 = m2 = 1

with one backward and a step for F_k (the client's optimiser), G and P_k (new ones each round,
built as the client's at the round's client lr: ``optimizers.companion_optimizer``). The client
uploads G's parameters; the server's new G is Σ_k (n_k / Σn)·G_k over the round's uploaders.
Inference is the combined model without the global header, argmax F_k^hd(R̃) (the paper's
"mix-large"); ``test_acc_head`` is the client's heterogeneous model alone, argmax F_k^hd(F_k^ex(x))
(its "single-large"). |G| floats each way.

HtFLlib's departures, each an option (``compat: reference`` sets those left unset): the uniform
mean (``avg``), a projector that is trained within a round and then thrown away, so the next
round and evaluation use its initial weights (``projector: reset``), evaluation through the
freshly averaged G instead of the client's own trained copy (``eval_extractor: global``), and a G
whose extractor stays K wide and is averaged down to d1 by ``AdaptiveAvgPool1d`` instead of
having a d1-wide last layer (``small_rep: pool``). Under ``model.init=htfllib`` the initial G and
every client's projector are drawn right after seeding torch with the run seed, as HtFLlib draws
them (its server builds G first thing after ``torch.manual_seed(0)``, and each client seeds
``torch.manual_seed(0)`` before its ``nn.Linear``), so all projectors start alike.

G's buffers (BatchNorm statistics, if its architecture has any) never travel: only parameters
do (the paper's |G|). A client's own G keeps its buffers; a scratch G starts from the initial G's.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.blocks.model_part import (
    Average,
    DownloadedCopy,
    ModelPart,
    part_upload,
    part_upload_fields,
)
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    TrainResult,
)
from htfl_dist.algorithms.optimizers import companion_optimizer
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.shared_model import (
    SharedModelServer,
    build_shared_model,
    check_member_name,
    check_shared_model,
    shared_member,
    shared_model_template,
)
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import bounded
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel, build_model
from htfl_dist.payload import Payload, PayloadSpec
from htfl_dist.seeding import seed_global_torch

ProjectorLife = Literal["persistent", "reset"]
EvalExtractor = Literal["local", "global"]
SmallRepresentation = Literal["fc", "pool"]


@dataclass
class FedMRLOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes HtFLlib HEAD's value (avg=uniform, projector=reset,
    eval_extractor=global, small_rep=pool)."""
    rep_dim: int = bounded(128, at_least=1)
    """d1, the width of G's representation and of the nested prefix R̃[:d1] (1 ≤ d1 ≤ K). The paper
    sweeps it (smaller d1 did better); 128 is HtFLlib's ``-sfd`` default."""
    avg: Average | None = None
    """Server mean of the uploaded G_k: sample_weighted (n_k / Σn over the uploaders, the paper and
    the authors' code; puts n_k on the wire) | uniform (HtFLlib)."""
    projector: ProjectorLife | None = None
    """persistent (paper): P_k is the client's own, trained on across rounds and checkpointed;
    reset (HtFLlib, which never saves the trained projector): each round trains a copy of the
    initial P_k and drops it, so evaluation uses the initial P_k."""
    eval_extractor: EvalExtractor | None = None
    """Which G^ex (and buffers) inference fuses: local (paper: the client's combined model as it
    trained it; a client that has not trained yet holds the initial G) | global (HtFLlib: the
    server's freshly averaged G)."""
    small_rep: SmallRepresentation | None = None
    """How G^ex gives d1 dimensions: fc (paper, the authors' code: its last extractor layer is d1
    wide) | pool (HtFLlib's BaseHeadSplit: built K wide, then AdaptiveAvgPool1d(d1); G^hd is a
    fresh Linear(d1, C))."""
    global_weight: float = bounded(1.0, at_least=0)
    """m1, the weight of CE(ŷ^G, y) (the paper sets m1 = m2 = 1, as HtFLlib)."""
    local_weight: float = bounded(1.0, at_least=0)
    """m2, the weight of CE(ŷ^F, y)."""
    shared_model: str | None = None
    """G's architecture (ARCH or ARCH:HEAD); default client 0's group member (HtFLlib)."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.avg is None:
            self.avg = "uniform" if reference else "sample_weighted"
        if self.projector is None:
            self.projector = "reset" if reference else "persistent"
        if self.eval_extractor is None:
            self.eval_extractor = "global" if reference else "local"
        if self.small_rep is None:
            self.small_rep = "pool" if reference else "fc"
        check_member_name(self.shared_model)


# --------------------------------------------------------------------------- the maths


def fuse(small_features: torch.Tensor, local_features: torch.Tensor, projector: nn.Module) -> torch.Tensor:
    """R̃ = P([R^G ; R^F]): G's representation first, then the client's, through the projector."""
    return projector(torch.cat((small_features, local_features), dim=1))


def matryoshka_loss(fused: torch.Tensor, labels: torch.Tensor, small_head: nn.Module, local_head: nn.Module,
                    rep_dim: int, global_weight: float = 1.0, local_weight: float = 1.0) -> torch.Tensor:
    """m1·CE(G^hd(R̃[:, :d1]), y) + m2·CE(F^hd(R̃), y): the coarse d1-wide prefix feeds the shared
    header, the whole K-wide representation the client's own (each CE a batch mean)."""
    coarse = F.cross_entropy(small_head(fused[:, :rep_dim]), labels)
    fine = F.cross_entropy(local_head(fused), labels)
    return global_weight * coarse + local_weight * fine


# --------------------------------------------------------------------------- the small model G


def _small_context(context: AlgorithmContext) -> AlgorithmContext:
    """The context G is built in: ``fc`` builds the member with K = d1, ``pool`` at the run's K."""
    if context.options.small_rep == "fc":
        return dataclasses.replace(context, feature_dim=context.options.rep_dim)
    return context


def _pooled(model: SplitModel, rep_dim: int, num_classes: int) -> SplitModel:
    """HtFLlib's global model: the K-wide extractor averaged down to d1, and a Linear(d1, C) header."""
    extractor = nn.Sequential(model.feature_extractor, nn.AdaptiveAvgPool1d(rep_dim))
    return SplitModel(extractor, nn.Linear(rep_dim, num_classes), rep_dim, arch=f"{model.arch}+pool{rep_dim}")


@dataclass(frozen=True)
class SmallModelPart(ModelPart):
    """G on the wire (``small_model``), built from its own seeded streams by the server and every
    client alike, so all start from the same G."""

    name: str = "small_model"

    def template(self, context: AlgorithmContext) -> nn.Module:
        model = shared_model_template(_small_context(context))
        if context.options.small_rep == "fc":
            return model
        with torch.device("meta"):
            return _pooled(model, context.options.rep_dim, context.num_classes)

    def initial(self, context: AlgorithmContext) -> nn.Module:
        """From the (seed, "shared-model") stream, the pooled header from its own; under
        ``model.init=htfllib`` all of it drawn right after seeding torch with the run seed, as
        HtFLlib's server builds it first thing after ``torch.manual_seed``. The caller's RNG is untouched."""
        small_context = _small_context(context)
        pool = context.options.small_rep == "pool"
        with torch.random.fork_rng(devices=[]):
            if context.model_init == "htfllib":
                torch.manual_seed(context.seed)
                model = build_model(shared_member(context), num_classes=context.num_classes,
                                    feature_dim=small_context.feature_dim, in_channels=context.in_channels,
                                    image_size=context.image_size, options=context.model_options)
            else:
                model = build_shared_model(small_context)
                seed_global_torch(context.seed, "fedmrl-small-head")
            return _pooled(model, context.options.rep_dim, context.num_classes) if pool else model

    def check(self, context: AlgorithmContext, algorithm: str) -> None:
        rep_dim = context.options.rep_dim
        if rep_dim > context.feature_dim:
            raise ConfigError(f"config key 'algo.rep_dim' is {rep_dim}, above model.feature_dim="
                              f"{context.feature_dim}: {algorithm} nests G's d1-wide representation in the "
                              f"first d1 of the K fused dimensions; set algo.rep_dim <= {context.feature_dim}")
        check_shared_model(_small_context(context), algorithm)


SMALL_MODEL = SmallModelPart()


def _own_small(client: ClientState) -> SplitModel:
    """The client's own G (``init_client`` puts it among the client's modules)."""
    return cast(SplitModel, client.modules["small_model"])


def build_projector(context: AlgorithmContext) -> nn.Linear:
    """P_k = Linear(d1 + K, K) from torch's global RNG (the runtime seeds it per client before
    ``init_client``), or, under ``model.init=htfllib``, drawn right after seeding torch with the run
    seed, so every client's starts alike (HtFLlib's ``torch.manual_seed(0)`` before it)."""
    width = context.options.rep_dim + context.feature_dim
    if context.model_init != "htfllib":
        return nn.Linear(width, context.feature_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(context.seed)
        return nn.Linear(width, context.feature_dim)


# --------------------------------------------------------------------------- client and server


class FedMRLClient(ClientAlgorithm):
    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.downloaded = DownloadedCopy(SMALL_MODEL, context)  # G for eval_extractor=global
        self.small_floats = SMALL_MODEL.floats(context)
        self.evaluation_small: SplitModel | None = None  # the G^ex that predict fuses

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        SMALL_MODEL.check(context, "FedMRL")

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return part_upload_fields(SMALL_MODEL, context, context.options.avg)

    def init_client(self, client: ClientState) -> None:
        """P_k, and with eval_extractor=local the client's own G (the initial G until it trains)."""
        client.modules["projector"] = build_projector(self.context).to(client.device)
        if self.options.eval_extractor == "local":
            client.modules["small_model"] = SMALL_MODEL.initial(self.context).to(client.device)

    @torch.no_grad()
    def small_model(self, client: ClientState, knowledge: Payload) -> SplitModel:
        """The downloaded G: its parameters loaded into the client's own G (local), or into a scratch
        G whose buffers are reset to the initial G's (global, as HtFLlib's server buffers never change)."""
        if self.options.eval_extractor == "global":
            return cast(SplitModel, self.downloaded.load(knowledge, client.device))  # SMALL_MODEL's G
        small = _own_small(client)
        parameters.load_parameter_row(small, knowledge[SMALL_MODEL.name].to(client.device))
        return small

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options = self.options
        small = self.small_model(client, knowledge)
        own = client.modules["projector"]
        projector = own if options.projector == "persistent" else copy.deepcopy(own)
        small.train()
        projector.train()
        train = self.context.train
        optimizers = [client.optimizer, companion_optimizer(client, small.parameters(), train),
                      companion_optimizer(client, projector.parameters(), train)]

        def loss_fn(batch: Batch) -> torch.Tensor:
            fused = fuse(small.features(batch.x), batch.features, projector)
            return matryoshka_loss(fused, batch.labels, small.head, client.model.head, options.rep_dim,
                                   options.global_weight, options.local_weight)

        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator, optimizers=optimizers)
        return TrainResult(part_upload(SMALL_MODEL, small, client, options.avg), loss_sum, seen)

    def theory_upload_floats(self, client: ClientState) -> int:
        """|G|: the small model's parameters (n_k is an integer and not counted)."""
        return self.small_floats

    def prepare_evaluation(self, client: ClientState, knowledge: Payload) -> None:
        """The G^ex that inference fuses: the downloaded G (global) or the client's own (local)."""
        self.evaluation_small = self.small_model(client, knowledge) if self.options.eval_extractor == "global" \
            else _own_small(client)

    @torch.no_grad()
    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """argmax F_k^hd(P_k([G^ex(x) ; F_k^ex(x)])), in eval mode."""
        if inputs is None or self.evaluation_small is None:
            raise ValueError("FedMRL predicts from the batch's inputs, after prepare_evaluation")
        small, projector = self.evaluation_small, client.modules["projector"]
        small.eval()
        projector.eval()
        return client.model.head(fuse(small.features(inputs), features, projector)).argmax(dim=1)


class FedMRLServer(SharedModelServer):
    """FML's server over the small model: G = Σ_{k∈U} w_k·G_k, w_k = n_k/Σn or 1/|U|."""

    part = SMALL_MODEL


register_algorithm("fedmrl", server=FedMRLServer, client=FedMRLClient, options=FedMRLOptions,
                   summary="a shared small model fused with each local model through a personal projector, "
                           "Matryoshka representations with two heads (Yi et al. 2024)",
                   shares_parameters=True)
