"""The spine's checkpoint phase and the start of a resumed run: every rank saves and restores its
part (``runtime.checkpoint``: clients on their home ranks, the server and the observers' state on
rank 0), and rank 0 brings back the metrics the run wrote until then."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from htfl_dist.errors import HtflError
from htfl_dist.metrics.report import PER_CLIENT_FILE
from htfl_dist.metrics.writer import progress
from htfl_dist.runtime import checkpoint
from htfl_dist.runtime.observers import RoundObserver
from htfl_dist.runtime.records import RoundRecords

if TYPE_CHECKING:
    from htfl_dist.runtime.session import Session

LEGACY_PARTICIPATION_KEY = "clock_s"
"""A checkpoint written before observers kept their state by name holds the simulated clock's
state (the one runtime state there was) at the top level."""


def observer_states(observers: Sequence[RoundObserver]) -> dict[str, Any]:
    """Rank 0's runtime state: each observer that keeps one, under its name."""
    return {observer.name: observer.state_dict() for observer in observers if observer.name}


def restore_observers(observers: Sequence[RoundObserver], saved: dict[str, Any]) -> None:
    """Give each observer its saved state (an empty one where the checkpoint holds none)."""
    if LEGACY_PARTICIPATION_KEY in saved:
        saved = {"participation": saved}
    for observer in observers:
        if observer.name:
            observer.load_state_dict(saved.get(observer.name, {}))


def save(session: Session, records: RoundRecords | None, observers: Sequence[RoundObserver],
         completed_rounds: int) -> None:
    """This rank's part of the checkpoint after ``completed_rounds``."""
    metrics = records.metrics if records else None
    checkpoint.save(session.run.out_dir, completed_rounds, session.config, session.transport,
                    clients=session.clients, server=session.server,
                    metric_rounds=[row["round"] for row in metrics.rows] if metrics else None,
                    data_identity=session.partition.identity,
                    runtime_state=observer_states(observers) if session.is_server else None)


def restore(session: Session, records: RoundRecords | None, observers: Sequence[RoundObserver]) -> int:
    """Load the newest complete checkpoint of ``resume_from`` (clients, server, observers, metrics
    so far) and return the rounds it completed; 0 when there is nothing to resume."""
    source = session.run.resume_from
    directory = checkpoint.find_checkpoint(source) if source is not None else None
    if directory is None:  # a fresh run, or --resume auto before any checkpoint: start over
        if records is not None:
            if source is not None:
                progress(f"resume: no complete checkpoint in {source}; starting from round 1")
            records.metrics.load_existing(0)  # rows of a run that died before its first checkpoint
            records.per_client.load_existing(0)
        return 0
    completed, changed = checkpoint.load(
        directory, session.config, clients=session.clients, server=session.server, device=session.device,
        data_identity=session.partition.identity,
        restore_runtime=(lambda saved: restore_observers(observers, saved)) if session.is_server else None)
    _say_changed_data(session, completed, changed)
    if completed > session.config.rounds:
        raise HtflError(f"checkpoint {directory} is after round {completed} but rounds={session.config.rounds}; "
                        f"pass rounds={completed} or more to continue it")
    if records is not None:
        records.metrics.load_existing(completed, source=directory.parent.parent / "metrics.jsonl",
                                      required_rounds=checkpoint.metric_rounds(directory, session.config.eval_every))
        records.per_client.load_existing(completed, source=directory.parent.parent / PER_CLIENT_FILE)
        progress(f"resume: continuing after round {completed} from {directory}")
    return completed


def _say_changed_data(session: Session, completed: int, changed: str) -> None:
    """``data.allow_changed``: the run goes on with other data, on purpose, and says so."""
    if not changed:
        return
    session.run.extra_summary["data_changed_on_resume"] = {"after_round": completed, "data": changed}
    if session.is_server:
        progress(f"htfl_dist: warning: resume: the clients trained on other data until round {completed} "
                 f"({changed}); going on with these (data.allow_changed=true)")
