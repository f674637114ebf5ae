"""FedL2G (Zhang et al., "Learning to Guide Local Training in Heterogeneous Federated Learning",
arXiv 2410.06490; HtFLlib's ``FedL2G-feat`` and ``FedL2G-logit``).

Prototype methods pull each client towards data-derived class vectors, which need not help the
client's own objective. FedL2G keeps one *trainable* guiding vector g^c per class on the server
and learns it so that training towards it lowers the clients' cross-entropy on data the step did
not see. Each client holds out a quiz set Q_i and trains on the rest, its study set S_i.

Local training (the guiding vectors G fixed):

    L_i(θ; G) = CE(h(f(x); θ), y) + ℓ_g,   ℓ_g = mean‖v(x; θ) − g^y‖² / W   (MSE over elements)

with v the feature f(x) (``guide=feature``, W = K) or the logits z (``guide=logit``, W = C).
Learning to guide, after local training: one pseudo SGD step on study batches,
θ′(G) = θ − η ∇_θ L_i(θ; G), then the quiz loss CE(θ′(G); Q_i) differentiated w.r.t. G. Its
gradient, −η (∂²L_i/∂G∂θ)ᵀ ∇_θ′ CE, needs only first-order derivatives w.r.t. θ. Rows of classes
absent from the study batches are exactly 0; the client uploads the others. The server averages
each class's rows over the clients that sent one and takes an SGD step, G ← G − η_s·ḡ.
Up m_i·W floats per client (m_i = classes in its study batches), down C·W.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch.func import functional_call

from htfl_dist.algorithms.class_rows import ClassMeans, check_class_rows, class_row_fields
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import Batch, gradient_clipper, run_local_training
from htfl_dist.config import bounded
from htfl_dist.config.rules import Identity
from htfl_dist.errors import ConfigError
from htfl_dist.models.base import SplitModel
from htfl_dist.payload import Payload, PayloadSpec
from htfl_dist.seeding import torch_generator

Guide = Literal["feature", "logit"]

AUTHORS_SERVER_LR: dict[str, float] = {"feature": 100.0, "logit": 0.1}
"""η_s in the authors' run script (FedL2G repository, ``run_me.sh``: ``-slr 1e2`` for the feature
guide, ``-slr 0.1`` for the logit guide); HtFLlib's own default is 0.01 for both."""
REFERENCE_CLIP_NORM = 100.0
"""The reference code clips the client model's gradient and the server's guiding-vector gradient
to norm 100."""
REFERENCE_WARM_UP_ROUNDS = 50
"""HtFLlib's ``warm_up_rounds`` default: rounds in which clients only run the learning-to-guide step."""


@dataclass
class FedL2GOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes HtFLlib's value (clip_grad_norm=100, warm_up_rounds=50,
    quiz_from=first)."""
    guide: Guide = "feature"
    """What the guiding vectors guide: ``feature`` (FedL2G-f: f(x) towards g^y, W = K; default)
    or ``logit`` (FedL2G-l: the logits z towards g^y, W = C)."""
    server_lr: float | None = bounded(None, above=0, optional=True, note="unset: the authors' value for the guide")
    """η_s, the server's SGD rate on G; unset: the authors' run script, 100 (feature) or 0.1 (logit)."""
    study_batches: int = bounded(1, at_least=1)
    """Study batches (of ``train.batch_size``) in the pseudo step (HtFLlib ``meta_study_batches``)."""
    quiz_batches: int = bounded(1, at_least=1)
    """The quiz set is ``quiz_batches × train.batch_size`` samples (HtFLlib ``meta_quiz_batches``)."""
    quiz_from: Literal["random", "first"] | None = None
    """Which samples form the quiz set, fixed for the run: ``random`` (a subset drawn from
    (seed, client id); default) or ``first`` (the first ones in the stored order, HtFLlib)."""
    warm_up_rounds: int | None = bounded(None, at_least=0, optional=True)
    """Rounds at the start in which clients skip local training and only learn G (HtFLlib: 50,
    and it does not evaluate them; here they are evaluated like any round); default 0."""
    clip_grad_norm: float | None = bounded(None, identity=Identity(hashed_as="clip_norm"), at_least=0,
                                           optional=True, note="0: no clipping; null: the compat preset's")
    """Clip the client model's gradient in local training and the server's aggregated G gradient
    to this norm (HtFLlib: 100); 0 = no clipping (default)."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.server_lr is None:
            self.server_lr = AUTHORS_SERVER_LR[self.guide]
        if self.quiz_from is None:
            self.quiz_from = "first" if reference else "random"
        if self.warm_up_rounds is None:
            self.warm_up_rounds = REFERENCE_WARM_UP_ROUNDS if reference else 0
        if self.clip_grad_norm is None:
            self.clip_grad_norm = REFERENCE_CLIP_NORM if reference else 0.0


