"""The one round loop (docs/architecture.md), shared by every algorithm and every launcher.

Per round t (0-based; metrics call it round t+1):

1. every rank derives the participants from (seed, t);
2. rank 0 broadcasts the server's global knowledge (skipped when the evaluation of the
   previous round already delivered exactly this knowledge);
3. each client rank trains its participating logical clients and sends one message with
   their uploads (ordered by client id) to rank 0;
4. rank 0 decodes and validates the uploads and updates the global knowledge;
5. on evaluation rounds, the new knowledge is broadcast and every client evaluates on its
   own test split; per-client counts travel back in a small report message;
6. rank 0 writes the metrics row and the progress line; every rank checkpoints its part.
"""
from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import yaml

from htfl_dist.algorithms import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    TrainResult,
    algorithm_names,
    get_algorithm,
    parse_options,
)
from htfl_dist.algorithms.interface import seed_training
from htfl_dist.algorithms.training import batching_obstacle
from htfl_dist.config import Config
from htfl_dist.data import load_client_split, prepare_partition
from htfl_dist.errors import ConfigError, HtflError, ProtocolError, TrainingDiverged
from htfl_dist.generators import build_generator, generator_latent_dim
from htfl_dist.metrics.generated import GeneratedImageGrids
from htfl_dist.metrics.prototypes import PrototypeSnapshots, check_prototype_payloads
from htfl_dist.metrics.report import accuracy_summary
from htfl_dist.metrics.sinks import MetricsSink, open_sinks
from htfl_dist.metrics.writer import (
    MetricsLog,
    TrainingProgress,
    format_progress,
    progress,
    write_atomic,
    write_json,
)
from htfl_dist.models import (
    InputSpec,
    architecture_for_client,
    build_model,
    check_group_inputs,
    initial_client_model,
    members_in_use,
)
from htfl_dist.models.cost import timed_step_seconds
from htfl_dist.payload import Field, Payload, max_message_bytes
from htfl_dist.privacy.startup import (
    attach_ledger,
    begin_round,
    check_private_run,
    client_epsilon,
    epsilon_columns,
    privacy_plan,
    privacy_summary,
)
from htfl_dist.runtime import checkpoint
from htfl_dist.runtime.client_store import ClientStore
from htfl_dist.runtime.liveness import Liveness, describe_plain
from htfl_dist.runtime.placement import (
    Placement,
    client_ranks,
    estimated_client_work,
    idle_shares,
    plan_placement,
    sample_participants,
)
from htfl_dist.runtime.preemption import preemption_flag
from htfl_dist.runtime.screening import check_rank_report, check_rank_row, screen_uploads, unpack_rank_message
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.watchdog import CLIENT_DELAY_S, STARTUP, RoundWatchdog
from htfl_dist.runtime.wire import BROADCAST_ENTRY, decode, encode
from htfl_dist.seeding import seed_global_torch, torch_generator

RANK_ENTRY = -1
"""Report entry that carries rank-level figures (a RankReport) rather than a client's."""


class RankReport(NamedTuple):
    """What each rank tells rank 0 about itself at the end of a round (the ``rank`` report row)."""

    compute_seconds: float
    theory_up_bytes: float
    stop_requested: float  # 1.0: this rank saw SIGTERM


REPORT_SPEC = (
    Field("train", torch.float64, (2,), max_rows=1),  # [loss_sum, samples]
    Field("eval", torch.float64, (3,), max_rows=1),  # [correct (algorithm's rule), correct (head), samples]
    Field("rank", torch.float64, (len(RankReport._fields),), max_rows=1),  # rank entry only
    Field("privacy", torch.float64, (1,), max_rows=1),  # [ε spent so far]; privacy.enabled only
)

CONTROL_SPEC = (Field("stop", torch.int64),)  # rank 0's decision at each round boundary
STOP, DIVERGING, GIVE_UP = 1, 2, 4
"""Bits of that decision: a rank saw SIGTERM; every participant's loss was not finite this round
(no periodic checkpoint of such a state); ``train.max_diverged_rounds`` such rounds in a row."""

HANDSHAKE_SPEC = (Field("facts", torch.int64, (5,), max_rows=1),)  # [config hash, C, K, num_clients, software]


def software_fingerprint() -> int:
    """The versions that decide the numbers (htfl_dist, torch, numpy), as one int64: ranks built
    from different installs would break bitwise world-size invariance without an error."""
    from htfl_dist import __version__

    text = f"htfl_dist {__version__} torch {torch.__version__} numpy {np.__version__}"
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _rows(values: list[float] | None, width: int) -> torch.Tensor:
    if values is None:
        return torch.empty(0, width, dtype=torch.float64)
    return torch.tensor([values], dtype=torch.float64)


@dataclass
class RoundTraffic:
    """Bytes that crossed the server/client boundary in one round."""

    up: int = 0
    down: int = 0
    theory_up: int = 0
    theory_down: int = 0


@dataclass
class RoundOutcome:
    """What one round produced, filled in phase by phase (``Federation._play_round``); rank 0
    turns it into the metrics row."""

    round_index: int
    participants: list[int]
    evaluated: bool
    traffic: RoundTraffic = field(default_factory=RoundTraffic)
    client_seconds: float = 0.0
    """This rank's training (and evaluation) time."""
    server_seconds: float = 0.0
    diagnostics: dict[str, Any] = field(default_factory=dict)
    """The server step's own figures (rank 0)."""
    report: Any = None
    """Rank 0: (per-client report rows, per-rank RankReport); None on the other ranks."""


