"""The algorithm interface: maths only, no processes, no files.

An algorithm is a (``ServerAlgorithm``, ``ClientAlgorithm``) pair registered by name with an
options dataclass (its ``algo.*`` config keys). The runtime owns the round loop:

    (fresh run only) client.setup_upload(...) --gather--> server.setup(...)
    server.download()  --broadcast-->  client.train(...) on each participant
    client upload      --gather----->  server.update(uploads ordered by client id)
    server.download()  --broadcast-->  client.prepare_evaluation(...), client.predict(...)
                                       on every client's test split

Payloads are declared (``download_fields`` / ``upload_fields`` / ``setup_upload_fields``) so
they travel as tensors. A variant overrides the one method it changes (Flower's ``Strategy``
pattern); the shared maths lives in ``class_rows``, ``training``, ``parameters`` and ``losses``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from htfl_dist.algorithms.batches import Batch
from htfl_dist.config import TrainConfig
from htfl_dist.models.base import SplitModel
from htfl_dist.models.inputs import InputSpec
from htfl_dist.payload import Payload, PayloadSpec
from htfl_dist.seeding import seed_global_torch


@dataclass(frozen=True)
class AlgorithmContext:
    """What an algorithm may know about the run: the same on every rank."""

    num_classes: int
    feature_dim: int
    seed: int
    train: TrainConfig
    options: Any  # the algorithm's options dataclass instance
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable) where this rank computes
    num_clients: int = 0
    model_group: str = ""
    """``model.group`` as configured; client i's member is ``architecture_for_client(model_group, i)``."""
    model_init: str = "per_client"
    """``model.init``: how the clients' initial weights were drawn (servers that rebuild them need it)."""
    in_channels: int = 1
    image_size: int = 28
    """The square pictures' channels and side (both 0 where the data is not square pictures)."""
    latent_dim: int = 0
    """H, the latent width of the server's generator (FedKTL); 0 where the algorithm uses none."""
    input_spec: InputSpec | None = None
    """The data's input kind and shape; unset: square pictures of ``in_channels`` x ``image_size``."""
    model_options: dict[str, Any] = field(default_factory=dict)
    """``model.options``, spelled out: pass it as ``build_model(..., options=context.model_options)``
    so a model an algorithm builds has the shape the clients' have (empty: every default)."""
    step_graphs: bool = False
    """Whether ``training.run_local_training`` records full-batch steps as CUDA graphs: what the
    runtime resolved from ``train.cuda_graphs`` (a CUDA device, a client step declared
    ``capturable_step``, no privacy, compile or batched clients; ``runtime.startup.step_graphs``)."""

    @property
    def inputs(self) -> InputSpec:
        """What one sample looks like: build models with ``build_model(..., inputs=context.inputs)``."""
        return self.input_spec or InputSpec.image(self.in_channels, self.image_size)


