"""Where a run directory stands, read from its files alone (``python -m htfl_dist.report --follow``:
a live view of a run that may be starting, running, stopped or finished)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from htfl_dist.metrics.report import CONFIG_FILE, mean_of, read_run

PREEMPTED_MARKER = "PREEMPTED"
"""The marker a run leaves in its directory when it checkpoints on SIGTERM (the exit status does not
survive torchrun, so batch scripts read the file); it stays until the run finishes, so it means
"stopped" only while it is newer than the attempt's config.yaml."""


@dataclass(frozen=True)
class RunProgress:
    """Where a run directory stands, read from its files alone (a live view of a run that may be
    anywhere: starting, running, stopped, finished)."""

    state: str
    """waiting (no config.yaml yet), running, stopped (checkpointed on SIGTERM) or finished."""
    rows: list[dict[str, Any]]
    rounds: int
    summary: dict[str, Any] | None

    @property
    def rounds_done(self) -> int:
        return self.rows[-1]["round"] if self.rows else 0

    @property
    def eta_s(self) -> float | None:
        """The rounds left at the evaluated rounds' mean time, None before the first row."""
        seconds = mean_of(self.rows, "seconds")
        return None if seconds is None else seconds * max(self.rounds - self.rounds_done, 0)


def run_progress(path: Path) -> RunProgress:
    """The run's state, rows and planned rounds; a directory without config.yaml is waiting."""
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        return RunProgress("waiting", [], 0, None)
    run = read_run(path)
    rounds = int(run.config.get("rounds") or 0)
    if run.summary is not None:
        return RunProgress("finished", run.rows, rounds, run.summary)
    marker = path / PREEMPTED_MARKER
    try:
        stopped = marker.stat().st_mtime >= config_file.stat().st_mtime
    except FileNotFoundError:
        stopped = False
    return RunProgress("stopped" if stopped else "running", run.rows, rounds, None)
