"""The one round loop (docs/architecture.md), shared by every algorithm and every launcher: a
spine of phases over a started :class:`~htfl_dist.runtime.session.Session`, with cross-cutting
features as observers (``runtime.observers``) called at fixed points.

Per round t (0-based; metrics call it round t+1), on every rank:

1. select: the participants, from (seed, t);
2. download: rank 0 broadcasts the server's knowledge (skipped when the previous round's
   evaluation delivered exactly this knowledge) — observers' ``round_started``;
3. train: each participant on the rank ``runtime.rebalance`` gives it (``runtime.local_training``);
4. gather: one message of uploads per rank to rank 0, decoded and checked (``runtime.exchange``);
5. aggregate (rank 0): observers' ``arrivals``, the uploads screened, the server step, observers'
   ``aggregated``;
6. evaluate (evaluation rounds): the new knowledge goes down and every client is tested —
   observers' ``evaluated`` add their rows;
7. report: per-client rows and each rank's own row to rank 0 (observers' ``epsilon_rows`` and
   ``stop_requested``);
8. record (rank 0): the metrics row, sinks and progress line (``runtime.records``);
9. close: every rank agrees whether to stop (observers' ``converged``) and checkpoints when due
   (``runtime.resumption``, with the observers' state).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from htfl_dist.config import Config
from htfl_dist.errors import TrainingDiverged
from htfl_dist.payload import Payload
from htfl_dist.runtime import checkpoint, resumption
from htfl_dist.runtime.asynchronous import AsynchronousSteps
from htfl_dist.runtime.evaluation import evaluate_clients
from htfl_dist.runtime.exchange import (
    DIVERGING,
    FINISHED,
    GIVE_UP,
    STOP,
    ClientReport,
    RankReport,
    RoundTraffic,
    StopDecision,
)
from htfl_dist.runtime.local_training import LocalTraining, TrainedShare
from htfl_dist.runtime.observers import RoundObserver, default_observers
from htfl_dist.runtime.placement import evaluated_clients, sample_participants
from htfl_dist.runtime.records import RoundOutcome, RoundRecords
from htfl_dist.runtime.screening import LeftOut, screen_uploads
from htfl_dist.runtime.session import RunContext, Session
from htfl_dist.seeding import torch_generator

__all__ = ["Federation", "RunContext", "Session", "start"]


def _diverged(config: Config, completed: int, out_dir: Any) -> TrainingDiverged:
    first = completed - config.train.max_diverged_rounds + 1
    kept = checkpoint.find_checkpoint(out_dir)
    return TrainingDiverged(
        f"training diverged: every participating client's loss was not finite in rounds {first}-{completed} "
        f"(train.max_diverged_rounds={config.train.max_diverged_rounds}); lower train.lr (now {config.train.lr:g}) "
        f"and start a new --out; " + (f"the last good checkpoint is {kept}" if kept else "no checkpoint was kept"))


def start(run: RunContext, observers: Sequence[RoundObserver] | None = None) -> Federation:
    """The one start of a rank: its session built (``runtime.session``), its loop ready to run."""
    return Federation(Session(run), observers)


class Federation:
    """The round loop over one rank's session: ``run()`` plays the rounds phase by phase; the
    phases call the exchange for every message, the observers at their points and, on rank 0,
    the records for every row. ``observers`` defaults to every built-in feature."""

    def __init__(self, session: Session, observers: Sequence[RoundObserver] | None = None) -> None:
        self.session = session
        self.config = session.config
        self.training = LocalTraining(session)
        self.observers = list(default_observers(session) if observers is None else observers)
        self.asynchronous = AsynchronousSteps(session) if self.config.participation.mode == "async" else None
        """``participation.mode=async``: the schedule of server steps (an observer for its checkpoint state)."""
        if self.asynchronous is not None:
            self.observers.insert(0, self.asynchronous)
        self.records = RoundRecords(self.config, session.run.out_dir, session.world_size) \
            if session.is_server else None
        self.stop_decision = StopDecision(self.config.train.max_diverged_rounds)  # rank 0's, at each round's end
        self.preempted_after: int | None = None
        """Set when the run stopped on a SIGTERM after checkpointing this many rounds."""

    def run(self) -> dict[str, Any] | None:
        """Play the run to its end (or a stop); rank 0 returns summary.json's content."""
        try:
            start_round = self.restore()
            if self.records is not None:
                self.records.begin(start_round + 1)
            return self._play_rounds(start_round)
        finally:
            self.session.watchdog.stop()  # finished or failed: a round that raised left it armed
            if self.records is not None:
                self.records.close()
            self.training.close()  # first: no training thread may still hold a client of the store
            self.session.clients.close()

    def restore(self) -> int:
        """Load the newest complete checkpoint of ``resume_from`` and return the rounds it completed
        (0: nothing to resume). ``run`` calls it first; inspection tools (bench/diagnose_prototypes.py)
        call it instead of ``run``."""
        return resumption.restore(self.session, self.records, self.observers)

    def _play_rounds(self, start_round: int) -> dict[str, Any] | None:
        session = self.session
        if start_round == 0:
            self.play_setup()
        knowledge: Payload | None = None  # what the clients of this rank last received
        round_seconds: list[float] = []
        for round_index in range(start_round, self.config.rounds):
            session.watchdog.arm(round_index + 1)
            began = time.perf_counter()
            outcome, knowledge = self.play_round(round_index, knowledge)
            round_seconds.append(time.perf_counter() - began)
            if self.records is not None:
                self.records.record(outcome, round_seconds)
            decision = self._close_round(outcome)
            session.watchdog.disarm()
            if decision & STOP:
                self.preempted_after = round_index + 1
                return None
            if decision & FINISHED:
                break
        if self.records is None:
            return None
        facts = {"world_size": session.world_size, "transport": session.transport.name, "device": str(session.device)}
        return self.records.finish(round_seconds, facts, session.run.extra_summary, session.privacy_plan)

    def play_setup(self) -> None:
        """Before the first round of a fresh run, every client sends the algorithm's setup payload
        (FedGen's label counts) and the server consumes them; a resumed run has it in the server's
        checkpoint. Invalid setup uploads are screened like round uploads."""
        session, traffic = self.session, RoundTraffic()
        spec = session.entry.client.setup_upload_fields(session.context)
        if spec:
            entries = {cid: session.client_algorithm.setup_upload(session.clients.peek(cid)) for cid in session.clients}
            validate = session.rank0_server.validate_setup_upload if session.is_server else None
            kept = session.exchange.gather_setup(spec, entries, validate, traffic)
            if kept is not None:
                session.rank0_server.setup(kept)
        if self.records is not None:
            self.records.count_setup_upload(traffic)

    def knowledge(self, traffic: RoundTraffic | None = None) -> Payload:
        """The download phase: what the clients receive now (the server's download, broadcast)."""
        session = self.session
        download = session.rank0_server.download() if session.is_server and session.download_spec else None
        return session.exchange.broadcast_knowledge(session.download_spec, download, traffic or RoundTraffic())

    def play_round(self, round_index: int, knowledge: Payload | None,
                   participants: list[int] | None = None) -> tuple[RoundOutcome, Payload | None]:
        """One round, as its phases. Returns what it produced and the knowledge the clients now hold
        (None: the next round must broadcast it). ``participants`` replaces the sampled ones (the
        conformance kit plays rounds of chosen clients)."""
        config, session = self.config, self.session
        evaluated = (round_index + 1) % config.eval_every == 0 or round_index + 1 == config.rounds
        outcome = RoundOutcome(round_index, [], evaluated=evaluated)
        if knowledge is None:
            knowledge = self.knowledge(outcome.traffic)
        starts = self.asynchronous.step_starts(knowledge) if self.asynchronous is not None else None
        if starts is not None:
            participants = sorted(starts)
        elif participants is None:
            participants = sample_participants(config.seed, round_index, config.num_clients, config.join_ratio,
                                               config.participation.random_join)
        outcome.participants = participants
        for observer in self.observers:
            observer.round_started(outcome, knowledge)
        if session.is_server:
            outcome.traffic.theory_down = session.rank0_server.theory_download_floats() * 4 * len(participants)
        began = time.perf_counter()
        trainers = self.training.trainers(participants)
        share = self.training.train(trainers, knowledge, round_index) if starts is None else \
            self._train_from_versions(trainers, starts, knowledge, outcome)
        outcome.client_seconds = time.perf_counter() - began
        if session.summing is not None:  # rank 0 receives only the sum
            aggregate_sums(self, outcome, share.uploads, trainers)
        else:
            left_out = LeftOut(round_index + 1)  # rank 0: who this round leaves out and why, said in one line
            gathered, outcome.skipped = session.exchange.gather_uploads(
                session.upload_spec, share.uploads, participants, round_index + 1, outcome.traffic, left_out, trainers)
            if gathered is not None:  # rank 0
                self.aggregate(outcome, gathered, left_out)
        knowledge, eval_rows = self._evaluate(outcome)
        self._report(outcome, share, eval_rows, trainers)
        return outcome, knowledge

    def _train_from_versions(self, trainers: dict[int, int], starts: dict[int, int], knowledge: Payload,
                             outcome: RoundOutcome) -> TrainedShare:
        """``participation.mode=async``: each arrival trains with the knowledge of the version it
        started from (the current one is ``knowledge``; rank 0 sends an earlier one again)."""
        assert self.asynchronous is not None
        share = TrainedShare()
        for version in sorted(set(starts.values())):  # the server's version is the steps done so far
            held = knowledge if version == outcome.round_index else \
                self.asynchronous.knowledge_of(version, outcome.traffic)
            part = self.training.train({c: r for c, r in trainers.items() if starts[c] == version}, held,
                                       outcome.round_index)
            share.uploads.update(part.uploads)
            share.train_rows.update(part.train_rows)
            share.theory_bytes += part.theory_bytes
        return share

    def aggregate(self, outcome: RoundOutcome, gathered: dict[int, Payload], left_out: LeftOut) -> None:
        """Rank 0: the uploads that arrive, screened (who the round leaves out said in one line),
        then the server step (skipped, keeping the knowledge as it was, when none is left)."""
        server = self.session.rank0_server
        for observer in self.observers:
            gathered = observer.arrivals(outcome, gathered)
        gathered, skipped = screen_uploads(gathered, server.validate_upload, self.config.on_bad_upload,
                                           outcome.round_index + 1, left_out)
        outcome.skipped.extend(skipped)
        left_out.say()
        began = time.perf_counter()
        if (gathered or not self.session.upload_spec) and not outcome.too_few:
            generator = torch_generator(self.config.seed, "server", outcome.round_index)
            if self.asynchronous is None:
                outcome.diagnostics = server.update(gathered, outcome.round_index, generator)
            else:
                outcome.diagnostics = self.asynchronous.server_step(server, gathered, outcome.round_index, generator)
        else:
            outcome.diagnostics = {"server_skipped": True}
        outcome.server_seconds = time.perf_counter() - began
        for observer in self.observers:
            observer.aggregated(outcome, gathered)

    def _evaluate(self, outcome: RoundOutcome) -> tuple[Payload | None, dict[int, list[float]]]:
        """On evaluation rounds: the new knowledge goes down and the round's tested clients of this
        rank are evaluated on their test splits (its time counts as client time). Returns the
        knowledge the clients now hold (None on other rounds: the next round sends it) and the rows."""
        if not outcome.evaluated:
            return None, {}
        config, session = self.config, self.session
        outcome.tested = evaluated_clients(config.seed, outcome.round_index, config.num_clients,
                                           config.eval.clients_fraction, outcome.round_index + 1 == config.rounds)
        if config.eval.clients_fraction < 1:
            outcome.participation["tested_clients"] = len(outcome.tested)
        knowledge = self.knowledge(outcome.traffic)
        began = time.perf_counter()
        rows = evaluate_clients(session.client_algorithm, session.clients, knowledge, session.context.num_classes,
                                set(outcome.tested), session.entry.evaluation_installs_knowledge)
        for observer in self.observers:
            rows.update(observer.evaluated(outcome, knowledge))
        outcome.client_seconds += time.perf_counter() - began
        return knowledge, rows

    def _report(self, outcome: RoundOutcome, share: TrainedShare, eval_rows: dict[int, list[float]],
                trainers: dict[int, int]) -> None:
        """This rank's report rows (training, evaluation, ε spent) and its own row to rank 0."""
        reported = set(share.train_rows) | set(eval_rows)
        epsilons: dict[int, list[float]] = {}
        for observer in self.observers:
            epsilons.update(observer.epsilon_rows(reported))
        clients = {client_id: ClientReport(share.train_rows.get(client_id), eval_rows.get(client_id),
                                           epsilons.get(client_id)) for client_id in reported}
        stop = any(observer.stop_requested() for observer in self.observers)
        mine = RankReport(outcome.client_seconds, float(share.theory_bytes), float(stop))
        unseen = range(self.config.num_clients, self.config.num_clients + self.config.eval.new_clients)
        tested = set(outcome.tested) | (set(unseen) if outcome.evaluated else set())
        outcome.reports = self.session.exchange.gather_reports(clients, mine, outcome.participants, tested, trainers)

    def _close_round(self, outcome: RoundOutcome) -> int:
        """Every rank: agree whether to stop (a SIGTERM anywhere, an observer's ``converged``) and
        checkpoint when preempted or when one is due, inside the round's deadline (a stuck save
        must not hang MPI). Returns the decision's bits."""
        verdict = None
        if self.records is not None:
            assert outcome.reports is not None, "rank 0 gathers the reports"
            rows = self.records.metrics.rows
            converged = any([observer.converged(outcome, rows) for observer in self.observers])
            verdict = self.stop_decision.decide(outcome.reports, converged=converged)
        decision = self.session.exchange.agree(verdict)
        completed = outcome.round_index + 1
        if decision & GIVE_UP:
            raise _diverged(self.config, completed, self.session.run.out_dir)
        every = self.config.checkpoint_every
        if decision & STOP or (every and completed % every == 0 and not decision & DIVERGING):
            resumption.save(self.session, self.records, self.observers, completed)
        return decision


