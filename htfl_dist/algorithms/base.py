"""The algorithm interface: maths only, no processes, no files.

An algorithm is a (``ServerAlgorithm``, ``ClientAlgorithm``) pair registered by name with an
options dataclass (its ``algo.*`` config keys). The runtime owns the round loop:

    server.download()  --broadcast-->  client.train(...) on each participant
    client upload      --gather----->  server.update(uploads ordered by client id)
    server.download()  --broadcast-->  client.predict(...) on every client's test split

Payloads are declared (``download_spec`` / ``upload_spec``) so they travel as tensors.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from htfl_dist.config import TrainConfig, build_section
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.runtime.wire import Payload, PayloadSpec


@dataclass(frozen=True)
class AlgorithmContext:
    """What an algorithm may know about the run."""

    num_classes: int
    feature_dim: int
    seed: int
    train: TrainConfig
    options: Any  # the algorithm's options dataclass instance
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable) where this rank computes


@dataclass
class ClientState:
    """One logical client's private state; lives on the rank that hosts it."""

    client_id: int
    architecture: str
    model: nn.Module  # htfl_dist.models.SplitModel
    optimizer: torch.optim.Optimizer
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    device: torch.device

    @property
    def classes(self) -> torch.Tensor:
        """Classes present in the training split (the C_i of the papers), sorted."""
        return torch.unique(self.train_y)


@dataclass
class TrainResult:
    upload: Payload
    loss_sum: float
    samples: int


class ClientAlgorithm:
    """Client half: local training and inference."""

    def __init__(self, context: AlgorithmContext) -> None:
        self.context = context
        self.options = context.options

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        """Declared upload payload (client → server); empty for algorithms that share nothing."""
        return ()

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        """Train one participating client for the round; ``generator`` (seeded from
        seed, client id and round by the runtime) orders its batches."""
        raise NotImplementedError

    def theory_upload_floats(self, client: ClientState) -> int:
        """The paper's count of floats this client uploads per round (for bytes_theory_up)."""
        return 0

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor) -> torch.Tensor:
        """The algorithm's own inference rule (default: the head's argmax)."""
        return logits.argmax(dim=1)


class ServerAlgorithm:
    """Server half: turns the round's uploads into global knowledge."""

    def __init__(self, context: AlgorithmContext) -> None:
        self.context = context
        self.options = context.options

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        """Declared download payload (server → clients); known to clients without a server."""
        return ()

    def download(self) -> Payload:
        """Global knowledge sent to every client (empty for algorithms that share nothing)."""
        return {}

    def theory_download_floats(self) -> int:
        """The paper's count of floats each participating client downloads per round."""
        return 0

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        """Raise ProtocolError if an upload is semantically invalid (the runtime has already
        checked declared shapes, dtypes and finiteness); the runtime then skips or fails."""

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        """Consume the uploads (keyed and ordered by client id); return diagnostics (numbers
        or lists of numbers, logged in metrics.jsonl). ``generator`` is the server's random
        stream for this round, derived from (seed, round) by the runtime."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str
    server: type[ServerAlgorithm]
    client: type[ClientAlgorithm]
    options: type
    summary: str


_REGISTRY: dict[str, AlgorithmEntry] = {}


def register_algorithm(name: str, *, server: type[ServerAlgorithm], client: type[ClientAlgorithm],
                       options: type, summary: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"algorithm {name!r} registered twice")
    _REGISTRY[name] = AlgorithmEntry(name, server, client, options, summary)


def algorithm_names() -> list[str]:
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> AlgorithmEntry:
    key = name.lower()
    if key not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r}; allowed: {', '.join(algorithm_names())}")
    return _REGISTRY[key]


def parse_options(entry: AlgorithmEntry, raw: dict[str, Any]) -> Any:
    """Validate ``algo.*`` against the algorithm's options dataclass."""
    options = build_section(entry.options, raw, "algo.")
    check = getattr(options, "validate", None)
    if check is not None:
        check()
    return options


