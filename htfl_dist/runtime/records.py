"""Rank 0's records of a run: the metrics rows, the sinks that mirror them, the progress line,
config.yaml and summary.json.

The round loop hands each finished round over as a ``RoundOutcome``; the records turn it into a
row (evaluation rounds) and a progress line (every round). They hold the one piece of state that
spans rounds: the clients left out of rounds since the last row, which that row reports, so a
round without evaluation does not lose who it skipped. Nothing here talks to other ranks.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from htfl_dist.config import Config
from htfl_dist.errors import NothingAggregated
from htfl_dist.metrics.report import PER_CLIENT_FILE, accuracy_summary
from htfl_dist.metrics.sinks import MetricsSink, open_sinks
from htfl_dist.metrics.writer import MetricsLog, format_progress, progress, write_atomic, write_json
from htfl_dist.privacy.startup import epsilon_columns, privacy_summary
from htfl_dist.runtime.exchange import RoundReports, RoundTraffic
from htfl_dist.runtime.placement import client_ranks, idle_shares


@dataclass
class RoundOutcome:
    """What one round produced, filled in phase by phase by the round loop; on rank 0 the
    records turn it into the metrics row."""

    round_index: int
    participants: list[int]
    evaluated: bool
    traffic: RoundTraffic = field(default_factory=RoundTraffic)
    client_seconds: float = 0.0
    """This rank's training (and evaluation) time."""
    server_seconds: float = 0.0
    diagnostics: dict[str, Any] = field(default_factory=dict)
    """The server step's own figures (rank 0)."""
    skipped: list[int] = field(default_factory=list)
    """Rank 0: clients whose uploads were left out this round (a bad message or upload)."""
    reports: RoundReports | None = None
    """Rank 0: every client's and rank's report rows; None on the other ranks."""
    tested: list[int] = field(default_factory=list)
    """The clients tested this round (all of them, or ``eval.clients_fraction`` of them; none on a
    round without evaluation)."""
    download_bytes: int = 0
    """The bytes of the knowledge the participants trained with (its transfer, on the simulated clock)."""
    participation: dict[str, Any] = field(default_factory=dict)
    """Rank 0, with ``participation.*`` in use: who was lost, late or aggregated, the simulated times."""
    too_few: bool = False
    """Rank 0: fewer uploads arrived than the server step needs; it keeps last round's knowledge."""


def worst_share_mean(per_client: np.ndarray, share: float) -> float:
    """The mean accuracy of the worst ``share`` of the clients (at least one): how the clients the
    federation serves worst fare, which a pooled mean hides."""
    count = max(1, math.ceil(share * per_client.size))
    return float(np.sort(per_client)[:count].mean())


def pooled_auc(aucs: np.ndarray, samples: np.ndarray) -> float | None:
    """HtFLlib's run AUC: each client's weighted by its test samples, over the clients whose AUC
    is defined (None when none is)."""
    defined = ~np.isnan(aucs)
    if not defined.any():
        return None
    return float((aucs[defined] * samples[defined]).sum() / samples[defined].sum())


def evaluation_rows(reports: dict[int, Any]) -> dict[int, list[float]]:
    """The tested clients' evaluation rows (``runtime.evaluation.test_client``), by client id."""
    return {cid: r["eval"][0].tolist() for cid, r in reports.items() if r["eval"].shape[0]}


def per_client_row(outcome: RoundOutcome, unseen: dict[int, Any] | None = None) -> dict[str, Any]:
    """The tested clients in id order with their accuracy, head accuracy, test samples and AUC
    (null where undefined); the unseen clients' (``eval.new_clients``) under ``new_*`` keys."""
    assert outcome.reports is not None, "rank 0's outcome"
    row = {"round": outcome.round_index + 1, **_client_columns(outcome.reports.clients, "clients", "test")}
    if unseen:
        row.update(_client_columns(unseen, "new_clients", "new_client"))
    return row


