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

import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from htfl_dist.algorithms import (
    AlgorithmContext,
    ClientState,
    ServerAlgorithm,
    TrainResult,
    get_algorithm,
    parse_options,
)
from htfl_dist.algorithms.interface import release_gradients, seed_training
from htfl_dist.algorithms.optimizers import begin_local_training
from htfl_dist.config import Config
from htfl_dist.errors import HtflError, TrainingDiverged
from htfl_dist.generators import generator_latent_dim
from htfl_dist.metrics.generated import GeneratedImageGrids
from htfl_dist.metrics.prototypes import PrototypeSnapshots, check_prototype_payloads
from htfl_dist.metrics.report import PER_CLIENT_FILE
from htfl_dist.metrics.writer import TrainingProgress, progress
from htfl_dist.models import architecture_for_client
from htfl_dist.payload import Payload
from htfl_dist.privacy.startup import (
    SEEDED_NOISE_WARNING,
    begin_round,
    check_private_run,
    client_epsilon,
    privacy_plan,
)
from htfl_dist.runtime import checkpoint
from htfl_dist.runtime.evaluation import UnseenClients, test_client
from htfl_dist.runtime.exchange import (
    DIVERGING,
    FINISHED,
    GIVE_UP,
    STOP,
    ClientReport,
    Exchange,
    RankReport,
    RoundReports,
    RoundTraffic,
    StopDecision,
)
from htfl_dist.runtime.lending import Lending
from htfl_dist.runtime.liveness import Liveness, describe_plain, tell_supervisor
from htfl_dist.runtime.participation import payload_bytes, rank0_participation
from htfl_dist.runtime.placement import evaluated_clients, round_trainers, sample_participants
from htfl_dist.runtime.preemption import preemption_flag
from htfl_dist.runtime.records import RoundOutcome, RoundRecords, early_stop_due
from htfl_dist.runtime.screening import LeftOut, screen_uploads
from htfl_dist.runtime.startup import (
    ClientFactory,
    build_server,
    check_client_batching,
    check_inputs,
    client_store,
    handshake,
    place_clients,
    prepare_data,
)
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.watchdog import CLIENT_DELAY_S, STARTUP, RoundWatchdog
from htfl_dist.seeding import torch_generator


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


def _diverged(config: Config, completed: int, out_dir: Path) -> TrainingDiverged:
    first = completed - config.train.max_diverged_rounds + 1
    kept = checkpoint.find_checkpoint(out_dir)
    return TrainingDiverged(
        f"training diverged: every participating client's loss was not finite in rounds {first}-{completed} "
        f"(train.max_diverged_rounds={config.train.max_diverged_rounds}); lower train.lr (now {config.train.lr:g}) "
        f"and start a new --out; " + (f"the last good checkpoint is {kept}" if kept else "no checkpoint was kept"))