def spelled_out_options(algorithm: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``algo.*`` validated and with every option written out: the form a config is stored and
    compared in, so writing a default explicitly is not a different experiment."""
    return dataclasses.asdict(parse_options(get_algorithm(algorithm), raw))


# ----------------------------------------------------------------------------- shared maths


def run_local_training(client: ClientState, context: AlgorithmContext,
                       loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       generator: torch.Generator,
                       on_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                       ) -> tuple[float, int]:
    """SGD over the client's training split for ``train.local_epochs`` epochs.

    ``loss_fn(features, logits, labels)`` is the algorithm's objective. Batches are drawn with
    ``generator`` (derived from seed, client id and round by the runtime), so the sample order
    does not depend on where the client runs. A trailing batch of a single sample is skipped
    (BatchNorm in the torchvision models cannot train on it; HtFLlib drops every partial batch).
    Returns (sum of batch losses × batch size, samples).
    """
    model, optimizer = client.model, client.optimizer
    batch_size = context.train.batch_size
    count = client.train_y.shape[0]
    model.train()
    loss_total, seen = torch.zeros((), device=client.device), 0  # summed on device: no per-step sync
    for _ in range(context.train.local_epochs):
        order = torch.randperm(count, generator=generator).to(client.device)
        for start in range(0, count, batch_size):
            if count - start == 1 and start > 0:
                break  # a final batch of one sample breaks BatchNorm on 1×1 maps; skip it
            index = order[start : start + batch_size]
            x, y = client.train_x[index], client.train_y[index]
            features, logits = model.forward_with_features(x)
            loss = loss_fn(features, logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if on_batch is not None:
                on_batch(features.detach(), y)
            loss_total += loss.detach() * y.shape[0]
            seen += y.shape[0]
    return float(loss_total), seen


class ClassMeans:
    """Per-class (optionally weighted) means of rows, accumulated batch by batch.

    The one implementation behind client prototypes (after or during training), FedProto's
    server mean and FedTGP's cluster centres. Sums are dense [C, K]: adding a batch has no
    data-dependent shapes, so it never waits for the GPU."""

    def __init__(self, num_classes: int, width: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.sums = torch.zeros(num_classes, width, device=device, dtype=dtype)
        self.weights = torch.zeros(num_classes, device=device, dtype=dtype)

    def add(self, rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        rows = rows.to(self.sums.dtype)
        if weights is None:
            self.sums.index_add_(0, labels, rows)
            self.weights += torch.bincount(labels, minlength=self.weights.shape[0]).to(self.weights.dtype)
        else:
            weights = weights.to(self.sums.dtype)
            self.sums.index_add_(0, labels, rows * weights.unsqueeze(1))
            self.weights.index_add_(0, labels, weights)

    def present(self) -> torch.Tensor:
        """[C] bool: classes that received any weight."""
        return self.weights > 0

    def dense(self) -> torch.Tensor:
        """[C, K] means; rows of absent classes are 0."""
        denominator = torch.where(self.present(), self.weights, torch.ones_like(self.weights))
        return self.sums / denominator.unsqueeze(1)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(class ids int64 [m], means [m, K]) of the m present classes, on the CPU."""
        present = torch.nonzero(self.present()).flatten()
        return present.cpu(), (self.sums[present] / self.weights[present].unsqueeze(1)).cpu()


@torch.no_grad()
def class_prototypes(client: ClientState, num_classes: int,
                     batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """P_i^c = mean of f_i(x) over the client's training samples of class c (eval mode).

    Returns (class ids int64 [m], prototypes float32 [m, K]) for the m classes it holds.
    """
    model = client.model
    was_training = model.training
    model.eval()
    means = ClassMeans(num_classes, model.feature_dim, client.device)
    for start in range(0, client.train_y.shape[0], batch_size):
        means.add(model.features(client.train_x[start : start + batch_size]),
                  client.train_y[start : start + batch_size])
    model.train(was_training)
    return means.rows()


def euclidean_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a_i − b_j‖₂, computed directly: torch.cdist's default switches to a less precise
    matmul form above 25 rows (e.g. C = 100), which blurs close prototypes."""
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def dense_prototypes(knowledge: Payload, num_classes: int, device: torch.device | str = "cpu"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [C, K], available mask [C]) from the downloaded (class_ids, protos) rows."""
    class_ids, protos = knowledge["class_ids"], knowledge["protos"]
    table = torch.zeros(num_classes, protos.shape[1], device=device)
    available = torch.zeros(num_classes, dtype=torch.bool, device=device)
    table[class_ids.to(device)] = protos.to(device)
    available[class_ids.to(device)] = True
    return table, available


@torch.no_grad()
def global_prototype_diagnostics(uploads: dict[int, Payload], num_classes: int, current: Payload,
                                 previous: Payload) -> dict[str, float]:
    """How the global prototypes (a download payload: class_ids, protos) sit against what clients
    uploaded, and how far they moved since the previous round's download.

    Nearest-global-prototype inference works only if client features fall in their own class's
    cell, and clients train towards last round's prototypes, so these explain the accuracy:
    ``upload_to_global``: mean ‖P_i^c − P̂^c‖ over the round's uploads; ``upload_nearest_own``:
    share of uploads whose nearest global prototype is their own class's; ``proto_drift``: mean
    ‖P̂_t^c − P̂_{t−1}^c‖ over the classes present in both rounds."""
    protos, present = dense_prototypes(current, num_classes)
    if not bool(present.any()):
        return {}
    result: dict[str, float] = {}
    rows = torch.cat([payload["protos"].float().cpu() for payload in uploads.values()])
    labels = torch.cat([payload["class_ids"].cpu() for payload in uploads.values()])
    known = present[labels]
    if bool(known.any()):
        distances = euclidean_distances(rows[known], protos)
        distances[:, ~present] = float("inf")
        own = distances.gather(1, labels[known].unsqueeze(1)).squeeze(1)
        result["upload_to_global"] = float(own.mean())
        result["upload_nearest_own"] = float((distances.argmin(dim=1) == labels[known]).float().mean())
    old, old_present = dense_prototypes(previous, num_classes)
    both = present & old_present
    if bool(both.any()):
        result["proto_drift"] = float((protos[both] - old[both]).norm(dim=1).mean())
    return result


def check_class_rows(client_id: int, class_ids: torch.Tensor, rows: torch.Tensor, num_classes: int) -> None:
    """Semantic checks on an upload of class-indexed rows (the runtime already checked dtype,
    shape and finiteness)."""
    if class_ids.shape[0] != rows.shape[0]:
        raise ProtocolError(f"client {client_id} sent {class_ids.shape[0]} class ids for {rows.shape[0]} rows")
    if class_ids.numel() and (class_ids.min() < 0 or class_ids.max() >= num_classes):
        raise ProtocolError(f"client {client_id} sent a class id outside [0, {num_classes})")
    if torch.unique(class_ids).numel() != class_ids.numel():
        raise ProtocolError(f"client {client_id} sent a class id twice")
