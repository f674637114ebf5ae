"""One start for every driver (docs/architecture.md): ``python -m htfl_dist.main`` under every
launcher, ``--check``, ``simulate``, a study's cells and the conformance kit all resolve a config
and check it through :func:`checked_config`, and every rank builds its parts through
:class:`Session`. So a plugin that passes the kit starts in the program, and a check added to
:data:`START_CHECKS` holds for every driver at once.

Two stages, because they run in different places:

1. :func:`checked_config` (every rank, and ``--check`` before any rank exists): the config
   resolved with its plugins, then every check the config alone can fail, in the one ordered list
   :data:`START_CHECKS`, before any data loads or any rank talks;
2. :class:`Session` (each rank, with its transport): the data, the ranks' agreement on the maths
   (the handshake checks that every rank runs the same config and install), the placement, the
   algorithm's halves and this rank's clients. The round loop (``runtime.loop.Federation``) plays
   rounds on a session; it builds nothing itself.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from htfl_dist.algorithms import AlgorithmContext, ServerAlgorithm, get_algorithm, parse_options
from htfl_dist.config import Config
from htfl_dist.errors import ConfigError
from htfl_dist.generators import generator_latent_dim
from htfl_dist.metrics.writer import progress
from htfl_dist.privacy.accounting import PrivacyPlan
from htfl_dist.privacy.noise import require_cryptography
from htfl_dist.privacy.startup import SEEDED_NOISE_WARNING, check_private_run, privacy_plan
from htfl_dist.runtime.exchange import Exchange
from htfl_dist.runtime.lending import Lending
from htfl_dist.runtime.liveness import Liveness, describe_plain
from htfl_dist.runtime.preemption import preemption_flag
from htfl_dist.runtime.presum import PresummedUploads
from htfl_dist.runtime.startup import (
    ClientFactory,
    build_server,
    check_client_batching,
    check_inputs,
    client_store,
    handshake,
    place_clients,
    prepare_data,
    step_graphs,
)
from htfl_dist.runtime.supervisor import tell_supervisor
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.watchdog import CLIENT_DELAY_S, STARTUP, RoundWatchdog

if TYPE_CHECKING:  # its module needs the privacy extra ('cryptography'), imported where a run asks for it
    from htfl_dist.runtime.secure_exchange import SecureSums


@dataclass
class RunContext:
    """What a driver hands the start: the config, this rank's transport and device, the run
    directory, and what to resume from."""

    config: Config
    transport: Transport
    device: torch.device
    out_dir: Path
    resume_from: Path | None = None
    """A run directory or checkpoint directory to continue from (None: start fresh)."""
    extra_summary: dict[str, Any] = field(default_factory=dict)
    rank_description: str = ""
    """'rank r (clients [...])' once the session has placed the clients; error lines use it."""
    liveness: Liveness | None = None
    """Heartbeats through the rendezvous store (Gloo/NCCL with several ranks)."""
    describe_rank: Callable[[int], str] = describe_plain
    """Any rank's 'rank r (clients [...])', once placed: failure lines name peers with it."""


# ---------------------------------------------------------------------------- stage 1: the config


def _model_group_known(config: Config, world_size: int | None) -> None:
    from htfl_dist.models import architecture_for_client

    architecture_for_client(config.model.group, 0)


def _outputs_available(config: Config, world_size: int | None) -> None:
    from htfl_dist.metrics.sinks import check_outputs_available

    check_outputs_available(config)


def _participation_readable(config: Config, world_size: int | None) -> None:
    """``participation.trace`` read and checked, and ``late=next_round`` with a server that takes them."""
    from htfl_dist.runtime.asynchronous import check_asynchronous
    from htfl_dist.runtime.participation import check_late_uploads, client_devices

    client_devices(config)
    check_late_uploads(config)
    check_asynchronous(config)


def _pretrained_files_present(config: Config, world_size: int | None) -> None:
    from htfl_dist.models.pretrained import files_in_use

    files_in_use(config)


def _privacy_possible(config: Config, world_size: int | None) -> None:
    """What cannot be private, before the data loads; with a world size (``--check``, a study's
    validation), also the plan every rank computes first at start-up: a budget no noise reaches."""
    from htfl_dist.privacy.startup import check_private_config

    check_private_config(config)
    if world_size is not None:
        privacy_plan(config)


