"""Cross-cutting features of a run as observers of the round loop's spine (docs/architecture.md).

The loop (``runtime.loop.Federation``) plays each round as its phases — select, download, train,
gather, aggregate, evaluate, report, record, close — and at fixed points calls every observer's
hook, in the order of :func:`default_observers`. A feature that cuts across rounds (the simulated
clock, unseen clients, early stopping, the privacy ledger's reports, snapshots, preemption) is one
observer here, with its own state in checkpoints (``name``): a new one adds a class and a line in
:func:`default_observers`, and touches no loop code.

Which rank calls a hook is part of its contract: rank 0 alone calls ``arrivals``, ``aggregated``
and ``converged`` (they read what only the server has); every rank calls the others, and they
must give every rank the same answer where the loop agrees on it (``stop_requested`` travels in
the rank's report, so it may differ).
"""
from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from htfl_dist.metrics.generated import GeneratedImageGrids
from htfl_dist.metrics.prototypes import PrototypeSnapshots, check_prototype_payloads
from htfl_dist.metrics.writer import progress
from htfl_dist.payload import Payload
from htfl_dist.privacy.startup import client_epsilon
from htfl_dist.runtime.evaluation import UnseenClients
from htfl_dist.runtime.participation import payload_bytes, rank0_participation
from htfl_dist.runtime.records import RoundOutcome, early_stop_due

if TYPE_CHECKING:
    from htfl_dist.runtime.session import Session


class RoundObserver:
    """A feature called at the spine's fixed points. Every hook does nothing by default: a
    feature overrides the ones it needs, as a Flower strategy variant overrides one method."""

    name = ""
    """Its key in a checkpoint's runtime state ('' : it keeps no state across rounds)."""

    def round_started(self, outcome: RoundOutcome, knowledge: Payload) -> None:
        """Every rank, once the round's participants hold their knowledge, before they train."""

    def arrivals(self, outcome: RoundOutcome, gathered: dict[int, Payload]) -> dict[int, Payload]:
        """Rank 0, before screening: the gathered uploads that reach the server. Set
        ``outcome.too_few`` to keep last round's knowledge."""
        return gathered

    def aggregated(self, outcome: RoundOutcome, kept: dict[int, Payload]) -> None:
        """Rank 0, after the server step (or after it was skipped), with the uploads it was given."""

    def evaluated(self, outcome: RoundOutcome, knowledge: Payload) -> dict[int, list[float]]:
        """Every rank, on evaluation rounds, after its clients were tested: more test rows (clients
        this rank hosts besides the federation's), in ``evaluation.test_client``'s form."""
        return {}

    def epsilon_rows(self, client_ids: Collection[int]) -> dict[int, list[float]]:
        """Every rank, for the round's report: [ε spent so far] of those of ``client_ids`` it
        accounts for."""
        return {}

    def stop_requested(self) -> bool:
        """Every rank, for its report: whether this rank asks the run to stop after this round
        with a checkpoint (rank 0 tells every rank)."""
        return False

    def converged(self, outcome: RoundOutcome, rows: list[dict[str, Any]]) -> bool:
        """Rank 0, at the round's end: whether the run is over (``rows``: the metrics so far)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Its state from a checkpoint (rank 0's ``server.pt``); an empty mapping when the
        checkpoint holds none."""


class SimulatedParticipation(RoundObserver):
    """``participation.*``: dropped, late and unavailable clients and the simulated clock (rank 0
    decides, from (seed, round) and the trace; ``runtime.participation``)."""

    name = "participation"

    def __init__(self, session: Session) -> None:
        self.clock = session.config.participation.clock
        self.min_clients = session.config.participation.min_clients
        self.policy = rank0_participation(session.config, session.partition) if session.is_server else None

    def round_started(self, outcome: RoundOutcome, knowledge: Payload) -> None:
        if self.policy is not None and self.clock:  # what the simulated link carries down
            outcome.download_bytes = payload_bytes(knowledge)

    def arrivals(self, outcome: RoundOutcome, gathered: dict[int, Payload]) -> dict[int, Payload]:
        if self.policy is None:
            return gathered
        arrivals = self.policy.decide(outcome.round_index, outcome.participants, gathered, outcome.download_bytes)
        outcome.participation = arrivals.row(self.clock, self.policy.clock_s)
        if arrivals.too_few:
            outcome.too_few = True
            print(f"htfl_dist: warning: round {outcome.round_index + 1}: {len(arrivals.times.arrived)} of "
                  f"{len(outcome.participants)} uploads arrived, fewer than participation.min_clients="
                  f"{self.min_clients}; the server keeps last round's knowledge", file=sys.stderr, flush=True)
        return arrivals.kept

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict() if self.policy is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.policy is not None:
            self.policy.load_state_dict(state)


