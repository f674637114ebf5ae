"""Counts what each process of a pfl comparison run does, from inside it: SGD steps actually
taken (every optimizer step, through torch's global step hook, so nothing in the model or the
training loop is changed), the wall time of the first one, and the process's peak RSS. Active
only when HTFL_PFL_BENCH_PROBE names a directory; each process writes ``probe-<pid>.json`` there
when it exits. Imported by our plugin (bench/pfl_workload.py), the bare loop and the pfl runner,
so the three sides are counted by the same code; stdlib and torch only (the pfl venv has no
htfl_dist)."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import time
from collections.abc import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

ENV = "HTFL_PFL_BENCH_PROBE"
_state: dict = {"steps": 0, "first_step": None, "excluded": set(), "installed": False, "gated": False, "open": 0}


def _count(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    if id(optimizer) in _state["excluded"] or (_state["gated"] and not _state["open"]):
        return
    if _state["first_step"] is None:
        _state["first_step"] = time.time()
    _state["steps"] += 1


def steps() -> int:
    """SGD steps this process has taken so far (0 when the probe is off)."""
    return int(_state["steps"])


def exclude(optimizer: torch.optim.Optimizer) -> None:
    """Do not count ``optimizer``'s steps (pfl's central optimizer applies the round's average
    with one SGD step: it is the aggregation, not a local step)."""
    _state["excluded"].add(id(optimizer))


def gate() -> None:
    """From now on count only the steps taken inside :func:`counting` (our engine also steps an
    optimizer at start-up, timing one SGD step per architecture to place clients by their work:
    that is no training step)."""
    _state["gated"] = True


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """The steps taken in this block are training steps (with :func:`gate`)."""
    _state["open"] += 1
    try:
        yield
    finally:
        _state["open"] -= 1


def _write(directory: str) -> None:
    record = {"pid": os.getpid(), "steps": _state["steps"], "first_step": _state["first_step"],
              # ru_maxrss is in KiB on Linux
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    path = os.path.join(directory, f"probe-{os.getpid()}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)  # never a half-written record


def install() -> bool:
    """Start counting in this process if HTFL_PFL_BENCH_PROBE is set (idempotent); whether it is."""
    directory = os.environ.get(ENV)
    if not directory:
        return False
    if not _state["installed"]:
        _state["installed"] = True
        register_optimizer_step_post_hook(_count)
        atexit.register(_write, directory)
    return True