def _summing_possible(config: Config, world_size: int | None) -> None:
    """``privacy.secure_aggregation`` and ``runtime.presum_uploads``: a sums-only server, and what
    each cannot run with."""
    from htfl_dist.runtime.presum import check_presum

    if config.privacy.secure_aggregation:
        # imported only here and in summing(): the protocol's module needs the privacy extra
        require_cryptography("privacy.secure_aggregation agrees keys, seals shares and draws masks",
                             "X25519, ChaCha20-Poly1305")
        from htfl_dist.runtime.secure_exchange import check_secure_aggregation

        check_secure_aggregation(config)
    check_presum(config)


def _world_size_fits(config: Config, world_size: int | None) -> None:
    from htfl_dist.runtime.placement import check_world_size

    if world_size is not None:
        check_world_size(world_size, config.num_clients, config.runtime.server_hosts_clients)


def _backend_usable(config: Config, world_size: int | None) -> None:
    """``runtime.backend=nccl`` on more than one rank needs a GPU per rank, which a launch would
    find only after torchrun had started every rank (a single rank talks to nobody)."""
    if config.runtime.backend != "nccl" or world_size is None or world_size < 2:
        return
    gpus = 0 if config.runtime.device == "cpu" else torch.cuda.device_count()
    if gpus == 0:
        where = "runtime.device=cpu" if config.runtime.device == "cpu" else "this machine has no GPU"
        raise ConfigError(f"runtime.backend=nccl needs one GPU per rank, but {where}; use runtime.backend=gloo "
                          f"(or auto)")


def summing(config: Config, transport: Transport, entry: Any, context: Any, describe_rank: Callable[[int], str],
            plan: PrivacyPlan | None = None) -> SecureSums | PresummedUploads | None:
    """How the round's uploads reach rank 0 as a sum (None: each upload travels); ``plan``: the
    privacy plan, whose distributed noise split the secure sums complete (privacy/distributed.py)."""
    if config.privacy.secure_aggregation:
        from htfl_dist.runtime.secure_exchange import SecureSums, guaranteed_contributors

        return SecureSums(transport, entry, context, config.privacy, describe_rank,
                          contributors=guaranteed_contributors(config),
                          filler_std=0.0 if plan is None else plan.filler_std())
    if config.runtime.presum_uploads:
        return PresummedUploads(transport, entry, context, describe_rank)
    return None


START_CHECKS: tuple[Callable[[Config, int | None], None], ...] = (
    _model_group_known,
    _outputs_available,
    _participation_readable,
    _pretrained_files_present,
    _privacy_possible,
    _summing_possible,
    _world_size_fits,
    _backend_usable,
)
"""Every check of a start that needs the config alone, in the order they run. Each raises one
line (a ``ConfigError`` or ``HtflError``) naming the key; ``world_size`` is None where the ranks
are not known yet (a rank's own start knows its launch; ``--check`` and studies pass theirs)."""


def check_start(config: Config, world_size: int | None = None) -> None:
    """Run :data:`START_CHECKS` on ``config``: on every rank identically, before any communication
    (so a mistake is one line from all of them at once, rank 0's printed), before any data loads."""
    for check in START_CHECKS:
        check(config, world_size)


def checked_config(config_file: str | None, overrides: Sequence[str], imports: Sequence[str] = (),
                   world_size: int | None = None) -> Config:
    """The config as every driver starts it: resolved with its plugins (``--import``, the config's
    ``plugins:``, entry points) and its defaults, then checked (:func:`check_start`)."""
    from htfl_dist.resolution import resolved_config

    config = resolved_config(config_file, list(overrides), list(imports))
    check_start(config, world_size)
    return config


# ---------------------------------------------------------------------------- stage 2: the parts