def aggregate_sums(federation: Federation, outcome: RoundOutcome, uploads: dict[int, Payload],
                   trainers: Mapping[int, int]) -> None:
    """The gather and aggregate phases when the uploads reach rank 0 as a sum (every rank):
    ``privacy.secure_aggregation`` (the observers deciding which masked inputs arrive, as they
    decide which uploads do) or ``runtime.presum_uploads``; then on rank 0 the server step from the
    sum alone, skipped (the knowledge kept) when nothing may be released. No single upload reaches
    rank 0, so there is none to screen or hand on."""
    session, observers = federation.session, federation.observers

    def arrivals(masked: dict[int, Payload]) -> dict[int, Payload]:
        for observer in observers:
            masked = observer.arrivals(outcome, masked)
        return masked

    assert session.summing is not None
    result = session.summing.gather(uploads, outcome.participants, trainers, outcome.round_index,
                                        outcome.traffic, arrivals)
    if result is None:  # not rank 0
        return
    began = time.perf_counter()
    if result.sums is not None and not outcome.too_few:
        generator = torch_generator(federation.config.seed, "server", outcome.round_index)
        outcome.diagnostics = session.rank0_server.update_from_sums(result.sums, result.uploaders,
                                                                    outcome.round_index, generator)
    else:
        outcome.diagnostics = {"server_skipped": True}
        if result.sums is None:
            print(f"htfl_dist: warning: round {outcome.round_index + 1}: secure aggregation unmasks nothing: fewer "
                  f"masked inputs arrived than its threshold t={result.threshold}", file=sys.stderr, flush=True)
    if result.clipped is not None:
        outcome.diagnostics["secagg_clipped"] = result.clipped
    outcome.server_seconds = time.perf_counter() - began
    for observer in observers:
        observer.aggregated(outcome, {})