class UnseenClientsTested(RoundObserver):
    """``eval.new_clients``: clients that never train with the federation, fine-tuned on each
    evaluated round's knowledge and tested (this rank's share of them)."""

    def __init__(self, session: Session) -> None:
        hosted = session.placement.unseen_of(session.rank)
        self.unseen = UnseenClients(session.config, session.context, session.entry.client, session.partition,
                                    hosted) if hosted else None

    def evaluated(self, outcome: RoundOutcome, knowledge: Payload) -> dict[int, list[float]]:
        return {} if self.unseen is None else self.unseen.evaluate(knowledge, outcome.round_index)


class PrivacyLedgerReports(RoundObserver):
    """``privacy.enabled``: each hosted client's ε so far goes to rank 0 in the round's report
    (a client trained here for another rank is reported by its home, which holds its ledger)."""

    def __init__(self, session: Session) -> None:
        self.enabled = session.privacy_plan is not None
        self.clients = session.clients
        self.num_clients = session.config.num_clients

    def epsilon_rows(self, client_ids: Collection[int]) -> dict[int, list[float]]:
        if not self.enabled:
            return {}
        rows = {}
        for client_id in client_ids:
            if client_id < self.num_clients and client_id in self.clients:  # unseen clients release nothing
                epsilon = client_epsilon(self.clients.peek(client_id))
                assert epsilon is not None, "a private run gives every client a ledger"
                rows[client_id] = [epsilon]
        return rows


class KnowledgeSnapshots(RoundObserver):
    """``output.prototypes_every``: the uploaded and global prototypes of due rounds; and the
    generated images of an algorithm whose download carries them, on evaluated rounds."""

    def __init__(self, session: Session) -> None:
        config = session.config
        if config.output.prototypes_every:  # every rank: a mistake stops them all before they talk
            check_prototype_payloads(config.algorithm, session.upload_spec, session.download_spec)
        self.server = session.server
        self.snapshots = PrototypeSnapshots(session.run.out_dir, config.output.prototypes_every)
        self.image_grids = GeneratedImageGrids(session.run.out_dir, session.download_spec)

    def aggregated(self, outcome: RoundOutcome, kept: dict[int, Payload]) -> None:
        assert self.server is not None, "rank 0 only"
        round_number = outcome.round_index + 1
        if self.snapshots.due(round_number):
            self.snapshots.save(round_number, kept, self.server.download())
        if outcome.evaluated and self.image_grids.enabled:  # download() may compress (FedKD): only then
            self.image_grids.save(round_number, self.server.download())


class EarlyStopping(RoundObserver):
    """``stop.patience``: the run ends when the metric has not improved for that many evaluated
    rounds (said, and recorded in summary.json)."""

    def __init__(self, session: Session) -> None:
        self.stop = session.config.stop
        self.summary = session.run.extra_summary

    def converged(self, outcome: RoundOutcome, rows: list[dict[str, Any]]) -> bool:
        stop = self.stop
        if not stop.patience or not outcome.evaluated:
            return False
        due = early_stop_due(rows, stop.metric, stop.patience, stop.min_delta)
        if due is None:
            return False
        self.summary["stopped_early"] = due
        progress(f"early stop after round {due['after_round']}: {stop.metric} has not improved on "
                 f"{due['best']:.4f} (round {due['best_round']}) for {stop.patience} evaluated rounds "
                 f"(stop.patience)")
        return True


class Preemption(RoundObserver):
    """SIGTERM (``runtime.preemption``): the rank that saw it asks for a stop at the round's end;
    every rank then checkpoints and the run exits 75."""

    def __init__(self, session: Session) -> None:
        self.flag = session.preemption

    def stop_requested(self) -> bool:
        return self.flag.requested


def default_observers(session: Session) -> list[RoundObserver]:
    """The features every run has (each idle unless its config keys are set), in calling order."""
    return [SimulatedParticipation(session), UnseenClientsTested(session), PrivacyLedgerReports(session),
            KnowledgeSnapshots(session), EarlyStopping(session), Preemption(session)]
