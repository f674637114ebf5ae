"""FedGen (Zhu et al. 2021) as HtFLlib runs it (HtFLlib ``Gen``).

LG-FedAvg plus a label-conditioned feature generator G: [ε ⊕ onehot(ŷ)] → Linear(nd+C, hd) →
BatchNorm1d(hd) → ReLU → Linear(hd, K), with ε ~ U[0,1)^nd (``noise: gaussian`` for N(0, I)).

- Setup: every client uploads its label counts (int64 [C]); the server sums them into the
  label prior p̂(y) (fixed for the run) and sends it with every download, so clients can draw ŷ.
- Client: the global head replaces h_i; per batch, with ŷ = B labels drawn from p̂ and ε from
  the stream ``(seed, "fedgen-labels", client, round)``,
  L_i = CE(h_i(f_i(x)), y) + CE(h_i(G(ŷ, ε)), ŷ), with G frozen in train mode under ``no_grad``
  (the second term reaches h_i only). Upload the trained head and n_i.
- Server, in this order: train G for ``server_steps`` steps on CE(Σ_i w_i h_i(G(ŷ, ε)), ŷ) over
  the **uploaded** heads (eval mode, frozen; w_i = n_i/Σn), Adam(lr ``server_lr``); then average
  the heads as LG-FedAvg does. Download: head + G's parameters + the prior.

``persist_generator: false`` (``compat: reference``) reproduces HtFLlib's quirk: the trained G is
never saved, so clients always use the untrained initial G. Here G is then not trained at all,
and it is not sent: server and clients build the same initial G from the run seed (stream
``"fedgen-generator"``), which is what "sent once at setup" amounts to, without the bytes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.blocks.model_part import (
    HEAD,
    HeadAveragingOptions,
    LossFunction,
    PartAveragingServer,
    PartSharingClient,
)
from htfl_dist.algorithms.interface import AlgorithmContext, ClientState
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import Batch
from htfl_dist.config import bounded
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.seeding import derive_seed, torch_generator

Noise = Literal["uniform", "gaussian"]
GeneratorOptimizer = Literal["persistent", "per_round"]


@dataclass
class FedGenOptions(HeadAveragingOptions):
    """FedGen's knobs, with total.sh's values (nd = 32, hd = K, glr = 0.1, se = 100 steps).
    ``compat: reference`` sets persist_generator=false (and so generator_optimizer=per_round)."""

    noise: Noise = "uniform"
    """ε ~ U[0,1)^nd (``torch.rand``: HtFLlib and the official FedGen code) | gaussian N(0, I)."""
    noise_dim: int = bounded(32, at_least=1)
    """nd (``-nd``; main.py's flag default is 512, total.sh uses 32)."""
    hidden_dim: int | None = bounded(None, at_least=1, optional=True, note="or null: K")
    """hd (``-hd``); default K."""
    server_steps: int = bounded(100, at_least=1)
    """``-se``: generator steps per round (steps, not epochs)."""
    server_lr: float = bounded(0.1, above=0)
    """``-glr``: Adam learning rate of G (main.py default 0.005, total.sh 0.1)."""
    persist_generator: bool | None = None
    """true (default, [P]/[I]): G is trained each round, kept, and sent every round;
    false (htfllib): G is never trained, clients use the initial G (HtFLlib's unsaved generator)."""
    generator_optimizer: GeneratorOptimizer | None = None
    """persistent: one Adam kept across rounds (its state is checkpointed; the official
    FedGen code); per_round: a fresh Adam every round (HtFLlib). Default: persistent when G persists, else per_round."""

    def validate(self) -> None:
        if self.persist_generator is None:
            self.persist_generator = self.compat != "reference"
        if self.generator_optimizer is None:
            self.generator_optimizer = "persistent" if self.persist_generator else "per_round"


class FedGenGenerator(nn.Module):
    """G(ŷ, ε) = fc(ReLU(bn(fc1([ε ⊕ onehot(ŷ)])))) ∈ R^K."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.fc1 = nn.Linear(noise_dim + num_classes, hidden_dim)
        self.bn = nn.BatchNorm1d(hidden_dim)
        self.fc = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        inputs = torch.cat([noise, F.one_hot(labels, self.num_classes).to(noise.dtype)], dim=1)
        return self.fc(F.relu(self.bn(self.fc1(inputs))))


def generator_size(noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> int:
    """Θ = (nd+C)·hd + 3·hd + hd·K + K parameters (BN buffers not counted)."""
    return (noise_dim + num_classes) * hidden_dim + 3 * hidden_dim + hidden_dim * feature_dim + feature_dim


def build_generator(context: AlgorithmContext) -> FedGenGenerator:
    """The initial G, the same on the server and every client: drawn from its own stream
    (seed, "fedgen-generator"), so torch's global RNG is left alone; under ``model.init=htfllib``
    as HtFLlib draws it (issue 47 item 3), in a forked RNG too: every ``clientGen`` ends its
    ``__init__`` with ``torch.manual_seed(0)`` and one pass over its ``DataLoader`` (counting
    its samples per class), whose iterator draws its base seed, one int64
    ``random_()``, from the global generator; ``FedGen.__init__`` then builds its ``Generator``:
    ``nn.Linear(nd + C, hd)``, ``nn.BatchNorm1d`` (no draw), ``nn.Linear(hd, K)`` (``servergen.py``).
    The run seed stands for 0, as for that init's client models."""
    options = context.options
    with torch.random.fork_rng(devices=[]):
        if context.model_init == "htfllib":
            torch.manual_seed(context.seed)
            torch.empty((), dtype=torch.int64).random_()  # the last clientGen's DataLoader iterator
        else:
            torch.manual_seed(derive_seed(context.seed, "fedgen-generator"))
        module = FedGenGenerator(options.noise_dim, context.num_classes,
                                 options.hidden_dim or context.feature_dim, context.feature_dim)
    return module.to(context.device)


def draw_labels_and_noise(label_counts: torch.Tensor, count: int, noise_dim: int, noise: Noise,
                          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ŷ: ``count`` labels drawn iid from the multiset ``label_counts`` ([C]); ε: [count, nd].
    Drawn on the CPU from ``generator`` (never torch's global RNG). An all-zero prior (no setup
    uploads survived) falls back to uniform labels."""
    weights = label_counts.reshape(-1).double().cpu()
    if float(weights.sum()) <= 0:
        weights = torch.ones_like(weights)
    labels = torch.multinomial(weights, count, replacement=True, generator=generator)
    draw = torch.rand if noise == "uniform" else torch.randn
    return labels, draw(count, noise_dim, generator=generator)


def prior_field(context: AlgorithmContext) -> Field:
    """Label counts, int64 [C], one row (not counted as floats)."""
    return Field("label_counts", torch.int64, (context.num_classes,), max_rows=1)


def generator_field(context: AlgorithmContext) -> Field:
    options = context.options
    size = generator_size(options.noise_dim, context.num_classes, options.hidden_dim or context.feature_dim,
                          context.feature_dim)
    return Field("generator", torch.float32, (size,), max_rows=1)


class FedGenClient(PartSharingClient):
    algorithm_name = "FedGen"

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        super().check_models(context)
        if context.train.batch_size < 2:
            raise ConfigError(f"FedGen's generator has BatchNorm in train mode, which needs batches of at least "
                              f"2 generated samples; config key 'train.batch_size' is {context.train.batch_size}")

    @classmethod
    def setup_upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return (prior_field(context),)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.generator = build_generator(context).requires_grad_(False)

    def setup_upload(self, client: ClientState) -> Payload:
        """Label counts over the whole training split: our training visits every sample (HtFLlib
        counts over its drop_last loader, which skips the last n_i mod B)."""
        counts = torch.bincount(client.train_y.cpu(), minlength=self.context.num_classes)
        return {"label_counts": counts.reshape(1, -1)}

    def loss_function(self, client: ClientState, knowledge: Payload, round_index: int) -> LossFunction:
        options, generator_module = self.options, self.generator
        if options.persist_generator:
            parameters.load_parameter_row(generator_module, knowledge["generator"])
        generator_module.train()  # BatchNorm on the generated batch's statistics, as HtFLlib
        prior = knowledge["label_counts"][0].cpu()
        stream = torch_generator(self.context.seed, "fedgen-labels", client.client_id, round_index)
        count, head = self.context.train.batch_size, client.model.head

        def loss_fn(batch: Batch) -> torch.Tensor:
            labels, noise = draw_labels_and_noise(prior, count, options.noise_dim, options.noise, stream)
            labels, noise = labels.to(client.device), noise.to(client.device)
            with torch.no_grad():  # G is frozen; the term reaches h_i only, never f_i
                generated = generator_module(labels, noise)
            return F.cross_entropy(batch.logits, batch.labels) + F.cross_entropy(head(generated), labels)

        return loss_fn


class FedGenServer(PartAveragingServer):
    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        shared_generator = (generator_field(context),) if context.options.persist_generator else ()
        return (HEAD.field(context), *shared_generator, prior_field(context))

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.generator = build_generator(context)
        self.label_counts = torch.zeros(context.num_classes, dtype=torch.int64)
        self.optimizer: torch.optim.Optimizer | None = None

    def download(self) -> Payload:
        payload = {"head": self.row, "label_counts": self.label_counts.reshape(1, -1)}
        if self.options.persist_generator:
            payload["generator"] = parameters.parameter_row(self.generator)
        return payload

    def theory_download_floats(self) -> int:
        """K·C + C, plus Θ when G is sent every round (FedTGP Table 5 counts it each round)."""
        extra = parameters.parameter_count(self.generator) if self.options.persist_generator else 0
        return HEAD.floats(self.context) + extra

    def validate_setup_upload(self, client_id: int, upload: Payload) -> None:
        counts = upload["label_counts"]
        if counts.shape[0] != 1 or bool((counts < 0).any()) or int(counts.sum()) <= 0:
            raise ProtocolError(f"client {client_id} sent invalid label counts (expected one row, >= 0, sum > 0)")

    def setup(self, uploads: dict[int, Payload]) -> dict[str, Any]:
        """p̂(y): one multiset of the labels of all clients, fixed for the run."""
        total = torch.zeros(self.context.num_classes, dtype=torch.int64)
        for client_id in sorted(uploads):
            total += uploads[client_id]["label_counts"][0].cpu()
        self.label_counts = total
        return {}

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        diagnostics = {}
        if self.options.persist_generator:  # before averaging: G learns from the uploaded heads
            diagnostics["generator_loss"] = self.train_generator(uploads, generator)
        return {**diagnostics, **super().update(uploads, round_index, generator)}

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.options.generator_optimizer == "per_round" or self.optimizer is None:
            self.optimizer = torch.optim.Adam(self.generator.parameters(), lr=self.options.server_lr)
        return self.optimizer

    def train_generator(self, uploads: dict[int, Payload], generator: torch.Generator) -> float:
        """``server_steps`` Adam steps on CE(Σ_i w_i h_i(G(ŷ, ε)), ŷ), the uploaded heads frozen in
        eval mode, w_i = n_i/Σn in client-id order; returns the mean loss over the steps."""
        options, device = self.options, self.device
        client_ids = sorted(uploads)
        counts = torch.tensor(self.sample_weights(uploads), dtype=torch.float64)
        weights = (counts / counts.sum()).float().tolist()
        heads = []
        for client_id in client_ids:
            head = copy.deepcopy(self.module)
            parameters.load_parameter_row(head, uploads[client_id]["head"])
            heads.append(head.eval().requires_grad_(False))
        optimizer = self._optimizer()
        self.generator.train()
        total = torch.zeros((), device=device)
        for _ in range(options.server_steps):
            labels, noise = draw_labels_and_noise(self.label_counts, self.context.train.batch_size,
                                                  options.noise_dim, options.noise, generator)
            labels, noise = labels.to(device), noise.to(device)
            features = self.generator(labels, noise)
            logits = sum(weight * head(features) for weight, head in zip(weights, heads, strict=True))
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        return float(total) / options.server_steps

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "generator": self.generator.state_dict(),
                 "label_counts": self.label_counts}
        if self.optimizer is not None and self.options.generator_optimizer == "persistent":
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.generator.load_state_dict(state["generator"])
        self.label_counts = state["label_counts"].to(torch.int64).cpu()
        self.optimizer = None
        if "optimizer" in state:
            self._optimizer().load_state_dict(state["optimizer"])


register_algorithm("fedgen", server=FedGenServer, client=FedGenClient, options=FedGenOptions,
                   summary="LG-FedAvg plus a server-trained label-conditioned feature generator (Zhu et al. 2021)",
                   shares_parameters=True)