def guide_width(context: AlgorithmContext) -> int:
    """W: K for the feature guide, C for the logit guide."""
    return context.feature_dim if context.options.guide == "feature" else context.num_classes


# --------------------------------------------------------------------------- the maths


def guidance_loss(features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, guides: torch.Tensor,
                  guide: Guide) -> torch.Tensor:
    """ℓ_g = (1/(B·W)) Σ_b ‖v_b − g^{y_b}‖²: the guided output v (features or logits) against its
    class's guiding vector, averaged over every element (``nn.MSELoss``)."""
    guided = features if guide == "feature" else logits
    return F.mse_loss(guided, guides[labels])


def guided_objective(features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, guides: torch.Tensor,
                     guide: Guide) -> torch.Tensor:
    """L = CE(z, y) + ℓ_g: the local objective (no weight on ℓ_g)."""
    return F.cross_entropy(logits, labels) + guidance_loss(features, logits, labels, guides, guide)


def _split_call(model: SplitModel, state: dict[str, torch.Tensor], x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, logits) of a ``SplitModel`` evaluated at parameters/buffers ``state``."""
    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}

    features = functional_call(model.feature_extractor, part("feature_extractor."), (x,))
    return features, functional_call(model.head, part("head."), (features,))


def guide_gradient(model: SplitModel, guides: torch.Tensor, study: list[tuple[torch.Tensor, torch.Tensor]],
                   quiz: list[tuple[torch.Tensor, torch.Tensor]], lr: float, guide: Guide) -> torch.Tensor:
    """∂/∂G of (1/|quiz|) Σ_q CE(θ′(G); x_q, y_q), θ′(G) = θ − lr·∇_θ (1/|study|) Σ_s L(θ; G, x_s, y_s).

    The pseudo step is plain SGD on every parameter, in the model's current mode, on copies of its
    buffers: the model itself (weights and BatchNorm statistics) is left as it was. Returns [C, W]."""
    guides = guides.detach().clone().requires_grad_(True)
    params = dict(model.named_parameters())
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    # (sum() of tensors is typed "Tensor | Literal[0]"; the batches are never empty)
    study_loss = cast(torch.Tensor, sum(guided_objective(*_split_call(model, {**params, **buffers}, x), y, guides,
                                                         guide) for x, y in study)) / len(study)
    names = list(params)
    grads = torch.autograd.grad(study_loss, [params[name] for name in names], create_graph=True, allow_unused=True)
    stepped = {name: params[name] if g is None else params[name] - lr * g for name, g in zip(names, grads, strict=True)}
    quiz_loss = cast(torch.Tensor, sum(F.cross_entropy(_split_call(model, {**stepped, **buffers}, x)[1], y)
                                       for x, y in quiz)) / len(quiz)
    (gradient,) = torch.autograd.grad(quiz_loss, guides, allow_unused=True)
    return torch.zeros_like(guides) if gradient is None else gradient.detach()


def clip_by_norm(gradient: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` on one tensor: scaled by max_norm / (‖·‖ + 1e-6) when that is below 1."""
    if max_norm <= 0:
        return gradient
    scale = max_norm / (float(gradient.norm()) + 1e-6)
    return gradient * scale if scale < 1 else gradient


def guide_step(guides: torch.Tensor, uploads: dict[int, Payload], server_lr: float, clip_norm: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """G − η_s·clip(ḡ): ḡ^c = unweighted mean of the round's rows for class c, 0 for classes
    nobody sent (summed in client-id order). Returns (new G, [C] bool of the classes sent)."""
    means = ClassMeans(guides.shape[0], guides.shape[1], dtype=torch.float64)
    for client_id in sorted(uploads):
        means.add(uploads[client_id]["grads"].cpu(), uploads[client_id]["class_ids"].cpu())
    gradient = clip_by_norm(means.dense().float(), clip_norm)
    return guides - server_lr * gradient, means.present()


# --------------------------------------------------------------------------- client


def quiz_indices(count: int, quiz_size: int, quiz_from: str, seed: int, client_id: int) -> torch.Tensor:
    """The client's quiz set, fixed for the run: the first ``quiz_size`` samples, or a random subset
    drawn from (seed, client id) alone (the same wherever the client runs)."""
    if quiz_from == "first":
        return torch.arange(quiz_size)
    return torch.randperm(count, generator=torch_generator(seed, "fedl2g-quiz", client_id))[:quiz_size].sort().values


def _batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[start:start + batch_size], y[start:start + batch_size])
            for start in range(0, min(x.shape[0], limit * batch_size), batch_size)]


