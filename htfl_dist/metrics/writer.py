"""Run outputs: metrics.jsonl (one row per evaluated round), summary.json, progress lines.

Files are written so that an interrupted run never leaves a half-written file: JSON
documents go through a temp file and ``os.replace``; metrics rows are whole lines (a row that
runs out of disk space is taken back off the file), and a resumed run refuses to go on when the
rows its checkpoint vouches for are not all there.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from htfl_dist.atomic import os_errors, publish_bytes
from htfl_dist.errors import HtflError


def write_atomic(path: Path, text: str) -> None:
    """Publish ``text`` at ``path`` all at once (see :mod:`htfl_dist.atomic`)."""
    publish_bytes(path, text.encode())


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


class MetricsFileError(HtflError):
    """metrics.jsonl is damaged somewhere other than a half-written last line."""


def read_rows(metrics: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``. A running job appends whole lines, but a reader can catch
    the last one half-written: an unparsable last line is skipped. Anywhere else it means the
    file is damaged, which is an error naming the line."""
    with os_errors(f"read {metrics}", metrics):
        data = metrics.read_bytes()
    text = data.decode("utf-8", errors="replace")  # a cut can split a character
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

    def load_existing(self, up_to_round: int, source: Path | None = None,
                      required_rounds: list[int] | None = None) -> None:
        """On resume: keep the rows of completed rounds (from ``source``, the checkpointed run's
        metrics, by default this run's own) and drop any written after the checkpoint; with
        ``up_to_round`` 0 (no checkpoint to resume from) the file is emptied. The rows of
        ``required_rounds`` (the rounds the checkpoint saw evaluated) must all be there: going on
        without them would lose them from the run's record for good, so a file that lacks them
        (emptied, cut, edited) refuses the resume."""
        source = source if source is not None and source.exists() else self.path
        if not source.exists() and up_to_round == 0:
            return
        # up_to_round 0: a restart from scratch discards the rows, whatever state they are in
        rows = read_rows(source) if up_to_round > 0 and source.exists() else []  # skips a cut last line
        self.rows = [row for row in rows if row["round"] <= up_to_round]
        _check_required_rows(source, self.rows, required_rounds or [], up_to_round)
        write_atomic(self.path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in self.rows))

    def append(self, row: dict[str, Any]) -> None:
        """One whole line or nothing: a write cut short (a full disk) is truncated away again, and
        any OS error is one line naming the file (:func:`~htfl_dist.atomic.os_errors`)."""
        data = (json.dumps(row, sort_keys=True) + "\n").encode()
        with os_errors(f"append a row to {self.path}", self.path, len(data)), \
                open(self.path, "ab", buffering=0) as handle:
            start = handle.seek(0, os.SEEK_END)
            try:
                written = 0
                while written < len(data):
                    written += handle.write(data[written:])
            except OSError:
                handle.truncate(start)
                raise
        self.rows.append(row)


def _check_required_rows(source: Path, rows: list[dict[str, Any]], required: list[int], up_to_round: int) -> None:
    missing = sorted(set(required) - {row["round"] for row in rows})
    if not missing:
        return
    state = ("is missing" if not source.exists() else "is empty" if source.stat().st_size == 0
             else "lacks them (cut or edited)")
    raise MetricsFileError(
        f"cannot resume after round {up_to_round}: {source} {state}, but the checkpoint vouches for the rows "
        f"of rounds {_rounds_text(missing)}; put the run's metrics.jsonl back, or start afresh with a new --out"
    )


def _rounds_text(rounds: list[int]) -> str:
    """1, 2, 3, 7 -> '1-3, 7' (at most a few ranges: the line stays short)."""
    ranges: list[list[int]] = []
    for number in rounds:
        if ranges and number == ranges[-1][1] + 1:
            ranges[-1][1] = number
        else:
            ranges.append([number, number])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges]
    return ", ".join(parts[:6]) + (", ..." if len(parts) > 6 else "")


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
