"""Run outputs: metrics.jsonl (one row per evaluated round), summary.json, progress lines.

Files are written so that an interrupted run never leaves a half-written file: JSON
documents go through a temp file and ``os.replace``; metrics rows are whole lines.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from htfl_dist.atomic import replaced_atomically
from htfl_dist.errors import HtflError


def write_atomic(path: Path, text: str) -> None:
    """Publish ``text`` at ``path`` all at once (see :mod:`htfl_dist.atomic`)."""
    with replaced_atomically(path) as tmp, open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


class MetricsFileError(HtflError):
    """metrics.jsonl is damaged somewhere other than a half-written last line."""


def read_rows(metrics: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``. A running job appends whole lines, but a reader can catch
    the last one half-written: an unparsable last line is skipped. Anywhere else it means the
    file is damaged, which is an error naming the line."""
    text = metrics.read_bytes().decode("utf-8", errors="replace")  # a cut can split a character
    numbered = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    rows = []
    for position, (number, line) in enumerate(numbered):
        row = _parse_row(line)
        if row is None:
            if position == len(numbered) - 1:
                break  # the line being written
            raise MetricsFileError(f"{metrics}, line {number}: not a metrics row (a JSON object with 'round'); "
                                   f"the file is damaged: repair or delete that line")
        rows.append(row)
    return rows


def _parse_row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and "round" in row else None


class MetricsLog:
    """Append-only JSONL of evaluated rounds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def load_existing(self, up_to_round: int, source: Path | None = None) -> None:
        """On resume: keep the rows of completed rounds (from ``source``, the checkpointed run's
        metrics, by default this run's own) and drop any written after the checkpoint; with
        ``up_to_round`` 0 (no checkpoint to resume from) the file is emptied."""
        source = source if source is not None and source.exists() else self.path
        if not source.exists():
            return
        # up_to_round 0: a restart from scratch discards the rows, whatever state they are in
        rows = read_rows(source) if up_to_round > 0 else []  # read_rows skips a half-written last line
        self.rows = [row for row in rows if row["round"] <= up_to_round]
        write_atomic(self.path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in self.rows))

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
            handle.flush()


def format_progress(round_number: int, rounds: int, row: dict[str, Any] | None, seconds: float,
                    eta_s: float) -> str:
    parts = [f"round {round_number}/{rounds}"]
    if row is not None:
        parts.append(f"acc {row['test_acc'] * 100:6.2f}%  head {row['test_acc_head'] * 100:6.2f}%")
    parts.append(f"{seconds:6.2f}s")
    parts.append(f"ETA {_clock(eta_s)}")
    return "  ".join(parts)


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}"


def progress(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


class TrainingProgress:
    """Progress inside a long round: after ``every_s`` seconds of local training, and again every
    ``every_s``, the rank says how many of its round's clients it has trained. Rank 0 cannot say
    it for the others (uploads arrive together at the round's gather), so each client rank speaks
    for itself, naming itself. Costs one clock read per client."""

    def __init__(self, every_s: float, where: str = "") -> None:
        self.every_s = every_s
        self.where = where
        self.round_number = self.total = self.done = 0
        self.began = self.last_line = 0.0

    def start(self, round_number: int, total: int) -> None:
        self.round_number, self.total, self.done = round_number, total, 0
        self.began = self.last_line = time.perf_counter()

    def client_done(self) -> None:
        self.done += 1
        if not self.every_s or self.done >= self.total:
            return
        now = time.perf_counter()
        if now - self.last_line >= self.every_s:
            self.last_line = now
            who = f" {self.where}" if self.where else ""
            progress(f"round {self.round_number}:{who} trained {self.done}/{self.total} clients "
                     f"({now - self.began:.0f}s)")