@dataclass
class RunContext:
    config: Config
    transport: Transport
    device: torch.device
    out_dir: Path
    resume_from: Path | None = None
    """A run directory or checkpoint directory to continue from (None: start fresh)."""
    extra_summary: dict[str, Any] = field(default_factory=dict)
    rank_description: str = ""
    """'rank r (clients [...])' once the federation has placed the clients; error lines use it."""
    liveness: Liveness | None = None
    """Heartbeats through the rendezvous store (Gloo/NCCL with several ranks)."""
    describe_rank: Callable[[int], str] = describe_plain
    """Any rank's 'rank r (clients [...])', once placed: failure lines name peers with it."""


@torch.no_grad()
def _check_feature_width(model, architecture: str, client_id: int, sample: torch.Tensor, width: int) -> None:
    """Prototypes of all clients must live in one R^K: refuse a model whose features differ."""
    was_training = model.training
    model.eval()
    got = tuple(model.features(sample).shape[1:])
    model.train(was_training)
    if got != (width,):
        raise HtflError(f"client {client_id}'s {architecture} gives features of shape {got}, but "
                        f"model.feature_dim={width}: every client must produce K-wide features")


def check_inputs(config: Config, inputs: InputSpec, uses_generator: bool) -> None:
    """One ConfigError line, before any model is built, unless every member of the model group
    takes the data's inputs, and the algorithm's server generator (FedKTL's) makes them."""
    check_group_inputs(config.model.group, config.num_clients, inputs)
    if uses_generator and not inputs.square:
        raise ConfigError(f"{config.algorithm} trains clients on images its generator makes, but the data is "
                          f"{inputs.describe()}; use it on square pictures")


def check_client_batching(client_class: type[ClientAlgorithm], context: AlgorithmContext, algorithm: str) -> None:
    """With ``train.client_batching=vmap``, one ConfigError line unless every client can train
    batched: the algorithm has a batched path (``ClientAlgorithm.has_batched_path``) and no
    member of the model group has a layer ``batching_obstacle`` names. Checked at start-up on
    every rank (the same answer everywhere, from the config alone), so nothing trains first."""
    if context.train.client_batching != "vmap":
        return
    if not client_class.has_batched_path():
        batched = [name for name in algorithm_names() if get_algorithm(name).client.has_batched_path()]
        raise ConfigError(f"train.client_batching=vmap: {algorithm} has no batched client path (these have: "
                          f"{', '.join(batched)}); use train.client_batching=off")
    for member in members_in_use(context.model_group, context.num_clients):
        with torch.device("meta"):
            model = build_model(member, num_classes=context.num_classes, feature_dim=context.feature_dim,
                                inputs=context.inputs)
        obstacle = batching_obstacle(model)
        if obstacle is not None:
            raise ConfigError(f"train.client_batching=vmap cannot batch {member}: it has {obstacle}, whose "
                              f"training output depends on the batch or on random draws; use "
                              f"train.client_batching=off")


def _every_loss_diverged(reports: dict[int, Any]) -> bool:
    """Every client that trained this round reported a loss that is not finite."""
    losses = [float(r["train"][0, 0]) for r in reports.values() if r["train"].shape[0] and r["train"][0, 1] > 0]
    return bool(losses) and not any(np.isfinite(losses))


def _diverged(config: Config, completed: int, out_dir: Path) -> TrainingDiverged:
    first = completed - config.train.max_diverged_rounds + 1
    kept = checkpoint.find_checkpoint(out_dir)
    return TrainingDiverged(
        f"training diverged: every participating client's loss was not finite in rounds {first}-{completed} "
        f"(train.max_diverged_rounds={config.train.max_diverged_rounds}); lower train.lr (now {config.train.lr:g}) "
        f"and start a new --out; " + (f"the last good checkpoint is {kept}" if kept else "no checkpoint was kept"))


