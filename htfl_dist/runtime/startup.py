"""Start-up of one rank, before the first round: the data, the ranks' agreement on the maths,
the placement of clients on ranks, the server half, and the factory of this rank's clients.

Every check that can fail on the config alone runs here on every rank, so a mistake stops all
ranks before any trains or talks; each is one line naming the key or the client.
"""
from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from htfl_dist.algorithms import (
    AlgorithmContext,
    AlgorithmEntry,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    algorithm_names,
    get_algorithm,
)
from htfl_dist.algorithms.optimizers import build_optimizer
from htfl_dist.algorithms.registry import vouched_concurrent
from htfl_dist.algorithms.training import batching_obstacle
from htfl_dist.config import Config
from htfl_dist.data import load_client_splits, prepare_partition
from htfl_dist.data.cache import load_test_union, with_few_shot
from htfl_dist.errors import ConfigError, HtflError, ProtocolError
from htfl_dist.generators import build_generator
from htfl_dist.metrics.writer import progress
from htfl_dist.models import (
    InputSpec,
    SplitModel,
    architecture_for_client,
    build_model,
    check_group_inputs,
    initial_client_model,
    load_pretrained,
    members_in_use,
)
from htfl_dist.models.cost import timed_step_seconds
from htfl_dist.payload import Field
from htfl_dist.privacy.startup import attach_ledger
from htfl_dist.runtime.client_store import ClientStore
from htfl_dist.runtime.exchange import message_bounds
from htfl_dist.runtime.placement import Placement, estimated_client_work, plan_placement
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.wire import BROADCAST_ENTRY, decode, encode
from htfl_dist.seeding import seed_global_torch

HANDSHAKE_SPEC = (Field("facts", torch.int64, (5,), max_rows=1),)  # [config hash, C, K, num_clients, software]


def software_fingerprint() -> int:
    """The versions that decide the numbers (htfl_dist, torch, numpy), as one int64: ranks built
    from different installs would break bitwise world-size invariance without an error."""
    from htfl_dist import __version__

    text = f"htfl_dist {__version__} torch {torch.__version__} numpy {np.__version__}"
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def check_inputs(config: Config, inputs: InputSpec, uses_generator: bool) -> None:
    """One ConfigError line, before any model is built, unless every member of the model group
    takes the data's inputs, and the algorithm's server generator (FedKTL's) makes them."""
    check_group_inputs(config.model.group, config.num_clients, inputs)
    if uses_generator and not inputs.square:
        raise ConfigError(f"{config.algorithm} trains clients on images its generator makes, but the data is "
                          f"{inputs.describe()}; use it on square pictures")


def check_client_batching(entry: AlgorithmEntry, context: AlgorithmContext) -> None:
    """With ``train.client_batching=vmap``, one ConfigError line unless every client can train
    batched: the algorithm's registry entry declares a batched path (``batched_clients``) and no
    member of the model group has a layer ``batching_obstacle`` names. Checked at start-up on
    every rank (the same answer everywhere, from the config alone), so nothing trains first."""
    if context.train.client_batching != "vmap":
        return
    if not entry.batched_clients:
        batched = [name for name in algorithm_names() if get_algorithm(name).batched_clients]
        raise ConfigError(f"train.client_batching=vmap: {entry.name} has no batched client path (these have: "
                          f"{', '.join(batched)}); use train.client_batching=off")
    for member in members_in_use(context.model_group, context.num_clients):
        with torch.device("meta"):
            model = build_model(member, num_classes=context.num_classes, feature_dim=context.feature_dim,
                                inputs=context.inputs, options=context.model_options)
        obstacle = batching_obstacle(model)
        if obstacle is not None:
            raise ConfigError(f"train.client_batching=vmap cannot batch {member}: it has {obstacle}, whose "
                              f"training output depends on the batch or on random draws; use "
                              f"train.client_batching=off")


def step_graphs(config: Config, entry: AlgorithmEntry, device: torch.device) -> tuple[bool, str]:
    """``train.cuda_graphs`` resolved for this run: (record the local steps?, why not, or ''),
    from the config, the algorithm's declaration and the device alone, so every rank agrees.
    ``on`` where it cannot hold is one ConfigError line before anything trains."""
    mode = config.train.cuda_graphs
    if mode == "off":
        return False, ""
    obstacles = []
    if device.type != "cuda":
        obstacles.append(f"the device is {device.type}, not a CUDA GPU")
    if not entry.client.capturable_step:
        able = _algorithms_whose_client(lambda client: client.capturable_step)
        obstacles.append(f"{entry.name}'s local step is not declared capturable (these are: {able})")
    obstacles += _steps_of_their_own(config)
    if obstacles and mode == "on":
        raise ConfigError(f"train.cuda_graphs=on cannot record the local steps: {'; '.join(obstacles)}; "
                          f"use train.cuda_graphs=auto or off")
    return not obstacles, "; ".join(obstacles)