def _client_columns(reports: dict[int, Any], ids_key: str, prefix: str) -> dict[str, Any]:
    tested = evaluation_rows(reports)
    ids = sorted(tested)
    return {ids_key: ids,
            f"{prefix}_acc": [tested[c][0] / max(tested[c][2], 1) for c in ids],
            f"{prefix}_acc_head": [tested[c][1] / max(tested[c][2], 1) for c in ids],
            f"{prefix}_samples": [int(tested[c][2]) for c in ids],
            f"{prefix}_auc": [None if math.isnan(tested[c][3]) else tested[c][3] for c in ids]}


def metrics_row(outcome: RoundOutcome, seconds: float, client_seconds: float, skipped: list[int]) -> dict[str, Any]:
    """The row of an evaluation round: pooled accuracy (Σ correct / Σ samples over every client),
    the std of the per-client accuracies, the training loss over the participants, bytes, times,
    ε columns (privacy) and the server's diagnostics."""
    assert outcome.reports is not None, "rank 0's outcome"
    reports, traffic = outcome.reports.clients, outcome.traffic
    trains = np.array([r["train"][0].tolist() for r in reports.values() if r["train"].shape[0]])
    row = {
        "round": outcome.round_index + 1,
        **pooled_columns(reports, "test"),
        "train_loss": float(trains[:, 0].sum() / max(trains[:, 1].sum(), 1)) if len(trains) else None,
        "bytes_up": traffic.up,
        "bytes_down": traffic.down,
        "bytes_theory_up": traffic.theory_up,
        "bytes_theory_down": traffic.theory_down,
        "seconds": seconds,
        "client_s": client_seconds,
        "server_s": outcome.server_seconds,
        "comm_s": max(0.0, seconds - client_seconds - outcome.server_seconds),
        "skipped_clients": list(skipped),  # bad uploads left out since the last row
    }
    row.update(epsilon_columns([float(r["privacy"][0, 0]) for r in reports.values() if r["privacy"].shape[0]]))
    row.update(outcome.participation)
    row.update(outcome.diagnostics)
    return row


def pooled_columns(reports: dict[int, Any], prefix: str) -> dict[str, Any]:
    """The tested clients' figures, pooled: ``<prefix>_acc`` (Σ correct / Σ samples over the
    clients, by the algorithm's rule) and ``_acc_head`` (by the head), the std of the per-client
    accuracies, the mean of the worst 10 % of them, and ``<prefix>_auc`` (samples-weighted). The
    federation's row uses prefix ``test``, the unseen clients' (``eval.new_clients``) ``new_client``."""
    evals = np.array(list(evaluation_rows(reports).values()))
    per_client = evals[:, 0] / np.maximum(evals[:, 2], 1)
    samples = evals[:, 2].sum()
    return {f"{prefix}_acc": float(evals[:, 0].sum() / samples),
            f"{prefix}_acc_head": float(evals[:, 1].sum() / samples),
            f"{prefix}_acc_std": float(per_client.std()),
            f"{prefix}_acc_worst10": worst_share_mean(per_client, 0.1),
            f"{prefix}_auc": pooled_auc(evals[:, 3], evals[:, 2])}


WEIGHTINGS = ("validclass", "labeldist")
"""FedNH's class weightings of a client's test accuracy, columns 4 and 5 of an evaluation row
(``runtime.evaluation.class_weighted_accuracies``); the third, ``uniform``, is ``test_acc``."""


def class_weighted_columns(reports: dict[int, Any], prefix: str, per_client: bool) -> dict[str, Any]:
    """``<prefix>_acc_validclass`` and ``_acc_labeldist`` (``eval.test_set=global``): the mean over the
    tested clients, each weighing its clients alike as FedNH's ``average_pfl_test_acc_dict`` does,
    or (``per_client``) each client's figure in id order; NaN (a client without a trained class
    among the tested samples) counts as null and is left out of the mean."""
    tested = evaluation_rows(reports)
    columns: dict[str, Any] = {}
    for offset, weighting in enumerate(WEIGHTINGS, start=4):
        values = [tested[cid][offset] for cid in sorted(tested)]
        if per_client:
            columns[f"{prefix}_acc_{weighting}"] = [None if math.isnan(v) else v for v in values]
        else:
            defined = [v for v in values if not math.isnan(v)]
            columns[f"{prefix}_acc_{weighting}"] = float(np.mean(defined)) if defined else None
    return columns