class Federation:
    """Server and/or client role of this rank, built once, then ``run()``."""

    def __init__(self, run: RunContext) -> None:
        self.run_context = run
        self.config = config = run.config
        self.transport = transport = run.transport
        self.device = run.device
        self.rank, self.world_size = transport.rank, transport.world_size
        self.is_server = self.rank == 0
        self.watchdog = RoundWatchdog(config.runtime.round_deadline_s, f"rank {self.rank}", transport.abort,
                                      waiting_for=self._blocked_on, delay_s=0.0 if self.is_server else CLIENT_DELAY_S)
        self.watchdog.arm(STARTUP)  # a rank stuck in data preparation or the handshake must not hang MPI
        started = time.perf_counter()
        self.entry = get_algorithm(config.algorithm)
        options = parse_options(self.entry, config.algo)
        self.partition = self._prepare_data()
        check_inputs(config, self.partition.inputs(), self.entry.uses_generator)
        self._handshake()  # ranks agree on the maths before anything else travels
        self.placement = self._plan_placement()
        run.rank_description = self.placement.describe_rank(self.rank)
        run.describe_rank = self.placement.describe_rank
        self.watchdog.name_as(run.rank_description)
        if self.is_server:
            progress(self.placement.describe())
        latent_dim = generator_latent_dim(config.generator) if self.entry.uses_generator else 0
        self.context = AlgorithmContext(
            num_classes=self.partition.num_classes, feature_dim=config.model.feature_dim,
            seed=config.seed, train=config.train, options=options, device=self.device,
            num_clients=config.num_clients, model_group=config.model.group, model_init=config.model.init,
            in_channels=self.partition.in_channels, image_size=self.partition.image_size,
            latent_dim=latent_dim, input_spec=self.partition.inputs(),
        )
        self.entry.client.check_models(self.context)
        check_client_batching(self.entry.client, self.context, config.algorithm)
        self.client_algorithm = self.entry.client(self.context)
        self.server = None
        if self.is_server:
            self.server = self._build_server()
        self.download_spec = self.entry.server.download_fields(self.context)
        self.upload_spec = self.entry.client.upload_fields(self.context)
        check_private_run(config, self.entry, options, [item.name for item in self.upload_spec])
        self.privacy_plan = privacy_plan(config)  # None without privacy.enabled
        if config.output.prototypes_every:  # every rank: a mistake stops them all before they talk
            check_prototype_payloads(config.algorithm, self.upload_spec, self.download_spec)
        self.snapshots = PrototypeSnapshots(run.out_dir, config.output.prototypes_every)
        self.image_grids = GeneratedImageGrids(run.out_dir, self.download_spec)
        self.my_client_ids = self.placement.clients_of(self.rank)
        self._splits: dict[int, Any] = {}
        self._shared_initial_states: dict[str, dict[str, torch.Tensor]] = {}
        self._widths_checked: set[str] = set()
        self.clients = self._client_store()
        if run.liveness is not None:
            run.liveness.watch(self.placement.describe_rank, on_silent=run.liveness.end_job)
        self.watchdog.disarm()
        if self.is_server:
            progress(f"start-up: every rank has its data and models ({time.perf_counter() - started:.1f}s)")
        self.metrics = MetricsLog(run.out_dir / "metrics.jsonl") if self.is_server else None
        self.preemption = preemption_flag(config.runtime.preempt_grace_s)
        if run.liveness is not None:  # a SIGTERM may be the launcher tearing down a failed job
            self.preemption.job_failed = lambda: run.liveness.report_lost_peers(run.rank_description,
                                                                                 "SIGTERM from the launcher")
        self.preempted_after: int | None = None
        self.skipped_clients: list[int] = []
        self.diverged_rounds = 0  # rank 0: rounds in a row in which every participant's loss was not finite
        self.sinks: list[MetricsSink] = []
        where = "" if self.world_size == 1 else f"rank {self.rank}"
        self.training_progress = TrainingProgress(config.output.progress_every_s, where)

    def _blocked_on(self) -> str:
        """The rank this one is blocked on in a transfer right now, named ('' outside one)."""
        peer = self.transport.waiting_for
        return "" if peer is None else self.run_context.describe_rank(peer)

    # ------------------------------------------------------------------ set-up


    def _build_server(self):
        """The server half; FedKTL's gets the pre-trained generator, loaded here (rank 0 only),
        and its provenance goes into summary.json."""
        resources = {}
        if self.entry.uses_generator:
            began = time.perf_counter()
            generator = build_generator(self.config.generator, self.config.seed)
            provenance = generator.provenance()
            self.run_context.extra_summary["generator"] = provenance
            progress(f"generator: {provenance['name']}, latents R^{generator.latent_dim} -> "
                     f"{generator.image_channels}x{generator.image_resolution}x{generator.image_resolution} "
                     f"({time.perf_counter() - began:.1f}s)")
            resources["generator"] = generator
        seed_global_torch(self.config.seed, "server-init")  # server parameters, if any
        return self.entry.server(self.context, **resources)

    def _plan_placement(self) -> Placement:
        """Which rank hosts which client, by ``runtime.placement`` and ``runtime.placement_work``;
        every rank computes the same plan from the partition and the model group (and, for
        ``timed``, rank 0's step times, which every rank receives)."""
        step_seconds = self._timed_step_costs() if self.config.runtime.placement_work == "timed" else None
        work, unit = estimated_client_work(self.config, self.partition, step_seconds)
        return plan_placement(self.config.runtime.placement, self.world_size, work, unit)

    def _timed_step_costs(self) -> dict[str, float]:
        """``placement_work=timed``: rank 0 times one SGD step of every member of the model group
        on its device and broadcasts the figures (a declared float64 row, one entry per member),
        so every rank plans the same placement. Nothing is timed where placement cannot matter
        (at most one client rank, or round_robin)."""
        members = members_in_use(self.config.model.group, self.config.num_clients)
        if self.world_size <= 2 or self.config.runtime.placement == "round_robin":
            return dict.fromkeys(members, 1.0)
        spec = (Field("seconds", torch.float64, (len(members),), max_rows=1),)
        message = None
        if self.is_server:
            info = self.partition
            timed = timed_step_seconds(members, num_classes=info.num_classes, feature_dim=self.config.model.feature_dim,
                                       inputs=info.inputs(), batch_size=self.config.train.batch_size,
                                       device=self.device)
            progress("placement: one training step takes " + ", ".join(
                f"{member} {seconds * 1000:.1f} ms" for member, seconds in timed.items()))
            message = encode(spec, {BROADCAST_ENTRY: {"seconds": torch.tensor([list(timed.values())],
                                                                               dtype=torch.float64)}})
        received = decode(spec, self.transport.broadcast(message))[BROADCAST_ENTRY]["seconds"][0]
        if not bool(torch.isfinite(received).all() and (received > 0).all()):
            raise ProtocolError(f"rank 0 sent step times that are not positive and finite: {received.tolist()}")
        return dict(zip(members, received.tolist(), strict=True))

    def _prepare_data(self):
        """Rank 0 builds the partition cache while the others wait; they then find it (or, on a
        node that does not share the cache directory, build the identical file themselves)."""
        config = self.config
        if self.rank != 0:
            self.transport.barrier()
            return prepare_partition(config.data, config.num_clients, config.seed,
                                     batch_size=config.train.batch_size)
        began = time.perf_counter()
        info = prepare_partition(config.data, config.num_clients, config.seed, report=progress,
                                 batch_size=config.train.batch_size)
        progress(f"data: {config.data.dataset}, {config.num_clients} clients, {info.num_classes} classes, "
                 f"{info.inputs().describe()} ({time.perf_counter() - began:.1f}s)")
        self.transport.barrier()
        return info

    def _client_store(self) -> ClientStore:
        """This rank's clients: all resident, or (``runtime.resident_clients``) an LRU of them.
        A bounded store builds one client of each architecture now, so a model that does not fit
        the data fails at start-up rather than in the round that first needs it."""
        runtime = self.config.runtime
        scratch = Path(runtime.client_scratch_dir) if runtime.client_scratch_dir else None
        store = ClientStore(self.my_client_ids, self._build_client, resident=runtime.resident_clients,
                            device=self.device, rank=self.rank, scratch_dir=scratch)
        if store.bounded:
            first_of_architecture = {}
            for client_id in self.my_client_ids:
                first_of_architecture.setdefault(architecture_for_client(self.config.model.group, client_id), client_id)
            for client_id in sorted(first_of_architecture.values()):
                store.peek(client_id)
        return store

    def _client_split(self, client_id: int):
        """The client's data on this rank's device, loaded once (data stays resident: its total is
        the dataset's size, however many clients share it)."""
        split = self._splits.get(client_id)
        if split is None:
            raw = load_client_split(self.partition.path, client_id)
            split = self._splits[client_id] = tuple(tensor.to(self.device) for tensor in
                                                    (raw.train_x, raw.train_y, raw.test_x, raw.test_y))
        return split

    def _initial_model(self, client_id: int, shell: bool) -> torch.nn.Module:
        """Client ``client_id``'s initial model. A ``shell`` (about to receive a parked state) is
        built on the meta device and only allocated. With ``model.init=htfllib`` every client of
        a member starts from the same weights (seeded by ``seed`` alone), so they are drawn once
        per member and copied into a shell after that: drawing HtCNN8's weights costs about 10 ms
        a client, which start-up and evaluation with parked clients pay per client otherwise.
        Either shortcut needs every parameter and buffer in the state dict; a model keeping
        buffers outside it is always built in full."""
        config, info = self.config, self.partition

        def build() -> torch.nn.Module:
            return initial_client_model(
                config.model.group, client_id, config.seed, num_classes=info.num_classes,
                feature_dim=config.model.feature_dim, inputs=info.inputs(), init=config.model.init,
            )

        member = architecture_for_client(config.model.group, client_id)
        shared = self._shared_initial_states.get(member)  # only ever filled with model.init=htfllib
        if shell or shared is not None:
            with torch.device("meta"):
                model = build()
            held = set(model.state_dict())
            if all(name in held for name, _ in (*model.named_parameters(), *model.named_buffers())):
                model = model.to_empty(device=self.device)
                if not shell:
                    model.load_state_dict(shared)
                return model
        model = build().to(self.device)
        if config.model.init == "htfllib" and shared is None:
            self._shared_initial_states[member] = {name: value.detach().clone()
                                                   for name, value in model.state_dict().items()}
        return model

    def _build_client(self, client_id: int, shell: bool = False) -> ClientState:
        """A client with its data and model (``shell``: weights to be overwritten, see ClientStore).
        The feature width is checked on the first client of each architecture (it is a property
        of the architecture and the input shape)."""
        config = self.config
        train_x, train_y, test_x, test_y = self._client_split(client_id)
        architecture = architecture_for_client(config.model.group, client_id)
        model = self._initial_model(client_id, shell)
        if not shell and architecture not in self._widths_checked:
            _check_feature_width(model, architecture, client_id, train_x[:2], config.model.feature_dim)
            self._widths_checked.add(architecture)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.train.lr)
        client = ClientState(
            client_id=client_id, architecture=architecture, model=model, optimizer=optimizer,
            train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y, device=self.device,
        )
        seed_global_torch(config.seed, "algorithm-init", client_id)
        self.client_algorithm.init_client(client)
        if self.privacy_plan is not None:
            attach_ledger(client, self.privacy_plan)
        return client

    def _handshake(self) -> None:
        """Start-up check that every rank runs the same maths (config, classes, feature width)."""
        config_hash = int(self.config.config_hash()[:15], 16)
        facts = torch.tensor([[config_hash, self.partition.num_classes, self.config.model.feature_dim,
                               self.config.num_clients, software_fingerprint()]], dtype=torch.int64)
        gathered = self.transport.gather(encode(HANDSHAKE_SPEC, {self.rank: {"facts": facts}}),
                                         self._bounds(HANDSHAKE_SPEC, lambda rank: 1))
        if gathered is None:
            return
        mine = facts[0].tolist()
        for message in gathered:
            for rank, payload in decode(HANDSHAKE_SPEC, message).items():
                theirs = payload["facts"][0].tolist()
                if theirs != mine:
                    raise HtflError(
                        f"rank {rank} disagrees with rank 0 on (config hash, classes, K, clients, software): "
                        f"{theirs} vs {mine}; start every rank with the same config, data and install "
                        f"(htfl_dist, torch, numpy versions)"
                    )

    # ------------------------------------------------------------------ one round

    def knowledge(self) -> Payload:
        """What the clients would receive now (the server's download, through the transport)."""
        return self._broadcast_knowledge(RoundTraffic())

    def _broadcast_knowledge(self, traffic: RoundTraffic) -> Payload:
        if not self.download_spec:
            return {}  # the algorithm shares nothing server → clients: nothing travels
        message = encode(self.download_spec, {BROADCAST_ENTRY: self.server.download()}) if self.is_server else None
        received = self.transport.broadcast(message)
        traffic.down += received.nbytes * len(client_ranks(self.world_size))
        return decode(self.download_spec, received, self.device)[BROADCAST_ENTRY]

    def _train_participants(self, participants: list[int], knowledge: Payload, round_index: int
                            ) -> tuple[dict[int, Payload], dict[int, list[float]], int]:
        uploads, train_rows, theory = {}, {}, 0
        mine = [client_id for client_id in participants if client_id in self.clients]
        self.training_progress.start(round_index + 1, len(mine))
        for group in self._training_groups(mine):
            clients = [self.clients[client_id] for client_id in group]
            for client, result in zip(clients, self._train_group(clients, knowledge, round_index), strict=True):
                uploads[client.client_id] = result.upload
                train_rows[client.client_id] = [result.loss_sum, float(result.samples)]
                theory += self.client_algorithm.theory_upload_floats(client) * 4
                self.training_progress.client_done()
        return uploads, train_rows, theory

    def _training_groups(self, client_ids: list[int]) -> list[list[int]]:
        """The clients that train together: each alone (``train.client_batching=off``), or this
        rank's participants of one architecture (``vmap``), in client-id order; a group is held in
        memory at once, so with ``runtime.resident_clients=K`` it holds at most K clients."""
        if self.config.train.client_batching == "off":
            return [[client_id] for client_id in client_ids]
        groups: dict[str, list[int]] = {}
        for client_id in client_ids:
            groups.setdefault(architecture_for_client(self.config.model.group, client_id), []).append(client_id)
        size = self.clients.limit if self.clients.bounded else len(client_ids)
        return [group[start : start + size] for group in groups.values() for start in range(0, len(group), size)]

    def _train_group(self, clients: list[ClientState], knowledge: Payload, round_index: int) -> list[TrainResult]:
        """One group's round of local training, each client's batches ordered by its own stream
        (seed, client, round); off: ``train`` of the one client, torch's global RNG seeded for it."""
        seed = self.config.seed
        generators = [torch_generator(seed, "batches", client.client_id, round_index) for client in clients]
        begin_round(clients, round_index)  # privacy: each client's ledger decides whether it can afford the round
        if self.config.train.client_batching == "vmap":
            return self.client_algorithm.train_group(clients, knowledge, round_index, generators)
        (client,), (generator,) = clients, generators
        seed_training(seed, client.client_id, round_index)
        return [self.client_algorithm.train(client, knowledge, round_index, generator)]

    @torch.no_grad()
    def _evaluate_clients(self, knowledge: Payload) -> dict[int, list[float]]:
        rows = {}
        installs = type(self.client_algorithm).prepare_evaluation is not ClientAlgorithm.prepare_evaluation
        for client_id in self.clients:
            # evaluation only reads a client unless the algorithm installs knowledge first
            client = self.clients[client_id] if installs else self.clients.peek(client_id)
            self.client_algorithm.prepare_evaluation(client, knowledge)
            client.model.eval()
            correct = correct_head = 0
            for start in range(0, client.test_y.shape[0], 1000):
                x, y = client.test_x[start : start + 1000], client.test_y[start : start + 1000]
                features, logits = client.model.forward_with_features(x)
                predicted = self.client_algorithm.predict(client, knowledge, features, logits, x)
                correct += int((predicted == y).sum())
                correct_head += int((self.client_algorithm.head_predict(client, logits) == y).sum())
            rows[client_id] = [float(correct), float(correct_head), float(client.test_y.shape[0])]
        return rows

    def _gather_uploads(self, uploads: dict[int, Payload], participants: list[int], round_index: int,
                        traffic: RoundTraffic) -> dict[int, Payload] | None:
        spec = self.upload_spec
        if not spec:
            return {} if self.is_server else None  # nothing declared, nothing travels
        gathered = self.transport.gather(encode(spec, uploads), self._bounds(
            spec, lambda rank: sum(self.placement.rank_of(cid) == rank for cid in participants)))
        if gathered is None:
            return None
        merged: dict[int, Payload] = {}
        for rank, message in enumerate(gathered):  # the transport gathers ranks in order, rank 0 first
            expected = [cid for cid in participants if self.placement.rank_of(cid) == rank]
            try:
                entries = unpack_rank_message(spec, message, expected)
            except ProtocolError as exc:
                sender = self.placement.describe_rank(rank)
                if self.config.on_bad_upload == "fail":
                    raise ProtocolError(f"{sender} {exc}") from None
                print(f"htfl_dist: warning: round {round_index + 1}: left out {sender}'s clients "
                      f"{expected}: {sender} {exc}", file=sys.stderr, flush=True)
                self.skipped_clients.extend(expected)
                continue
            if entries:
                traffic.up += message.nbytes
            merged.update(entries)
        return dict(sorted(merged.items()))

    def _bounds(self, spec, entries_of_rank) -> list[int | None] | None:
        """Rank 0: per rank, the most bytes its message of ``spec`` can truthfully hold given the
        entries it speaks for (``entries_of_rank(rank)``); other ranks need none."""
        if not self.is_server:
            return None
        return [max_message_bytes(spec, entries_of_rank(rank)) for rank in range(self.world_size)]

    def _gather_reports(self, train_rows, eval_rows, seconds: float, theory_up: int, stop_requested: bool,
                        participants: list[int], evaluated: bool):
        entries: dict[int, Payload] = {}
        for client_id in sorted(set(train_rows) | set(eval_rows)):
            entries[client_id] = {
                "train": _rows(train_rows.get(client_id), 2),
                "eval": _rows(eval_rows.get(client_id), 3),
                "rank": _rows(None, len(RankReport._fields)),
                "privacy": _rows(self._epsilon_row(client_id), 1),
            }
        mine = RankReport(seconds, float(theory_up), float(stop_requested))
        entries[RANK_ENTRY] = {"train": _rows(None, 2), "eval": _rows(None, 3),
                               "rank": _rows(list(mine), len(mine)), "privacy": _rows(None, 1)}
        gathered = self.transport.gather(encode(REPORT_SPEC, entries), self._bounds(
            REPORT_SPEC, lambda rank: len(self.placement.clients_of(rank)) + 1))
        if gathered is None:
            return None
        reports, rank_rows = {}, []
        for rank, message in enumerate(gathered):  # ranks in order, rank 0 first
            hosted = self.placement.clients_of(rank)
            try:
                decoded = decode(REPORT_SPEC, message)
                own = decoded.pop(RANK_ENTRY, None)
                if own is None or own["rank"].shape[0] != 1:
                    raise ProtocolError("sent a report without its rank row")
                check_rank_row(own["rank"][0].tolist())
                check_rank_report(decoded, [cid for cid in participants if cid in hosted],
                                  hosted if evaluated else [])
            except ProtocolError as exc:
                raise ProtocolError(f"{self.placement.describe_rank(rank)} {exc}") from None
            rank_rows.append(RankReport(*own["rank"][0].tolist()))
            reports.update(decoded)
        return dict(sorted(reports.items())), rank_rows

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any] | None:
        config = self.config
        start_round = self.restore()
        if self.is_server:
            self._publish_config()
            self.sinks = open_sinks(config, self.run_context.out_dir, start_round + 1)
        try:
            return self._run_rounds(start_round)
        finally:
            for sink in self.sinks:
                sink.close()
            self.clients.close()

    def _run_rounds(self, start_round: int) -> dict[str, Any] | None:
        setup_traffic = RoundTraffic()
        if start_round == 0:
            self._setup_exchange(setup_traffic)
        knowledge: Payload | None = None  # what the clients of this rank last received
        round_seconds: list[float] = []
        for round_index in range(start_round, self.config.rounds):
            self.watchdog.arm(round_index + 1)
            began = time.perf_counter()
            outcome, knowledge = self._play_round(round_index, knowledge)
            round_seconds.append(time.perf_counter() - began)
            if self.is_server:
                self._record(outcome, round_seconds, setup_traffic)
            stop = self._close_round(outcome)
            self.watchdog.disarm()
            if stop:
                self.preempted_after = round_index + 1
                return None
        return self._finish(round_seconds) if self.is_server else None

    def _play_round(self, round_index: int, knowledge: Payload | None) -> tuple[RoundOutcome, Payload | None]:
        """One round, as its phases: knowledge down, local training, uploads up, the server step,
        evaluation (on evaluation rounds), reports up. Returns what it produced and the knowledge
        the clients now hold (None: the next round must broadcast it)."""
        config = self.config
        outcome = RoundOutcome(
            round_index, sample_participants(config.seed, round_index, config.num_clients, config.join_ratio),
            evaluated=(round_index + 1) % config.eval_every == 0 or round_index + 1 == config.rounds)
        if knowledge is None:
            knowledge = self._broadcast_knowledge(outcome.traffic)
        if self.is_server:
            outcome.traffic.theory_down = self.server.theory_download_floats() * 4 * len(outcome.participants)
        began = time.perf_counter()
        uploads, train_rows, theory_up = self._train_participants(outcome.participants, knowledge, round_index)
        outcome.client_seconds = time.perf_counter() - began
        gathered = self._gather_uploads(uploads, outcome.participants, round_index, outcome.traffic)
        if self.is_server:
            self._server_step(outcome, gathered)
        knowledge, eval_rows = self._evaluation(outcome)
        outcome.report = self._gather_reports(train_rows, eval_rows, outcome.client_seconds, theory_up,
                                              self.preemption.requested, outcome.participants, outcome.evaluated)
        return outcome, knowledge

    def _server_step(self, outcome: RoundOutcome, gathered: dict[int, Payload]) -> None:
        """Rank 0: screen the uploads, update the global knowledge (kept as it was when every
        upload was screened out), keep the snapshots and pictures that are due."""
        round_number = outcome.round_index + 1
        gathered, skipped = screen_uploads(gathered, self.server.validate_upload, self.config.on_bad_upload,
                                           round_number)
        self.skipped_clients.extend(skipped)
        began = time.perf_counter()
        if gathered or not self.upload_spec:
            generator = torch_generator(self.config.seed, "server", outcome.round_index)
            outcome.diagnostics = self.server.update(gathered, outcome.round_index, generator)
        else:
            outcome.diagnostics = {"server_skipped": True}
        outcome.server_seconds = time.perf_counter() - began
        if self.snapshots.due(round_number):
            self.snapshots.save(round_number, gathered, self.server.download())
        if outcome.evaluated and self.image_grids.enabled:  # download() may compress (FedKD): only then
            self.image_grids.save(round_number, self.server.download())

    def _evaluation(self, outcome: RoundOutcome) -> tuple[Payload | None, dict[int, list[float]]]:
        """On evaluation rounds: the new knowledge goes down and every client of this rank is
        evaluated on its test split (its time counts as client time). Returns the knowledge the
        clients now hold (None on other rounds: the next round sends it) and the counts."""
        if not outcome.evaluated:
            return None, {}
        knowledge = self._broadcast_knowledge(outcome.traffic)
        began = time.perf_counter()
        eval_rows = self._evaluate_clients(knowledge)
        outcome.client_seconds += time.perf_counter() - began
        return knowledge, eval_rows

    def _record(self, outcome: RoundOutcome, round_seconds: list[float], setup_traffic: RoundTraffic) -> None:
        """Rank 0: the metrics row of an evaluation round (sinks too) and the progress line."""
        config, traffic = self.config, outcome.traffic
        reports, rank_rows = outcome.report
        traffic.theory_up = int(sum(r.theory_up_bytes for r in rank_rows))
        rank_seconds = [r.compute_seconds for r in rank_rows]
        seconds = round_seconds[-1]
        row = None
        if outcome.evaluated:
            row = self._metrics_row(outcome.round_index, reports, traffic, outcome.diagnostics, seconds,
                                    max(rank_seconds), outcome.server_seconds)
            row["rank_idle_share"] = idle_shares(rank_seconds[1:] if self.world_size > 1 else rank_seconds)
            if setup_traffic.up:  # the one-off setup upload, reported with the first row
                row["bytes_setup_up"], setup_traffic.up = setup_traffic.up, 0
            self.metrics.append(row)
            for sink in self.sinks:
                sink.write(self.metrics.rows)
            self.skipped_clients = []
        eta = float(np.mean(round_seconds)) * (config.rounds - outcome.round_index - 1)
        progress(format_progress(outcome.round_index + 1, config.rounds, row, seconds, eta))

    def _close_round(self, outcome: RoundOutcome) -> bool:
        """Every rank: agree whether to stop (a SIGTERM anywhere) and checkpoint when stopping or
        when one is due, inside the round's deadline (a stuck save must not hang MPI)."""
        decision = self._agree_to_stop(outcome.report)
        completed = outcome.round_index + 1
        if decision & GIVE_UP:
            raise _diverged(self.config, completed, self.run_context.out_dir)
        stop, every = bool(decision & STOP), self.config.checkpoint_every
        if stop or (every and completed % every == 0 and not decision & DIVERGING):
            self._save_checkpoint(completed)
        return stop

    def _setup_exchange(self, traffic: RoundTraffic) -> None:
        """Before the first round of a fresh run, every client sends the algorithm's setup payload
        (FedGen's label counts) and the server consumes them; a resumed run has it in the server's
        checkpoint. Invalid setup uploads are screened like round uploads."""
        spec = self.entry.client.setup_upload_fields(self.context)
        if not spec:
            return
        entries = {cid: self.client_algorithm.setup_upload(self.clients.peek(cid)) for cid in self.clients}
        gathered = self.transport.gather(encode(spec, entries), self._bounds(
            spec, lambda rank: len(self.placement.clients_of(rank))))
        if gathered is None:
            return
        merged: dict[int, Payload] = {}
        for message in gathered:
            traffic.up += message.nbytes if int(message.header[0]) > 0 else 0
            merged.update(decode(spec, message))
        kept, _ = screen_uploads(dict(sorted(merged.items())), self.server.validate_setup_upload,
                                 self.config.on_bad_upload, round_number=0)
        self.server.setup(kept)

    def _agree_to_stop(self, report) -> int:
        """Rank 0 decides (any rank saw SIGTERM; the training diverged) and tells everyone, so all
        act at one boundary; returns the decision's bits (STOP, DIVERGING, GIVE_UP)."""
        decision = {}
        if self.is_server:
            reports, rank_rows = report
            self.diverged_rounds = self.diverged_rounds + 1 if _every_loss_diverged(reports) else 0
            limit = self.config.train.max_diverged_rounds
            bits = ((STOP if any(r.stop_requested for r in rank_rows) else 0)
                    | (DIVERGING if self.diverged_rounds else 0)
                    | (GIVE_UP if limit and self.diverged_rounds >= limit else 0))
            decision = {BROADCAST_ENTRY: {"stop": torch.tensor([bits])}}
        message = self.transport.broadcast(encode(CONTROL_SPEC, decision) if self.is_server else None)
        return int(decode(CONTROL_SPEC, message)[BROADCAST_ENTRY]["stop"][0])

    def _metrics_row(self, round_index, reports, traffic, diagnostics, seconds, client_s, server_s) -> dict:
        evals = np.array([r["eval"][0].tolist() for r in reports.values() if r["eval"].shape[0]])
        trains = np.array([r["train"][0].tolist() for r in reports.values() if r["train"].shape[0]])
        per_client = evals[:, 0] / np.maximum(evals[:, 2], 1)
        samples = evals[:, 2].sum()
        row = {
            "round": round_index + 1,
            "test_acc": float(evals[:, 0].sum() / samples),
            "test_acc_head": float(evals[:, 1].sum() / samples),
            "test_acc_std": float(per_client.std()),
            "train_loss": float(trains[:, 0].sum() / max(trains[:, 1].sum(), 1)) if len(trains) else None,
            "bytes_up": traffic.up,
            "bytes_down": traffic.down,
            "bytes_theory_up": traffic.theory_up,
            "bytes_theory_down": traffic.theory_down,
            "seconds": seconds,
            "client_s": client_s,
            "server_s": server_s,
            "comm_s": max(0.0, seconds - client_s - server_s),
            "skipped_clients": list(self.skipped_clients),  # bad uploads left out since the last row
        }
        row.update(epsilon_columns([float(r["privacy"][0, 0]) for r in reports.values() if r["privacy"].shape[0]]))
        row.update(diagnostics)
        return row

    def _epsilon_row(self, client_id: int) -> list[float] | None:
        """privacy.enabled: [ε the client has spent so far] for the report; None otherwise."""
        return None if self.privacy_plan is None else [client_epsilon(self.clients.peek(client_id))]

    # ------------------------------------------------------------------ checkpoints and summary

    def _save_checkpoint(self, completed_rounds: int) -> None:
        checkpoint.save(self.run_context.out_dir, completed_rounds, self.config, self.transport,
                        clients=self.clients, server=self.server,
                        metric_rounds=[row["round"] for row in self.metrics.rows] if self.metrics else None)

    def restore(self) -> int:
        """Load the newest complete checkpoint of ``resume_from`` (clients, server, metrics so far)
        and return the rounds it completed; 0 when there is nothing to resume. ``run`` calls it
        first; inspection tools (bench/diagnose_prototypes.py) call it instead of ``run``."""
        source = self.run_context.resume_from
        directory = checkpoint.find_checkpoint(source) if source is not None else None
        if directory is None:  # a fresh run, or --resume auto before any checkpoint: start over
            if self.metrics is not None:
                if source is not None:
                    progress(f"resume: no complete checkpoint in {source}; starting from round 1")
                self.metrics.load_existing(0)  # rows of a run that died before its first checkpoint
            return 0
        completed = checkpoint.load(directory, self.config, clients=self.clients, server=self.server,
                                    device=self.device)
        if completed > self.config.rounds:
            raise HtflError(f"checkpoint {directory} is after round {completed} but rounds={self.config.rounds}; "
                            f"pass rounds={completed} or more to continue it")
        if self.metrics is not None:
            self.metrics.load_existing(completed, source=directory.parent.parent / "metrics.jsonl",
                                       required_rounds=checkpoint.metric_rounds(directory, self.config.eval_every))
            progress(f"resume: continuing after round {completed} from {directory}")
        return completed

    def _publish_config(self) -> None:
        """Rank 0 writes config.yaml once the run is known to go ahead (after a resume was accepted),
        and removes a summary.json left by an earlier end of this run, which no longer describes it."""
        out = self.run_context.out_dir
        write_atomic(out / "config.yaml", yaml.safe_dump(self.config.to_dict(), sort_keys=False))
        (out / "summary.json").unlink(missing_ok=True)

    def _finish(self, round_seconds: list[float]) -> dict[str, Any]:
        summary = {
            **accuracy_summary(self.metrics.rows),
            "rounds": self.config.rounds,
            "config_hash": self.config.config_hash(),
            "world_size": self.world_size,
            "transport": self.transport.name,
            "device": str(self.device),
            "seconds_per_round": float(np.mean(round_seconds)) if round_seconds else None,
            **self.run_context.extra_summary,
            **privacy_summary(self.metrics.rows, self.privacy_plan),
        }
        write_json(self.run_context.out_dir / "summary.json", summary)
        return summary