def concurrent_clients(config: Config, entry: AlgorithmEntry, device: torch.device) -> tuple[int, str]:
    """``train.concurrent_clients`` resolved for this run: (how many clients train at once, 0 for
    "as many as the measured step time says" on a GPU; why one at a time, or ''), from the config,
    the algorithm's declaration and the device alone. An explicit N > 1 where it cannot hold is one
    ConfigError line before anything trains; auto settles on one at a time there."""
    asked = config.train.concurrent_clients
    if asked == 1:
        return 1, ""
    obstacles = []
    if not vouched_concurrent(entry.client):
        able = _algorithms_whose_client(vouched_concurrent)
        obstacles.append(f"{entry.name}'s client step is not declared trains_concurrently (these are: {able})")
    obstacles += _steps_of_their_own(config)  # compile and vmap with N > 1 are refused by TrainConfig already
    if obstacles and asked > 1:
        raise ConfigError(f"train.concurrent_clients={asked} cannot train clients side by side: "
                          f"{'; '.join(obstacles)}; use train.concurrent_clients=1 or 0 (auto)")
    if asked == 0 and not obstacles and device.type != "cuda":
        obstacles.append(f"the device is {device.type}: a rank's threads serve one client at a time "
                         f"(run more ranks)")
    if obstacles:
        return 1, "; ".join(obstacles)
    return asked, ""


def _steps_of_their_own(config: Config) -> list[str]:
    """The options that train through a step of their own, which neither a recorded step nor a
    training thread runs: one phrase each."""
    paths = (("privacy.enabled", config.privacy.enabled, "DP-SGD steps through Opacus"),
             ("train.compile", config.train.compile != "off", "it compiles the forward"),
             ("train.client_batching", config.train.client_batching != "off", "batched clients step through vmap"))
    return [f"{key} is on ({why})" for key, on, why in paths if on]


def _algorithms_whose_client(holds: Callable[[type[ClientAlgorithm]], bool]) -> str:
    """The registered algorithms whose client class ``holds``, named for an error line."""
    return ", ".join(name for name in algorithm_names() if holds(get_algorithm(name).client))


def prepare_data(config: Config, transport: Transport):
    """Rank 0 builds the partition cache while the others wait; they then find it (or, on a
    node that does not share the cache directory, build the identical file themselves)."""
    shots = config.data.few_shot
    split_among = config.num_clients + config.eval.new_clients  # unseen clients' data: the same partition
    if transport.rank != 0:
        transport.barrier()
        return with_few_shot(prepare_partition(config.data, split_among, config.seed,
                                               batch_size=config.train.batch_size), shots)
    began = time.perf_counter()
    info = prepare_partition(config.data, split_among, config.seed, report=progress,
                             batch_size=config.train.batch_size)
    few = f", {shots}-shot training splits" if shots else ""
    unseen = f" + {config.eval.new_clients} unseen" if config.eval.new_clients else ""
    progress(f"data: {info.describe()}, {config.num_clients} clients{unseen}, {info.num_classes} classes{few}, "
             f"{info.inputs().describe()} ({time.perf_counter() - began:.1f}s)")
    transport.barrier()
    return with_few_shot(info, shots)


def handshake(config: Config, num_classes: int, transport: Transport) -> None:
    """Every rank runs the same maths (config, classes, feature width, clients, install), or the
    job ends naming the rank that differs, before anything else travels."""
    facts = torch.tensor([[int(config.config_hash()[:15], 16), num_classes, config.model.feature_dim,
                           config.num_clients, software_fingerprint()]], dtype=torch.int64)
    gathered = transport.gather(encode(HANDSHAKE_SPEC, {transport.rank: {"facts": facts}}),
                                message_bounds(transport, HANDSHAKE_SPEC, lambda rank: 1))
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