class FedL2GClient(ClientAlgorithm):
    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self._rows_sent: dict[int, int] = {}

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return class_row_fields("grads", guide_width(context), context.num_classes)

    def quiz_size(self) -> int:
        return self.options.quiz_batches * self.context.train.batch_size

    def init_client(self, client: ClientState) -> None:
        """Refuse a client too small to keep a study sample beside its quiz set."""
        count = int(client.train_y.shape[0])
        if count <= self.quiz_size():
            raise ConfigError(f"fedl2g: client {client.client_id} has {count} training samples, not more than its "
                              f"quiz set (algo.quiz_batches × train.batch_size = {self.quiz_size()}); lower "
                              f"algo.quiz_batches or train.batch_size, or raise data.min_samples_per_client")

    def split(self, client: ClientState) -> tuple[ClientState, torch.Tensor, torch.Tensor]:
        """(the client on its study set only, quiz x, quiz y)."""
        count = int(client.train_y.shape[0])
        quiz = quiz_indices(count, self.quiz_size(), self.options.quiz_from, self.context.seed, client.client_id)
        keep = torch.ones(count, dtype=torch.bool)
        keep[quiz] = False
        quiz, keep = quiz.to(client.train_y.device), keep.to(client.train_y.device)
        study = dataclasses.replace(client, train_x=client.train_x[keep], train_y=client.train_y[keep])
        return study, client.train_x[quiz], client.train_y[quiz]

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options = self.options
        guides = knowledge["guides"].to(client.device)
        study, quiz_x, quiz_y = self.split(client)
        loss_sum, seen = 0.0, 0
        if round_index >= options.warm_up_rounds:
            def loss_fn(batch: Batch) -> torch.Tensor:
                return guided_objective(batch.features, batch.logits, batch.labels, guides, options.guide)

            loss_sum, seen = run_local_training(study, self.context, loss_fn, generator,
                                                before_step=gradient_clipper(client.model.parameters(),
                                                                             options.clip_grad_norm))
        batch_size = self.context.train.batch_size
        order = torch.randperm(study.train_y.shape[0], generator=torch_generator(
            self.context.seed, "fedl2g-study", client.client_id, round_index)).to(client.device)
        study_batches = _batches(study.train_x[order], study.train_y[order], batch_size, options.study_batches)
        quiz_batches = _batches(quiz_x, quiz_y, batch_size, options.quiz_batches)
        client.model.train()
        gradient = guide_gradient(client.model, guides, study_batches, quiz_batches, self.context.train.lr,
                                  options.guide)
        class_ids = torch.unique(torch.cat([y for _, y in study_batches])).cpu()
        self._rows_sent[client.client_id] = int(class_ids.numel())
        return TrainResult({"class_ids": class_ids, "grads": gradient[class_ids.to(gradient.device)].float().cpu()},
                           loss_sum, seen)

    def theory_upload_floats(self, client: ClientState) -> int:
        """W·m_i: a gradient row per class of the round's study batches (the other rows are 0)."""
        return guide_width(self.context) * self._rows_sent.get(client.client_id, 0)


# --------------------------------------------------------------------------- server


class FedL2GServer(ServerAlgorithm):
    """The guiding vectors G [C, W], drawn N(0, 1) (``nn.Embedding``'s initialisation) from the
    run's stream "fedl2g-guides", or under ``model.init=htfllib`` as HtFLlib draws them: its
    ``clientL2G`` calls ``torch.manual_seed(0)`` after building its model, so the server's
    ``nn.Embedding``, made after the last client, is the first draw of a freshly seeded
    generator (here from the run seed, as that init's client models are); stepped by
    ``guide_step`` every round; all C rows go down."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return class_row_fields("guides", guide_width(context), context.num_classes)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        generator = torch.Generator().manual_seed(context.seed) if context.model_init == "htfllib" \
            else torch_generator(context.seed, "fedl2g-guides")
        self.guides = torch.randn(context.num_classes, guide_width(context), generator=generator)

    def download(self) -> Payload:
        return {"class_ids": torch.arange(self.context.num_classes), "guides": self.guides}

    def theory_download_floats(self) -> int:
        return self.context.num_classes * guide_width(self.context)

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_class_rows(client_id, upload["class_ids"], upload["grads"], self.context.num_classes)

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        previous = self.guides
        self.guides, sent = guide_step(previous, uploads, self.options.server_lr, self.options.clip_grad_norm)
        return {"guide_classes": float(sent.sum()), "guide_step_norm": float((self.guides - previous).norm())}

    def state_dict(self) -> dict[str, Any]:
        return {"guides": self.guides}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guides = state["guides"]


register_algorithm("fedl2g", server=FedL2GServer, client=FedL2GClient, options=FedL2GOptions,
                   summary="trainable per-class guiding vectors learned from the clients' quiz-loss "
                           "gradients (Zhang et al. 2024; HtFLlib FedL2G-feat / FedL2G-logit)")
