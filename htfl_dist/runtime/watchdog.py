"""Round deadline: a rank that waits longer than ``runtime.round_deadline_s`` for a round (or the
start-up: data preparation, models, handshake) to end (a peer hung, a collective that never
completes: MPI has no timeout of its own) ends the whole job with a message naming itself and the
clients it hosts, instead of hanging forever."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

STARTUP = 0
"""The 'round' armed while the federation is set up (data preparation, models, handshake)."""


class RoundWatchdog:
    def __init__(self, deadline_s: float, where: str, abort: Callable[[int], None]) -> None:
        self._deadline_s, self._where, self._abort = deadline_s, where, abort
        self._round: int | None = None
        self._armed_at = 0.0
        self._lock = threading.Lock()
        if deadline_s > 0:
            threading.Thread(target=self._watch, name="htfl-round-watchdog", daemon=True).start()

    def name_as(self, where: str) -> None:
        """Say who this rank is once its clients are known (after the placement)."""
        with self._lock:
            self._where = where

    def arm(self, round_number: int) -> None:
        with self._lock:
            self._round, self._armed_at = round_number, time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            self._round = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self._deadline_s / 4))
            with self._lock:
                late = self._round is not None and time.monotonic() - self._armed_at > self._deadline_s
                round_number = self._round
            if late:
                what = "start-up" if round_number == STARTUP else f"round {round_number}"
                print(f"htfl_dist: {self._where}: {what} exceeded runtime.round_deadline_s="
                      f"{self._deadline_s:g}; a rank is hung or too slow: ending the job", file=sys.stderr, flush=True)
                try:
                    self._abort(1)
                finally:
                    os._exit(1)