def timed_step_costs(config: Config, partition: Any, transport: Transport, device: torch.device
                     ) -> dict[str, float]:
    """``placement_work=timed``: rank 0 times one SGD step of every member of the model group
    on its device and broadcasts the figures (a declared float64 row, one entry per member),
    so every rank plans the same placement. Nothing is timed where placement cannot matter
    (at most one client rank, or round_robin)."""
    members = members_in_use(config.model.group, config.num_clients)
    if transport.world_size <= 2 or config.runtime.placement == "round_robin":
        return dict.fromkeys(members, 1.0)
    spec = (Field("seconds", torch.float64, (len(members),), max_rows=1),)
    message = None
    if transport.rank == 0:
        timed = timed_step_seconds(members, num_classes=partition.num_classes, feature_dim=config.model.feature_dim,
                                   inputs=partition.inputs(), batch_size=config.train.batch_size, device=device,
                                   options=config.model.options)
        progress("placement: one training step takes " + ", ".join(
            f"{member} {seconds * 1000:.1f} ms" for member, seconds in timed.items()))
        message = encode(spec, {BROADCAST_ENTRY: {"seconds": torch.tensor([list(timed.values())],
                                                                           dtype=torch.float64)}})
    received = decode(spec, transport.broadcast(message))[BROADCAST_ENTRY]["seconds"][0]
    if not bool(torch.isfinite(received).all() and (received > 0).all()):
        raise ProtocolError(f"rank 0 sent step times that are not positive and finite: {received.tolist()}")
    return dict(zip(members, received.tolist(), strict=True))


def place_clients(config: Config, partition: Any, transport: Transport, device: torch.device) -> Placement:
    """Which rank hosts which client, by ``runtime.placement`` and ``runtime.placement_work``;
    every rank computes the same plan from the partition and the model group (and, for
    ``timed``, rank 0's step times, which every rank receives)."""
    step_seconds = timed_step_costs(config, partition, transport, device) \
        if config.runtime.placement_work == "timed" else None
    work, unit = estimated_client_work(config, partition, step_seconds)
    return plan_placement(config.runtime.placement, transport.world_size, work, unit,
                          config.runtime.server_hosts_clients).with_unseen(config.eval.new_clients)


def build_server(entry: AlgorithmEntry, context: AlgorithmContext, config: Config,
                 extra_summary: dict[str, Any]) -> ServerAlgorithm:
    """The server half (rank 0); FedKTL's gets the pre-trained generator, loaded here, and its
    provenance goes into summary.json."""
    resources = {}
    if entry.uses_generator:
        began = time.perf_counter()
        generator = build_generator(config.generator, config.seed)
        provenance = generator.provenance()
        extra_summary["generator"] = provenance
        progress(f"generator: {provenance['name']}, latents R^{generator.latent_dim} -> "
                 f"{generator.image_channels}x{generator.image_resolution}x{generator.image_resolution} "
                 f"({time.perf_counter() - began:.1f}s)")
        resources["generator"] = generator
    seed_global_torch(config.seed, "server-init")  # server parameters, if any
    return entry.server(context, **resources)


@torch.no_grad()
def check_feature_width(model, architecture: str, client_id: int, sample: torch.Tensor, width: int) -> None:
    """Prototypes of all clients must live in one R^K: refuse a model whose features differ."""
    was_training = model.training
    model.eval()
    got = tuple(model.features(sample).shape[1:])
    model.train(was_training)
    if got != (width,):
        raise HtflError(f"client {client_id}'s {architecture} gives features of shape {got}, but "
                        f"model.feature_dim={width}: every client must produce K-wide features")


def copy_of_model(model: SplitModel, with_weights: bool) -> SplitModel:
    """A model of the same structure with storage of its own: its weights copied, or left
    uninitialised (``with_weights=False``: every entry is about to be overwritten, so no copy).
    Shared parameters stay shared in the copy."""
    memo: dict[int, Any] = {}
    if not with_weights:
        for parameter in model.parameters():
            memo[id(parameter)] = torch.nn.Parameter(torch.empty_like(parameter),
                                                     requires_grad=parameter.requires_grad)
        for buffer in model.buffers():
            memo[id(buffer)] = torch.empty_like(buffer)
    return copy.deepcopy(model, memo)


_MODULE_TENSORS = ("_parameters", "_buffers", "_modules", "training")
"""The entries of a module's ``__dict__`` that :func:`same_structure` does not compare by value."""


