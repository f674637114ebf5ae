"""Graceful preemption: SIGTERM (what SLURM and torchrun send) ends the job at the next round
boundary with a checkpoint, so no finished round is lost.

The first SIGTERM only raises a flag; the round loop shares it with every rank at the end of
the round, all ranks checkpoint and exit. A second SIGTERM, or the grace period running out
(a rank stuck in a collective never reaches the boundary), exits at once. Under srun + torchrun
one request often arrives twice, a moment apart: SLURM signals every process of the step and
torchrun forwards its own copy to its workers. So a repeat within ``SAME_REQUEST_S`` of the first
counts as the same request.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

SAME_REQUEST_S = 5.0


class PreemptionFlag:
    def __init__(self, grace_s: float) -> None:
        self.requested = False
        self._grace_s = grace_s
        self._first_at = 0.0
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            if time.monotonic() - self._first_at < SAME_REQUEST_S:
                return
            print("htfl_dist: second SIGTERM: exiting now, without a checkpoint of this round",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = True
        self._first_at = time.monotonic()
        print(f"htfl_dist: SIGTERM received: finishing this round, then checkpointing "
              f"(exiting anyway in {self._grace_s:.0f} s)", file=sys.stderr, flush=True)
        timer = threading.Timer(self._grace_s, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()