class Federation:
    """Server and/or client role of this rank: start-up in the constructor (``runtime.startup``),
    then ``run()`` plays the rounds, calling the exchange for every message
    (``runtime.exchange``) and, on rank 0, the records for every row (``runtime.records``)."""

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
        options = parse_options(self.entry, config.algo)  # checked when the config was resolved
        # None without privacy; before the data: a budget no σ reaches; releases logged under the run directory
        self.privacy_plan = privacy_plan(config, run.out_dir)
        if self.is_server and self.privacy_plan is not None and self.privacy_plan.noise == "seeded":
            progress(SEEDED_NOISE_WARNING)
        self.partition = prepare_data(config, transport)
        check_inputs(config, self.partition.inputs(), self.entry.uses_generator)
        handshake(config, self.partition.num_classes, transport)  # ranks agree on the maths before anything else
        self.placement = place_clients(config, self.partition, transport, self.device)
        run.rank_description = self.placement.describe_rank(self.rank)
        tell_supervisor(run.rank_description)  # under mpirun: its line names the clients if this process is killed
        run.describe_rank = self.placement.describe_rank
        self.watchdog.name_as(run.rank_description)
        if self.is_server:
            progress(self.placement.describe())
        self.context = self._algorithm_context(options)
        self.entry.client.check_models(self.context)
        check_client_batching(self.entry, self.context)
        self.client_algorithm = self.entry.client(self.context)
        self.server = build_server(self.entry, self.context, config, run.extra_summary) if self.is_server else None
        self.download_spec = self.entry.server.download_fields(self.context)
        self.upload_spec = self.entry.client.upload_fields(self.context)
        check_private_run(config, self.entry, options, [item.name for item in self.upload_spec])
        if config.output.prototypes_every:  # every rank: a mistake stops them all before they talk
            check_prototype_payloads(config.algorithm, self.upload_spec, self.download_spec)
        self.snapshots = PrototypeSnapshots(run.out_dir, config.output.prototypes_every)
        self.image_grids = GeneratedImageGrids(run.out_dir, self.download_spec)
        self.exchange = Exchange(transport, self.placement, self.device, config.on_bad_upload,
                                 epsilon_budget=config.privacy.target_epsilon if config.privacy.enabled else None)
        self.my_client_ids = self.placement.clients_of(self.rank)
        factory = ClientFactory(config, self.partition, self.device, self.client_algorithm, self.privacy_plan)
        self.clients = client_store(config, factory, self.my_client_ids, self.device, self.rank)
        self.lending = Lending(transport, self.clients, self.placement.describe_rank, factory.forget_split)
        self.unseen = self._unseen_clients()
        if run.liveness is not None:
            run.liveness.watch(self.placement.describe_rank, on_silent=run.liveness.end_job)
        self.watchdog.disarm()
        if self.is_server:
            progress(f"start-up: every rank has its data and models ({time.perf_counter() - started:.1f}s)")
        self.records = RoundRecords(config, run.out_dir, self.world_size) if self.is_server else None
        self.participation = rank0_participation(config, self.partition) if self.is_server else None
        self.preemption = preemption_flag(config.runtime.preempt_grace_s)
        if run.liveness is not None:  # a SIGTERM may be the launcher tearing down a failed job
            self.preemption.job_failed = lambda: run.liveness.report_lost_peers(run.rank_description,
                                                                                 "SIGTERM from the launcher")
        self.preempted_after: int | None = None
        self.stop_decision = StopDecision(config.train.max_diverged_rounds)  # rank 0's, at each round's end
        where = "" if self.world_size == 1 else f"rank {self.rank}"
        self.training_progress = TrainingProgress(config.output.progress_every_s, where)

    def _unseen_clients(self) -> UnseenClients | None:
        """This rank's share of ``eval.new_clients`` (None when it hosts none)."""
        hosted = self.placement.unseen_of(self.rank)
        return UnseenClients(self.config, self.context, self.entry.client, self.partition, hosted) if hosted else None

    def _algorithm_context(self, options: Any) -> AlgorithmContext:
        config, info = self.config, self.partition
        latent_dim = generator_latent_dim(config.generator) if self.entry.uses_generator else 0
        return AlgorithmContext(
            num_classes=info.num_classes, feature_dim=config.model.feature_dim,
            seed=config.seed, train=config.train, options=options, device=self.device,
            num_clients=config.num_clients, model_group=config.model.group, model_init=config.model.init,
            in_channels=info.in_channels, image_size=info.image_size,
            latent_dim=latent_dim, input_spec=info.inputs(),
        )

    @property
    def _rank0_server(self) -> ServerAlgorithm:
        """The server half, held by rank 0 alone (``server`` is None on the other ranks)."""
        assert self.server is not None, "rank 0 only"
        return self.server

    @property
    def _rank0_records(self) -> RoundRecords:
        """The metrics records, kept by rank 0 alone (``records`` is None on the other ranks)."""
        assert self.records is not None, "rank 0 only"
        return self.records

    def _blocked_on(self) -> str:
        """The rank this one is blocked on in a transfer right now, named ('' outside one)."""
        peer = self.transport.waiting_for
        return "" if peer is None else self.run_context.describe_rank(peer)

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any] | None:
        start_round = self.restore()
        if self.is_server:
            self._rank0_records.begin(start_round + 1)
        try:
            return self._run_rounds(start_round)
        finally:
            if self.is_server:
                self._rank0_records.close()
            self.clients.close()

    def _run_rounds(self, start_round: int) -> dict[str, Any] | None:
        if start_round == 0:
            setup_traffic = RoundTraffic()
            self.play_setup(setup_traffic)
            if self.is_server:
                self._rank0_records.count_setup_upload(setup_traffic)
        knowledge: Payload | None = None  # what the clients of this rank last received
        round_seconds: list[float] = []
        for round_index in range(start_round, self.config.rounds):
            self.watchdog.arm(round_index + 1)
            began = time.perf_counter()
            outcome, knowledge = self._play_round(round_index, knowledge)
            round_seconds.append(time.perf_counter() - began)
            if self.is_server:
                self._rank0_records.record(outcome, round_seconds)
            decision = self._close_round(outcome)
            self.watchdog.disarm()
            if decision & STOP:
                self.preempted_after = round_index + 1
                return None
            if decision & FINISHED:
                break
        if not self.is_server:
            return None
        facts = {"world_size": self.world_size, "transport": self.transport.name, "device": str(self.device)}
        return self._rank0_records.finish(round_seconds, facts, self.run_context.extra_summary, self.privacy_plan)

    def play_setup(self, traffic: RoundTraffic) -> None:
        """Before the first round of a fresh run, every client sends the algorithm's setup payload
        (FedGen's label counts) and the server consumes them; a resumed run has it in the server's
        checkpoint. Invalid setup uploads are screened like round uploads."""
        spec = self.entry.client.setup_upload_fields(self.context)
        if not spec:
            return
        entries = {cid: self.client_algorithm.setup_upload(self.clients.peek(cid)) for cid in self.clients}
        validate = self._rank0_server.validate_setup_upload if self.is_server else None
        kept = self.exchange.gather_setup(spec, entries, validate, traffic)
        if kept is not None:
            self._rank0_server.setup(kept)

    def knowledge(self) -> Payload:
        """What the clients would receive now (the server's download, through the transport)."""
        return self._broadcast_knowledge(RoundTraffic())

    def _broadcast_knowledge(self, traffic: RoundTraffic) -> Payload:
        download = self._rank0_server.download() if self.is_server and self.download_spec else None
        return self.exchange.broadcast_knowledge(self.download_spec, download, traffic)

    def _play_round(self, round_index: int, knowledge: Payload | None) -> tuple[RoundOutcome, Payload | None]:
        """One round, as its phases: knowledge down, local training, uploads up, the server step,
        evaluation (on evaluation rounds), reports up. Returns what it produced and the knowledge
        the clients now hold (None: the next round must broadcast it)."""
        config = self.config
        outcome = RoundOutcome(
            round_index, sample_participants(config.seed, round_index, config.num_clients, config.join_ratio,
                                             config.participation.random_join),
            evaluated=(round_index + 1) % config.eval_every == 0 or round_index + 1 == config.rounds)
        if knowledge is None:
            knowledge = self._broadcast_knowledge(outcome.traffic)
        if self.participation is not None and config.participation.clock:  # what the simulated link carries down
            outcome.download_bytes = payload_bytes(knowledge)
        if self.is_server:
            outcome.traffic.theory_down = self._rank0_server.theory_download_floats() * 4 * len(outcome.participants)
        began = time.perf_counter()
        trainers = self._trainers(outcome.participants)
        uploads, train_rows, theory_up = self._train_participants(trainers, knowledge, round_index)
        outcome.client_seconds = time.perf_counter() - began
        left_out = LeftOut(round_index + 1)  # rank 0: who this round leaves out and why, said in one line
        gathered, outcome.skipped = self.exchange.gather_uploads(self.upload_spec, uploads, outcome.participants,
                                                                 round_index + 1, outcome.traffic, left_out, trainers)
        if self.is_server:
            assert gathered is not None, "rank 0 gathers the uploads"
            self._server_step(outcome, gathered, left_out)
        knowledge, eval_rows = self._evaluation(outcome)
        outcome.reports = self._gather_reports(outcome, train_rows, eval_rows, theory_up, trainers)
        return outcome, knowledge

    def _trainers(self, participants: list[int]) -> dict[int, int]:
        """The rank that trains each participant this round (``runtime.rebalance``)."""
        if self.config.runtime.rebalance == "off":
            return {client_id: self.placement.rank_of(client_id) for client_id in participants}
        return round_trainers(participants, self.placement)

    def _train_participants(self, trainers: dict[int, int], knowledge: Payload, round_index: int
                            ) -> tuple[dict[int, Payload], dict[int, list[float]], int]:
        """Train the participants ``trainers`` gives this rank: its own, and those lent to it for
        the round (given back before this returns)."""
        uploads, train_rows, theory = {}, {}, 0
        moves = [(client_id, self.placement.rank_of(client_id), rank) for client_id, rank in sorted(trainers.items())
                 if rank != self.placement.rank_of(client_id)]
        if self.is_server and moves:  # summary.json: how much rebalancing did
            summary = self.run_context.extra_summary
            summary["clients_trained_away_from_home"] = summary.get("clients_trained_away_from_home", 0) + len(moves)
        borrowed = self.lending.lend(moves)
        mine = [client_id for client_id in sorted(trainers) if trainers[client_id] == self.rank]
        self.training_progress.start(round_index + 1, len(mine))
        for group in self._training_groups(mine):
            clients = [borrowed[client_id] if client_id in borrowed else self.clients[client_id] for client_id in group]
            for client, result in zip(clients, self._train_group(clients, knowledge, round_index), strict=True):
                release_gradients(client)
                uploads[client.client_id] = result.upload
                if self.privacy_plan is None:  # a private client's loss and count stay on the client
                    train_rows[client.client_id] = [result.loss_sum, float(result.samples)]
                theory += self.client_algorithm.theory_upload_floats(client) * 4
                self.training_progress.client_done()
        self.lending.give_back(moves, borrowed)
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
        begin_local_training(clients, self.config.train, round_index, self.config.rounds)  # the round's client lr
        if self.config.train.client_batching == "vmap":
            return self.client_algorithm.train_group(clients, knowledge, round_index, generators)
        (client,), (generator,) = clients, generators
        seed_training(seed, client.client_id, round_index)
        return [self.client_algorithm.train(client, knowledge, round_index, generator)]

    def evaluate_clients(self, knowledge: Payload, tested: Collection[int] | None = None) -> dict[int, list[float]]:
        """Every client of this rank (or those of them in ``tested``) on its test split, in eval
        mode, with ``knowledge``: ``evaluation.test_client``'s row per client."""
        rows = {}
        installs = self.entry.evaluation_installs_knowledge
        for client_id in self.clients:
            if tested is not None and client_id not in tested:
                continue
            # evaluation only reads a client unless the algorithm installs knowledge first
            client = self.clients[client_id] if installs else self.clients.peek(client_id)
            rows[client_id] = test_client(self.client_algorithm, client, knowledge, self.context.num_classes)
        return rows

    def _server_step(self, outcome: RoundOutcome, gathered: dict[int, Payload], left_out: LeftOut) -> None:
        """Rank 0: screen the uploads, say in one line who the round left out (``left_out`` holds
        the clients whose rank's message was refused already), update the global knowledge (kept
        as it was when every upload was screened out), keep the snapshots and pictures that are due."""
        round_number = outcome.round_index + 1
        gathered, too_few = self._arrivals(outcome, gathered)
        gathered, skipped = screen_uploads(gathered, self._rank0_server.validate_upload, self.config.on_bad_upload,
                                           round_number, left_out)
        outcome.skipped.extend(skipped)
        left_out.say()
        began = time.perf_counter()
        if (gathered or not self.upload_spec) and not too_few:
            generator = torch_generator(self.config.seed, "server", outcome.round_index)
            outcome.diagnostics = self._rank0_server.update(gathered, outcome.round_index, generator)
        else:
            outcome.diagnostics = {"server_skipped": True}
        outcome.server_seconds = time.perf_counter() - began
        if self.snapshots.due(round_number):
            self.snapshots.save(round_number, gathered, self._rank0_server.download())
        if outcome.evaluated and self.image_grids.enabled:  # download() may compress (FedKD): only then
            self.image_grids.save(round_number, self._rank0_server.download())

    def _arrivals(self, outcome: RoundOutcome, gathered: dict[int, Payload]) -> tuple[dict[int, Payload], bool]:
        """Rank 0: the uploads that reach the server (``participation.*``: not the dropped, not the
        late), and whether too few did for a server step (said in one line)."""
        if self.participation is None:
            return gathered, False
        arrivals = self.participation.decide(outcome.round_index, outcome.participants, gathered,
                                             outcome.download_bytes)
        outcome.participation = arrivals.row(self.config.participation.clock, self.participation.clock_s)
        if arrivals.too_few:
            print(f"htfl_dist: warning: round {outcome.round_index + 1}: {len(arrivals.times.arrived)} of "
                  f"{len(outcome.participants)} uploads arrived, fewer than participation.min_clients="
                  f"{self.config.participation.min_clients}; the server keeps last round's knowledge",
                  file=sys.stderr, flush=True)
        return arrivals.kept, arrivals.too_few

    def _evaluation(self, outcome: RoundOutcome) -> tuple[Payload | None, dict[int, list[float]]]:
        """On evaluation rounds: the new knowledge goes down and every client of this rank is
        evaluated on its test split (its time counts as client time). Returns the knowledge the
        clients now hold (None on other rounds: the next round sends it) and the counts."""
        if not outcome.evaluated:
            return None, {}
        config = self.config
        outcome.tested = evaluated_clients(config.seed, outcome.round_index, config.num_clients,
                                           config.eval.clients_fraction, outcome.round_index + 1 == config.rounds)
        if config.eval.clients_fraction < 1:
            outcome.participation["tested_clients"] = len(outcome.tested)
        knowledge = self._broadcast_knowledge(outcome.traffic)
        began = time.perf_counter()
        eval_rows = self.evaluate_clients(knowledge, set(outcome.tested))
        if self.unseen is not None:
            eval_rows.update(self.unseen.evaluate(knowledge, outcome.round_index))
        outcome.client_seconds += time.perf_counter() - began
        return knowledge, eval_rows

    def _gather_reports(self, outcome: RoundOutcome, train_rows: dict[int, list[float]],
                        eval_rows: dict[int, list[float]], theory_up: int, trainers: dict[int, int]
                        ) -> RoundReports | None:
        """This rank's report rows (training, evaluation, ε spent) and its own row to rank 0."""
        clients = {client_id: ClientReport(train_rows.get(client_id), eval_rows.get(client_id),
                                           self._epsilon_row(client_id))
                   for client_id in set(train_rows) | set(eval_rows)}
        mine = RankReport(outcome.client_seconds, float(theory_up), float(self.preemption.requested))
        unseen = range(self.config.num_clients, self.config.num_clients + self.config.eval.new_clients)
        tested = set(outcome.tested) | (set(unseen) if outcome.evaluated else set())
        return self.exchange.gather_reports(clients, mine, outcome.participants, tested, trainers)

    def _epsilon_row(self, client_id: int) -> list[float] | None:
        """privacy.enabled: [ε the client has spent so far] for the report; None otherwise, and for
        an unseen client (it releases nothing)."""
        if self.privacy_plan is None or client_id >= self.config.num_clients or client_id not in self.clients:
            return None  # a client trained here for another rank: its home reports its ledger
        epsilon = client_epsilon(self.clients.peek(client_id))
        assert epsilon is not None, "a private run gives every client a ledger"
        return [epsilon]

    def _close_round(self, outcome: RoundOutcome) -> int:
        """Every rank: agree whether to stop (a SIGTERM anywhere, or ``stop.patience`` reached) and
        checkpoint when preempted or when one is due, inside the round's deadline (a stuck save
        must not hang MPI). Returns the decision's bits."""
        verdict = None
        if self.is_server:
            assert outcome.reports is not None, "rank 0 gathers the reports"
            verdict = self.stop_decision.decide(outcome.reports, converged=self._converged(outcome))
        decision = self.exchange.agree(verdict)
        completed = outcome.round_index + 1
        if decision & GIVE_UP:
            raise _diverged(self.config, completed, self.run_context.out_dir)
        every = self.config.checkpoint_every
        if decision & STOP or (every and completed % every == 0 and not decision & DIVERGING):
            self._save_checkpoint(completed)
        return decision

    def _converged(self, outcome: RoundOutcome) -> bool:
        """Rank 0, on an evaluated round: whether ``stop.patience`` ends the run here (said, and
        recorded in summary.json)."""
        stop = self.config.stop
        if not stop.patience or not outcome.evaluated:
            return False
        due = early_stop_due(self._rank0_records.metrics.rows, stop.metric, stop.patience, stop.min_delta)
        if due is None:
            return False
        self.run_context.extra_summary["stopped_early"] = due
        progress(f"early stop after round {due['after_round']}: {stop.metric} has not improved on "
                 f"{due['best']:.4f} (round {due['best_round']}) for {stop.patience} evaluated rounds "
                 f"(stop.patience)")
        return True

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, completed_rounds: int) -> None:
        metrics = self.records.metrics if self.records else None
        checkpoint.save(self.run_context.out_dir, completed_rounds, self.config, self.transport,
                        clients=self.clients, server=self.server,
                        metric_rounds=[row["round"] for row in metrics.rows] if metrics else None,
                        data_identity=self.partition.identity,
                        runtime_state=self.participation.state_dict() if self.participation else None)

    def restore(self) -> int:
        """Load the newest complete checkpoint of ``resume_from`` (clients, server, metrics so far)
        and return the rounds it completed; 0 when there is nothing to resume. ``run`` calls it
        first; inspection tools (bench/diagnose_prototypes.py) call it instead of ``run``."""
        source = self.run_context.resume_from
        directory = checkpoint.find_checkpoint(source) if source is not None else None
        metrics = self.records.metrics if self.records else None
        if directory is None:  # a fresh run, or --resume auto before any checkpoint: start over
            if metrics is not None:
                if source is not None:
                    progress(f"resume: no complete checkpoint in {source}; starting from round 1")
                metrics.load_existing(0)  # rows of a run that died before its first checkpoint
                self._rank0_records.per_client.load_existing(0)
            return 0
        completed, changed = checkpoint.load(directory, self.config, clients=self.clients, server=self.server,
                                             device=self.device, data_identity=self.partition.identity,
                                             restore_runtime=self.participation.load_state_dict
                                             if self.participation else None)
        if changed:  # data.allow_changed: on purpose, and said
            self.run_context.extra_summary["data_changed_on_resume"] = {"after_round": completed, "data": changed}
            if self.is_server:
                progress(f"htfl_dist: warning: resume: the clients trained on other data until round {completed} "
                         f"({changed}); going on with these (data.allow_changed=true)")
        if completed > self.config.rounds:
            raise HtflError(f"checkpoint {directory} is after round {completed} but rounds={self.config.rounds}; "
                            f"pass rounds={completed} or more to continue it")
        if metrics is not None:
            metrics.load_existing(completed, source=directory.parent.parent / "metrics.jsonl",
                                  required_rounds=checkpoint.metric_rounds(directory, self.config.eval_every))
            self._rank0_records.per_client.load_existing(completed, source=directory.parent.parent / PER_CLIENT_FILE)
            progress(f"resume: continuing after round {completed} from {directory}")
        return completed