def same_structure(model: torch.nn.Module, template: torch.nn.Module) -> bool:
    """Is ``model`` what a copy of ``template`` is, apart from its tensors' values and train/eval
    mode: the same module types and attributes (no hook, no attribute added or changed), the
    same parameters and buffers (names, shapes, dtypes, ``requires_grad``, which are tied)? Only
    such a model may stand in for a fresh copy of the template. One walk over the modules: the
    check runs for every client let go (0.1 ms for pfl's CNN)."""
    mine, theirs = list(model.modules()), list(template.modules())
    if len(mine) != len(theirs):
        return False
    my_ties: dict[int, int] = {}
    their_ties: dict[int, int] = {}
    for module, reference in zip(mine, theirs, strict=True):
        if type(module) is not type(reference) or module.__dict__.keys() != reference.__dict__.keys():
            return False
        for key, value in module.__dict__.items():
            if key in _MODULE_TENSORS:
                continue
            try:
                if not bool(value == reference.__dict__[key]):
                    return False
            except (RuntimeError, TypeError, ValueError):  # e.g. a tensor kept outside the state dict
                return False
        if not all(_same_tensors(module.__dict__[kind], reference.__dict__[kind], my_ties, their_ties)
                   for kind in ("_parameters", "_buffers")):
            return False
    return True


def _same_tensors(held: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None],
                  my_ties: dict[int, int], their_ties: dict[int, int]) -> bool:
    """One module's own parameters (or buffers) against the template's: names, shapes, dtypes,
    ``requires_grad``, and the same tie pattern (each tensor numbered at its first sighting)."""
    if held.keys() != expected.keys():
        return False
    for name, tensor in held.items():
        other = expected[name]
        if tensor is None or other is None:
            if tensor is not other:
                return False
            continue
        if (tensor.shape, tensor.dtype, tensor.requires_grad) != (other.shape, other.dtype, other.requires_grad):
            return False
        if my_ties.setdefault(id(tensor), len(my_ties)) != their_ties.setdefault(id(other), len(their_ties)):
            return False
    return True


