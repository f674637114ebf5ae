"""Linux's parent-death signal, for the two places a process must not outlive its parent: a
study's cell (``htfl_dist.study.leader``) and an MPI rank's worker under its supervisor
(``htfl_dist.runtime.liveness``). Standard library only: the study's cell leader imports it
before it becomes the run, by path, without the package's dependencies."""
from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1


def ask_for_parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)`` (``exec`` keeps it); False where the system has none
    (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