def set_unseen_apart(outcome: RoundOutcome, num_clients: int) -> dict[int, Any]:
    """Take the unseen clients' rows (ids from ``num_clients`` on) out of ``outcome.reports``, so
    the federation's figures and stop decisions see the federation alone; returns them."""
    assert outcome.reports is not None, "rank 0's outcome"
    clients = outcome.reports.clients
    unseen = {cid: report for cid, report in clients.items() if cid >= num_clients}
    if unseen:
        kept = {cid: report for cid, report in clients.items() if cid < num_clients}
        outcome.reports = outcome.reports._replace(clients=kept)
    return unseen


def server_skipped(outcome: RoundOutcome) -> bool:
    """Whether the round's server step was skipped: no upload reached it."""
    return bool(outcome.diagnostics.get("server_skipped"))


def said_already(outcome: RoundOutcome, min_clients: int) -> bool:
    """Whether the round loop has said already why this round aggregated nothing, in its own line:
    it left bad uploads out (naming them), or fewer uploads arrived than
    ``participation.min_clients``."""
    arrivals = outcome.participation
    if outcome.skipped:
        return True
    if not min_clients or "arrived_clients" not in arrivals:
        return False
    return arrivals["arrived_clients"] + len(arrivals.get("late_folded_clients", [])) < min_clients


def nothing_aggregated_line(outcome: RoundOutcome, config: Config) -> str:
    """The warning of a round whose server aggregated nothing: who was lost, and to what."""
    arrivals, options = outcome.participation, config.participation
    why = []
    if "arrived_clients" in arrivals:
        why.append(f"{arrivals['arrived_clients']} of {len(outcome.participants)} uploads arrived")
    for key, cause in (("dropped_clients", f"dropped (participation.drop_rate={options.drop_rate:g})"),
                       ("late_clients", f"late (participation.deadline_s={options.deadline_s:g})"),
                       ("unavailable_clients", "outside their availability windows")):
        if arrivals.get(key):
            why.append(f"{len(arrivals[key])} {cause}")
    return (f"htfl_dist: warning: round {outcome.round_index + 1}: the server aggregated nothing "
            f"({'; '.join(why) or 'no upload reached it'}); it keeps last round's knowledge")


def early_stop_due(rows: list[dict[str, Any]], metric: str, patience: int, min_delta: float) -> dict[str, Any] | None:
    """Whether ``metric`` has gone ``patience`` evaluated rows without improving on its best by more
    than ``min_delta`` (accuracies upwards, the training loss downwards); what to record if so.
    Read from the rows alone, so a resumed run, which reloads them, keeps the count."""
    sign = -1.0 if metric == "train_loss" else 1.0
    best_value, best_round, since = None, None, 0
    for row in rows:
        value = row.get(metric)
        if not isinstance(value, (int, float)) or value != value:  # absent, null (withheld) or NaN
            continue
        if best_value is None or sign * (value - best_value) > min_delta:
            best_value, best_round, since = value, row["round"], 0
        else:
            since += 1
    if not patience or best_value is None or since < patience:
        return None
    return {"after_round": rows[-1]["round"], "metric": metric, "best": best_value, "best_round": best_round,
            "patience": patience, "min_delta": min_delta}