class PrivateTraining(Protocol):
    """How a private client trains and what it releases (``privacy.enabled``; docs/privacy.md).

    Installed on ``ClientState.private`` together with the client's privacy ledger
    (``privacy.startup.attach_ledger``), so the shared helpers ask the client rather than the
    privacy package: ``training.run_local_training`` trains through ``train`` and
    ``class_rows.class_means`` clips and releases through the other two. The mechanisms (and
    Opacus) stay outside the algorithms, and a run without privacy never imports them."""

    def train(self, client: ClientState, context: AlgorithmContext, loss_fn: Callable[[Batch], torch.Tensor],
              generator: torch.Generator, *, on_batch: Callable[[Batch], None] | None = None,
              public_loss: Callable[[], torch.Tensor] | None = None,
              public_optimizers: Sequence[torch.optim.Optimizer] = (),
              before_step: Callable[[], None] | None = None) -> tuple[float, int]:
        """``train.local_epochs`` epochs of DP-SGD over the client's training split, walking the
        batches ``run_local_training`` walks; returns (loss sum, samples) as it does. A
        ``public_loss`` reads no training sample (downloads and the current model only): its
        gradient is added after the noise, ``public_optimizers`` step the modules it trains, and
        ``before_step`` edits the finished gradients (FedKTL's transfer term and clipping)."""
        ...

    def clip_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row of ``rows`` [B, D] scaled to L2 norm at most ``privacy.feature_clip``, the bound
        the release's sensitivity assumes (rows already inside are unchanged)."""
        ...

    def release_class_means(self, sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What leaves the client of its class means (``sums`` [C, D] of clipped rows, ``counts`` [C]):
        (class ids int64 [m], rows float32 [m, D]) on the CPU, noised, possibly none."""
        ...


@dataclass
class ClientState:
    """One logical client's private state; lives on the rank that hosts it."""

    client_id: int
    architecture: str
    model: SplitModel
    optimizer: torch.optim.Optimizer
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    device: torch.device
    modules: dict[str, nn.Module] = field(default_factory=dict)
    """Algorithm-owned modules that persist across rounds (FedKD's mentee and W_h); created by
    ``ClientAlgorithm.init_client`` and checkpointed with the client."""
    private: PrivateTraining | None = None
    """How this client trains and releases in a private run (``privacy.enabled``); None otherwise.
    Its only state is the client's privacy ledger, kept among ``modules`` so that checkpoints and
    parking carry it; every client the runtime builds (fresh, or to take a parked or checkpointed
    state) gets it installed again with its ledger."""

    @property
    def classes(self) -> torch.Tensor:
        """Classes present in the training split (the C_i of the papers), sorted."""
        return torch.unique(self.train_y)


@dataclass
class TrainResult:
    upload: Payload
    loss_sum: float
    samples: int


def release_gradients(client: ClientState) -> None:
    """Drop the gradients a client's last local step left on its model and modules. Nothing
    reads them after training (every step starts from ``zero_grad(set_to_none=True)``), and an
    idle client holding them doubles its memory: 8.5 GiB of pfl-research's 1,000-client workload."""
    for module in (client.model, *client.modules.values()):
        for parameter in module.parameters():
            parameter.grad = None


def seed_training(seed: int, client_id: int, round_index: int) -> None:
    """Seed torch's global RNG for one client's local training in one round (dropout and other
    implicit draws) from (seed, client, round) only, wherever and with whom the client trains."""
    seed_global_torch(seed, "train", client_id, round_index)


class ClientAlgorithm:
    """Client half: local training and inference."""

    capturable_step: ClassVar[bool] = False
    """Whether the step ``run_local_training`` takes for this algorithm (its loss, ``before_step``
    and optimisers) can be recorded as a CUDA graph (``train.cuda_graphs``): no host sync (no
    ``.item()``, no boolean-mask indexing, no Python branch on a tensor's value) and nothing read
    that changes while the client trains a round. A step that claims it and is not is caught at
    its recording: the client trains eagerly and the run says so once."""

    trains_concurrently: ClassVar[bool] = False
    """Whether several clients may run ``train`` at once, each in a thread of its own
    (``train.concurrent_clients``): ``train`` writes nothing on the algorithm object (nor anywhere
    but the client it trains and what it returns) and changes nothing in the knowledge. Draws from
    torch's global RNG need no declaration: the runtime finds them and trains such a client alone.
    The claim is not inherited by a subclass that defines any method of its own
    (``registry.vouched_concurrent``): it says so again or trains one at a time."""

    def __init__(self, context: AlgorithmContext) -> None:
        self.context = context
        self.options = context.options

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        """Raise ConfigError if the model group cannot run this algorithm (e.g. heads that a
        head-sharing method cannot average). Called once at start-up on every rank."""

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        """Declared upload payload (client → server); empty for algorithms that share nothing."""
        return ()

    @classmethod
    def setup_upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        """Declared one-off upload of every client before the first round (FedGen's label counts)."""
        return ()

    def init_client(self, client: ClientState) -> None:
        """Create the client's algorithm-owned ``client.modules`` (torch's global RNG is seeded
        from (seed, client id) by the runtime)."""

    def setup_upload(self, client: ClientState) -> Payload:
        """This client's setup payload (see ``setup_upload_fields``)."""
        return {}

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        """Train one participating client for the round; ``generator`` (seeded from
        seed, client id and round by the runtime) orders its batches."""
        raise NotImplementedError

    def train_group(self, clients: list[ClientState], knowledge: Payload, round_index: int,
                    generators: list[torch.Generator]) -> list[TrainResult]:
        """Train several participants of one architecture at once (``train.client_batching=vmap``);
        one result per client, in order, each ``generators[i]`` ordering client i's batches as in
        ``train``. An override defined where ``train`` is defined, or below it, is the algorithm's
        batched path (the registry derives ``batched_clients`` from that): its results must equal ``train``'s
        within float tolerance and must not depend on which other clients share the group (a
        group is what one rank hosts, so it changes with the world size). This default trains them
        one by one, seeded as the runtime seeds ``train``, so every algorithm accepts the call."""
        results = []
        for client, generator in zip(clients, generators, strict=True):
            seed_training(self.context.seed, client.client_id, round_index)
            results.append(self.train(client, knowledge, round_index, generator))
        return results

    def theory_upload_floats(self, client: ClientState) -> int:
        """The paper's count of floats this client uploads per round (for bytes_theory_up)."""
        return 0

    def replaced_by_download(self, client: ClientState) -> frozenset[str]:
        """Keys of ``client.model.state_dict()`` that every use of the client (``train``,
        ``train_group``, ``prepare_evaluation``) first overwrites from the download: what an idle
        client need not keep (FedAvg's whole model, LG-FedAvg's head). The runtime leaves them out
        when it parks the client; nothing reads them before the next download fills them.
        Default: none."""
        return frozenset()

    def prepare_evaluation(self, client: ClientState, knowledge: Payload) -> None:
        """Install downloaded knowledge before the client is evaluated (the head-sharing methods
        evaluate the global head on the local base). The registry sees an override
        (``evaluation_installs_knowledge``, derived), so the runtime keeps the change."""

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The algorithm's own inference rule (default: the head's argmax) for a batch of ``inputs``
        whose client model gave ``features`` and ``logits`` (the runtime passes all three; a rule
        that runs another model on the batch, FedMRL's, reads ``inputs``)."""
        return logits.argmax(dim=1)

    def head_predict(self, client: ClientState, logits: torch.Tensor) -> torch.Tensor:
        """What the client's own classifier predicts without any global knowledge (``test_acc_head``):
        the head's argmax, unless the method puts a fixed classifier on top of the head (FedKTL's ETF)."""
        return logits.argmax(dim=1)


class ServerAlgorithm:
    """Server half: turns the round's uploads into global knowledge."""

    accepts_late_uploads: ClassVar[bool] = False
    """Whether ``update`` may receive, beside this round's uploads, a client's upload from the
    round before (``participation.late=next_round``): true for servers that aggregate uploads as
    they come (class means, prototypes to train on), false for those whose uploads answer this
    round's download (a gradient at the current guides, a compressed delta)."""

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

    def validate_setup_upload(self, client_id: int, upload: Payload) -> None:
        """Raise ProtocolError if a setup upload is semantically invalid."""

    def setup(self, uploads: dict[int, Payload]) -> dict[str, Any]:
        """Consume every client's setup upload (fresh runs only; the result is server state)."""
        return {}

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        """Raise ProtocolError if an upload is semantically invalid (the runtime has already
        checked declared shapes, dtypes and finiteness); the runtime then skips or fails."""

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        """Consume the uploads (keyed and ordered by client id); return diagnostics (numbers
        or lists of numbers, logged in metrics.jsonl). ``generator`` is the server's random
        stream for this round, derived from (seed, round) by the runtime. Never called with no
        uploads when the algorithm declares some: a round whose uploads were all screened out
        skips the server step in the loop, and the knowledge stays as it was."""
        return {}

    # -- a server that needs only the sum of the uploads (secure aggregation, pre-summed uploads)

    @classmethod
    def summed_fields(cls, context: AlgorithmContext) -> dict[str, tuple[int, ...]] | None:
        """The dense tensors whose sum over the round's uploaders is all ``update_from_sums``
        needs (name -> shape), or None: the server reads each client's upload. A server that
        declares them can run under ``privacy.secure_aggregation`` (the server learns only the
        sum) and has its uploads summed where they are made. The registry trusts it only where
        ``update_from_sums`` is defined as low in the class tree as ``update`` (``sums_only``)."""
        return None

    @classmethod
    def contribution(cls, context: AlgorithmContext, upload: Payload) -> dict[str, torch.Tensor]:
        """One client's addend: a dense float tensor per ``summed_fields`` entry, computed where
        the upload is made (on the client's rank). Σ over the uploaders, in any order, is what
        ``update_from_sums`` consumes."""
        raise NotImplementedError(f"{cls.__qualname__} declares no summed fields")

    def update_from_sums(self, sums: dict[str, torch.Tensor], uploaders: int, round_index: int,
                         generator: torch.Generator) -> dict[str, Any]:
        """``update`` from the sum of the uploaders' contributions alone (``uploaders`` of them):
        the same knowledge as ``update`` on those uploads, within float rounding. Diagnostics that
        need a client's own rows are not available here."""
        raise NotImplementedError(f"{type(self).__qualname__} declares no summed fields")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
