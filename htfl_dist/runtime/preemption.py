"""Graceful preemption: SIGTERM (what SLURM and torchrun send) ends the job at the next round
boundary with a checkpoint, so no finished round is lost.

The first SIGTERM only raises a flag; the round loop shares it with every rank at the end of
the round, all ranks checkpoint and exit. A second SIGTERM, or the grace period running out
(a rank stuck in a collective never reaches the boundary), exits at once. Under srun + torchrun
one request often arrives twice, a moment apart: SLURM signals every process of the step and
torchrun forwards its own copy to its workers. So a repeat within ``SAME_REQUEST_S`` of the first
counts as the same request.

Why a thread and not a Python signal handler: CPython runs handlers in the main thread, between
bytecodes. A main thread blocked inside a collective (Gloo retries its socket reads after EINTR)
never gets there, so the grace timer would start only when the collective returns — or never,
and the launcher's SIGKILL would end the rank without a word. Instead SIGTERM is blocked in every
thread (:func:`install` runs before torch starts any) and one listener thread takes it with
``sigwait``: the request is seen, announced and timed the moment it arrives.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

SAME_REQUEST_S = 5.0
DEFAULT_GRACE_S = 120.0


class PreemptionFlag:
    """What the round loop reads: has a SIGTERM arrived? One per process (see :func:`install`)."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.requested = False
        self.grace_s = grace_s
        self.job_failed: Callable[[], bool] | None = None
        """Set by the round loop: asked when SIGTERM arrives, since a launcher also sends it to
        tear down a job whose rank died. True (the lost rank already reported, by this rank or
        another): this rank exits with 1 at once instead of announcing a checkpoint that can
        never come; False: a real preemption."""
        self.run_over = False
        """Set once this rank's run has ended (finished or checkpointed): a SIGTERM then needs no
        announcement; the process is exiting anyway."""
        self._first_at = 0.0
        self._lock = threading.Lock()

    def on_signal(self, signum: int) -> None:
        """First request: raise the flag and start the grace timer; a later one: exit now."""
        with self._lock:
            if self.requested:
                if time.monotonic() - self._first_at < SAME_REQUEST_S:
                    return
                print("htfl_dist: second SIGTERM: exiting now, without a checkpoint of this round",
                      file=sys.stderr, flush=True)
                os._exit(128 + signum)
            self.requested = True
            self._first_at = time.monotonic()
        timer = threading.Timer(self.grace_s, _grace_over, args=(self.grace_s, signum))
        timer.daemon = True
        timer.start()  # the grace period counts from the signal
        # The probe takes seconds (it watches the heartbeats): not in the listener, which must
        # see a repeat at once to tell one request delivered twice from a second request.
        threading.Thread(target=self._announce, args=(signum,), name="htfl-sigterm-announce",
                         daemon=True).start()

    def _announce(self, signum: int) -> None:
        if self.job_failed is not None and self.job_failed():
            os._exit(1)
        if self.run_over:
            return
        print(f"htfl_dist: SIGTERM received: finishing this round, then checkpointing "
              f"(exiting anyway {self.grace_s:.0f} s after the signal)", file=sys.stderr, flush=True)


def _grace_over(grace_s: float, signum: int) -> None:
    print(f"htfl_dist: no round boundary within runtime.preempt_grace_s={grace_s:g} after SIGTERM: "
          f"exiting without a checkpoint of this round", file=sys.stderr, flush=True)
    os._exit(128 + signum)


_flag: PreemptionFlag | None = None


def install() -> PreemptionFlag:
    """Block SIGTERM in this thread (and so in every thread started after it) and take it in a
    listener thread. The program's entry point calls it first thing, in the main thread, before
    torch starts its threads; later calls return the same flag. Only the entry point: a process
    that merely imports the runtime (a test, a notebook) keeps its own SIGTERM behaviour, and
    the processes it starts do not inherit a blocked SIGTERM."""
    global _flag
    if _flag is None:
        flag = PreemptionFlag()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_listen, args=(flag,), name="htfl-sigterm", daemon=True).start()
        _flag = flag
    return _flag


def _listen(flag: PreemptionFlag) -> None:
    while True:
        flag.on_signal(signal.sigwait({signal.SIGTERM}))


def preemption_flag(grace_s: float) -> PreemptionFlag:
    """The process's flag, with the run's grace period; without :func:`install` (the loop driven
    from a test or a notebook) a flag that never rises."""
    flag = _flag if _flag is not None else PreemptionFlag()
    flag.grace_s = grace_s
    return flag