class RoundRecords:
    """Rank 0's metrics log, sinks, progress line and summary for one run directory."""

    def __init__(self, config: Config, out_dir: Path, world_size: int) -> None:
        self.config = config
        self.out_dir = out_dir
        self.world_size = world_size
        self.metrics = MetricsLog(out_dir / "metrics.jsonl")
        self.per_client = MetricsLog(out_dir / PER_CLIENT_FILE)
        self.sinks: list[MetricsSink] = []
        self._skipped_since_row: list[int] = []
        self._setup_bytes_up = 0
        self._first_round = 1
        self._rounds_played = 0
        self._rounds_aggregated = 0

    def begin(self, first_round: int) -> None:
        """The run goes ahead (after a resume was accepted): write config.yaml, remove a
        summary.json left by an earlier end of this run (it no longer describes it), open the sinks."""
        self._first_round = first_round
        write_atomic(self.out_dir / "config.yaml", yaml.safe_dump(self.config.to_dict(), sort_keys=False))
        (self.out_dir / "summary.json").unlink(missing_ok=True)
        self.sinks = open_sinks(self.config, self.out_dir, first_round)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def count_setup_upload(self, traffic: RoundTraffic) -> None:
        """The one-off setup upload of a fresh run, reported with the first row."""
        self._setup_bytes_up += traffic.up

    def record(self, outcome: RoundOutcome, round_seconds: list[float]) -> None:
        """The row of an evaluation round (and its sinks) and every round's progress line."""
        assert outcome.reports is not None, "rank 0's outcome"
        unseen = set_unseen_apart(outcome, self.config.num_clients)
        ranks = outcome.reports.ranks
        outcome.traffic.theory_up = int(sum(r.theory_up_bytes for r in ranks))
        self._skipped_since_row.extend(outcome.skipped)
        self._rounds_played += 1
        if not server_skipped(outcome):
            self._rounds_aggregated += 1
        elif not said_already(outcome, self.config.participation.min_clients):
            print(nothing_aggregated_line(outcome, self.config), file=sys.stderr, flush=True)
        rank_seconds = [r.compute_seconds for r in ranks]
        seconds = round_seconds[-1]
        row = None
        if outcome.evaluated:
            row = metrics_row(outcome, seconds, max(rank_seconds), self._skipped_since_row)
            if unseen:
                row.update(pooled_columns(unseen, "new_client"))
            weighted = self.config.eval.test_set == "global"
            if weighted:
                row.update(class_weighted_columns(outcome.reports.clients, "test", per_client=False))
            training = client_ranks(self.world_size, self.config.runtime.server_hosts_clients)
            row["rank_idle_share"] = idle_shares([rank_seconds[rank] for rank in training])
            if self._setup_bytes_up:
                row["bytes_setup_up"], self._setup_bytes_up = self._setup_bytes_up, 0
            self.metrics.append(row)
            client_row = per_client_row(outcome, unseen)
            if weighted:
                client_row.update(class_weighted_columns(outcome.reports.clients, "test", per_client=True))
            self.per_client.append(client_row)
            for sink in self.sinks:
                sink.write(self.metrics.rows)
            self._skipped_since_row = []
        eta = float(np.mean(round_seconds)) * (self.config.rounds - outcome.round_index - 1)
        progress(format_progress(outcome.round_index + 1, self.config.rounds, row, seconds, eta))

    def finish(self, round_seconds: list[float], facts: dict[str, Any], extra: dict[str, Any],
               privacy_plan: Any) -> dict[str, Any]:
        """summary.json: the accuracy summary, the run's ``facts`` (world size, transport,
        device), what start-up added (``extra``: the generator's provenance) and the privacy block."""
        summary = {
            **accuracy_summary(self.metrics.rows),
            "rounds": self.config.rounds,
            "config_hash": self.config.config_hash(),
            **facts,
            "seconds_per_round": float(np.mean(round_seconds)) if round_seconds else None,
            **extra,
            **privacy_summary(self.metrics.rows, privacy_plan),
        }
        write_json(self.out_dir / "summary.json", summary)
        if self._rounds_played and not self._rounds_aggregated and not self._aggregated_before():
            options = self.config.participation
            raise NothingAggregated(
                f"no round of this run aggregated an upload ({self._rounds_played} played, each said above with "
                f"why): the server learnt nothing and the accuracies are the clients' own local training; for "
                f"left-out uploads fix what their line says (a diverged client: lower train.lr), for missing ones "
                f"lower participation.drop_rate (now {options.drop_rate:g}) or participation.min_clients (now "
                f"{options.min_clients}), or raise participation.deadline_s (summary.json is written)")
        return summary

    def _aggregated_before(self) -> bool:
        """A resumed run: whether a round before this process's first aggregated (its row, kept from
        the run's earlier part, has no ``server_skipped``)."""
        return any(not row.get("server_skipped") for row in self.metrics.rows if row["round"] < self._first_round)
