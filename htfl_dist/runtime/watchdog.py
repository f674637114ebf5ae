"""Round deadline: a rank that waits longer than ``runtime.round_deadline_s`` for a round (or the
start-up: data preparation, models, handshake) to end (a peer hung, a collective that never
completes: MPI has no timeout of its own) ends the whole job with a message naming itself and the
clients it hosts, and the rank it was waiting for, instead of hanging forever.

Rank 0 knows best whom the job waits for (it receives from each client rank in turn), so the
client ranks give it ``CLIENT_DELAY_S`` more before they speak: under MPI the first rank to
abort ends the job, and its line is the one that reaches the user."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

CLIENT_DELAY_S = 5.0

STARTUP = 0
"""The 'round' armed while the federation is set up (data preparation, models, handshake)."""


class RoundWatchdog:
    def __init__(self, deadline_s: float, where: str, abort: Callable[[int], None],
                 waiting_for: Callable[[], str] = lambda: "", delay_s: float = 0.0) -> None:
        """``waiting_for()``: who this rank is blocked on now ('' if nobody); ``delay_s``: extra
        seconds before this rank speaks (client ranks let rank 0 go first)."""
        self._deadline_s, self._where, self._abort = deadline_s, where, abort
        self._waiting_for, self._delay_s = waiting_for, delay_s
        self._round: int | None = None
        self._stopped = False
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

    def stop(self) -> None:
        """The run is over, finished or failed: never fire again. A run that raised inside a
        longer-lived process (a test, a notebook) would otherwise leave its watchdog armed, and
        ``runtime.round_deadline_s`` later it would end that process with exit status 1."""
        with self._lock:
            self._round = None
            self._stopped = True

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self._deadline_s / 4))
            with self._lock:
                if self._stopped:
                    return
                late = (self._round is not None
                        and time.monotonic() - self._armed_at > self._deadline_s + self._delay_s)
                round_number = self._round
            if late:
                what = "start-up" if round_number == STARTUP else f"round {round_number}"
                waiting = self._waiting_for()
                blamed = f"it was waiting for {waiting}" if waiting else "a rank is hung or too slow"
                print(f"htfl_dist: {self._where}: {what} exceeded runtime.round_deadline_s="
                      f"{self._deadline_s:g}; {blamed}: ending the job", file=sys.stderr, flush=True)
                try:
                    self._abort(1)
                finally:
                    os._exit(1)