class Session:
    """One rank's started run: everything the rounds read, built once, in order. Rank 0 also
    holds the server half (``server`` is None elsewhere)."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.config = config = run.config
        self.transport = transport = run.transport
        self.device = run.device
        self.rank, self.world_size = transport.rank, transport.world_size
        self.is_server = self.rank == 0
        self.watchdog = RoundWatchdog(config.runtime.round_deadline_s, f"rank {self.rank}", transport.abort,
                                      waiting_for=self._blocked_on, delay_s=0.0 if self.is_server else CLIENT_DELAY_S)
        self.watchdog.arm(STARTUP)  # a rank stuck in data preparation or the handshake must not hang MPI
        try:
            self._set_up()
        except BaseException:
            self.watchdog.stop()  # in-process (a test, a notebook) an armed watchdog ends the interpreter later
            raise

    def _set_up(self) -> None:
        """Everything a rank builds before its first round, in order, under the start-up deadline."""
        run, config, transport = self.run, self.config, self.transport
        started = time.perf_counter()
        self.entry = get_algorithm(config.algorithm)
        options = parse_options(self.entry, config.algo)  # checked when the config was resolved
        self.privacy_plan = privacy_plan(config, run.out_dir)  # None without privacy
        if self.is_server and self.privacy_plan is not None and self.privacy_plan.noise == "seeded":
            progress(SEEDED_NOISE_WARNING)
        self.partition = prepare_data(config, transport)
        check_inputs(config, self.partition.inputs(), self.entry.uses_generator)
        handshake(config, self.partition.num_classes, transport)  # ranks agree on the maths before anything else
        self._place()
        self.context = self._algorithm_context(options)
        self.entry.client.check_models(self.context)
        check_client_batching(self.entry, self.context)
        self.client_algorithm = self.entry.client(self.context)
        self.server = build_server(self.entry, self.context, config, run.extra_summary) if self.is_server else None
        self.download_spec = self.entry.server.download_fields(self.context)
        self.upload_spec = self.entry.client.upload_fields(self.context)
        check_private_run(config, self.entry, options, [item.name for item in self.upload_spec])
        self.exchange = Exchange(transport, self.placement, self.device, config.on_bad_upload,
                                 epsilon_budget=config.privacy.target_epsilon if config.privacy.enabled else None)
        self.client_ids = self.placement.clients_of(self.rank)
        self.factory = ClientFactory(config, self.partition, self.device, self.client_algorithm, self.privacy_plan)
        self.clients = client_store(config, self.factory, self.client_ids, self.device, self.rank)
        self.lending = Lending(transport, self.clients, self.placement.describe_rank, self.factory.forget_split)
        self.summing = summing(config, transport, self.entry, self.context, self.placement.describe_rank,
                               self.privacy_plan)
        self.preemption = preemption_flag(config.runtime.preempt_grace_s)
        self._watch_peers()
        self.watchdog.disarm()
        if self.is_server:
            progress(f"start-up: every rank has its data and models ({time.perf_counter() - started:.1f}s)")

    def _place(self) -> None:
        """Which rank hosts which client; from here on every line names this rank by its clients."""
        run = self.run
        self.placement = place_clients(self.config, self.partition, self.transport, self.device)
        run.rank_description = self.placement.describe_rank(self.rank)
        tell_supervisor(run.rank_description)  # under mpirun: its line names the clients if this process is killed
        run.describe_rank = self.placement.describe_rank
        self.watchdog.name_as(run.rank_description)
        if self.is_server:
            progress(self.placement.describe())

    def _watch_peers(self) -> None:
        """Heartbeats: a silent peer ends the job naming it; a SIGTERM may be the launcher tearing
        down a failed job rather than a preemption."""
        run = self.run
        if run.liveness is None:
            return
        liveness = run.liveness
        liveness.watch(self.placement.describe_rank, on_silent=liveness.end_job)
        self.preemption.job_failed = lambda: liveness.report_lost_peers(run.rank_description,
                                                                        "SIGTERM from the launcher")

    def _algorithm_context(self, options: Any) -> AlgorithmContext:
        config, info = self.config, self.partition
        latent_dim = generator_latent_dim(config.generator) if self.entry.uses_generator else 0
        return AlgorithmContext(
            num_classes=info.num_classes, feature_dim=config.model.feature_dim,
            seed=config.seed, train=config.train, options=options, device=self.device,
            num_clients=config.num_clients, model_group=config.model.group, model_init=config.model.init,
            in_channels=info.in_channels, image_size=info.image_size,
            latent_dim=latent_dim, input_spec=info.inputs(), model_options=config.model.options,
            step_graphs=step_graphs(config, self.entry, self.device)[0],
        )

    @property
    def rank0_server(self) -> ServerAlgorithm:
        """The server half, held by rank 0 alone."""
        assert self.server is not None, "rank 0 only"
        return self.server

    def _blocked_on(self) -> str:
        """The rank this one is blocked on in a transfer right now, named ('' outside one)."""
        peer = self.transport.waiting_for
        return "" if peer is None else self.run.describe_rank(peer)