class ClientFactory:
    """Builds this rank's clients on demand (the client store calls ``build``): data, initial
    model, optimizer, the algorithm's per-client state and, with privacy, the ledger."""

    def __init__(self, config: Config, partition: Any, device: torch.device, algorithm: ClientAlgorithm,
                 privacy_plan: Any) -> None:
        self.config = config
        self.partition = partition
        self.device = device
        self.algorithm = algorithm
        self.privacy_plan = privacy_plan
        self._splits: dict[int, tuple[torch.Tensor, ...]] = {}
        self._global_test: tuple[torch.Tensor, torch.Tensor] | None = None
        self._templates: dict[str, SplitModel | None] = {}
        self._spares: dict[str, SplitModel] = {}
        """Per architecture, one model of a client the store let go (``take_back``): the next shell
        of that architecture is this model, not a new copy of the template."""
        self._widths_checked: set[str] = set()

    def split(self, client_id: int) -> tuple[torch.Tensor, ...]:
        """The client's data on this rank's device, loaded once (data stays resident: its total is
        the dataset's size, however many clients share it); with ``data.few_shot`` its training
        split keeps k samples per class."""
        if client_id not in self._splits:
            self.load_splits([client_id])
        return self._splits[client_id]

    def forget_split(self, client_id: int) -> None:
        """Drop a split this rank held for a client it trained for another rank."""
        self._splits.pop(client_id, None)

    def load_splits(self, client_ids: list[int]) -> None:
        """Load the splits of ``client_ids`` not loaded yet, through one read of the cache (the
        store calls it for all of a rank's clients at start-up, before any is built)."""
        missing = [client_id for client_id in client_ids if client_id not in self._splits]
        for raw in load_client_splits(self.partition.path, missing, few_shot=self.config.data.few_shot):
            test = self.global_test() if self.config.eval.test_set == "global" else (raw.test_x, raw.test_y)
            self._splits[raw.client_id] = tuple(tensor.to(self.device) for tensor in (raw.train_x, raw.train_y, *test))

    def global_test(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``eval.test_set=global``: the N clients' test splits in client-id order, read once and
        shared by every client of this rank (one copy on the device, not one per client)."""
        if self._global_test is None:
            x, y = load_test_union(self.partition.path, range(self.config.num_clients))
            self._global_test = (x.to(self.device), y.to(self.device))
        return self._global_test

    def initial_model(self, client_id: int, shell: bool) -> SplitModel:
        """Client ``client_id``'s initial model. A ``shell`` (about to receive a parked state or a
        download that replaces every entry) is a copy of its architecture's template with
        uninitialised storage. With ``model.init=htfllib`` every client of a member starts from
        the same weights (seeded by ``seed`` alone), so they are drawn once per member and copied.
        Building a model costs far more than copying one: the pfl CNN took 14 ms a client built on
        the meta device and allocated, about 1 ms copied, and a round of 50 new clients pays it
        50 times. A model keeping tensors outside its state dict, or one that cannot be copied,
        is always built in full."""
        config = self.config
        member = architecture_for_client(config.model.group, client_id)
        if shell and member in self._spares:
            return self._spares.pop(member)
        if shell or config.model.init == "htfllib":
            template = self._template(member, client_id)
            if template is not None:
                return copy_of_model(template, with_weights=not shell)
        return self._built_model(client_id)

    def take_back(self, client: ClientState) -> None:
        """A client the store let go (it kept nothing): its model becomes the next shell of its
        architecture, unless one is spare already or the model is no longer what a copy of the
        template is (an algorithm changed it). Copying the template cost ~5 ms a pfl CNN client,
        most of it ``copy.deepcopy`` and the page faults of new storage: a quarter of a second in
        each round of 50 new clients, which a released client's model saves outright."""
        template = self._templates.get(client.architecture)
        if template is None or client.architecture in self._spares or not same_structure(client.model, template):
            return
        client.model.train(template.training)  # its gradients went after training (release_gradients)
        self._spares[client.architecture] = client.model

    def _built_model(self, client_id: int) -> SplitModel:
        """The client's model drawn from its seed, on this rank's device, ``model.pretrained``
        loaded over the fresh part."""
        config, info = self.config, self.partition
        model = initial_client_model(
            config.model.group, client_id, config.seed, num_classes=info.num_classes,
            feature_dim=config.model.feature_dim, inputs=info.inputs(), init=config.model.init,
            options=config.model.options,
        ).to(self.device)
        load_pretrained(model, config)
        return model

    def _template(self, member: str, client_id: int) -> SplitModel | None:
        """The model that ``member``'s shells (and, with ``model.init=htfllib``, its clients) are
        copied from: built once, from the first client that asks (with htfllib every client's
        initial weights; otherwise its weights are never read). None where copying cannot stand
        in for building: a parameter or buffer outside the state dict (a restored state would not
        reach it) or a model ``copy.deepcopy`` refuses."""
        if member not in self._templates:
            model = self._built_model(client_id)
            held = set(model.state_dict())
            template: SplitModel | None = model
            if not all(name in held for name, _ in (*model.named_parameters(), *model.named_buffers())):
                template = None
            else:
                try:
                    copy_of_model(model, with_weights=False)
                except (RuntimeError, TypeError):  # e.g. weight_norm's computed tensor attributes
                    template = None
            self._templates[member] = template
        return self._templates[member]

    def build(self, client_id: int, shell: bool = False) -> ClientState:
        """A client with its data and model (``shell``: weights to be overwritten, see ClientStore).
        The feature width is checked on the first client of each architecture (it is a property
        of the architecture and the input shape)."""
        config = self.config
        train_x, train_y, test_x, test_y = self.split(client_id)
        architecture = architecture_for_client(config.model.group, client_id)
        model = self.initial_model(client_id, shell)
        if architecture not in self._widths_checked:  # shapes only: a shell's weights do not matter
            check_feature_width(model, architecture, client_id, train_x[:2], config.model.feature_dim)
            self._widths_checked.add(architecture)
        optimizer = build_optimizer(model.parameters(), config.train)
        client = ClientState(
            client_id=client_id, architecture=architecture, model=model, optimizer=optimizer,
            train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y, device=self.device,
        )
        seed_global_torch(config.seed, "algorithm-init", client_id)
        self.algorithm.init_client(client)
        if self.privacy_plan is not None:
            attach_ledger(client, self.privacy_plan)
        return client


def client_store(config: Config, factory: ClientFactory, client_ids: list[int], device: torch.device,
                 rank: int) -> ClientStore:
    """This rank's clients: all resident once built, or (``runtime.resident_clients``) an LRU of
    them. Their data is read now, in one pass over the cache; clients are built when first needed,
    except one of each architecture, built now so that a model that does not fit the data fails at
    start-up rather than in the round that first needs it."""
    runtime = config.runtime
    scratch = Path(runtime.client_scratch_dir) if runtime.client_scratch_dir else None
    factory.load_splits(client_ids)
    store = ClientStore(client_ids, factory.build, resident=runtime.resident_clients, device=device, rank=rank,
                        scratch_dir=scratch, replaced_by_download=factory.algorithm.replaced_by_download,
                        recycle=factory.take_back,
                        architecture_of=lambda client_id: architecture_for_client(config.model.group, client_id))
    first_of_architecture: dict[str, int] = {}
    for client_id in client_ids:
        first_of_architecture.setdefault(architecture_for_client(config.model.group, client_id), client_id)
    for client_id in sorted(first_of_architecture.values()):
        store.peek(client_id)
    return store
