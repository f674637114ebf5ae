"""The conformance kit's runs (``htfl_dist.testing`` re-exports what a plugin uses): the checks'
small run as arguments, played in this process or launched on torchrun ranks, and the comparison
of one process with several ranks. Kept apart from the one-round checks so either reads alone."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from htfl_dist.algorithms import get_algorithm
from htfl_dist.algorithms.registry import ConformanceHints
from htfl_dist.payload import PayloadSpec
from htfl_dist.runtime.wire import decode


class PlayedRound(Protocol):
    """What the bytes check reads of the kit's played round (``testing.PlayedRound``); a
    protocol, so that this module does not import the kit that imports it."""

    algorithm: str
    session: Any
    message: Any
    theory_floats: dict[int, int]

SMALL_RUN: tuple[str, ...] = (
    "seed=0", "num_clients=6", "join_ratio=1.0", "eval_every=1", "checkpoint_every=0",
    "data.dataset=fmnist", "data.partition=dirichlet", "data.beta=0.1", "data.subsample=0.02",
    "data.min_samples_per_client=20", "model.group=HtCNN8", "model.feature_dim=512",
    "train.batch_size=10", "train.lr=0.01", "train.local_epochs=1", "runtime.threads=1",
)
"""The checks' run when no config file is given: configs/smoke.yaml written as overrides (a
plugin has no copy of the repository's configs/). It reads Fashion-MNIST from its default root
(``launch/setup_env.sh`` installs it); pass ``overrides`` to run on something else."""

ROUNDS = 2
TIMING_KEYS = frozenset({"seconds", "client_s", "comm_s", "server_s", "rank_idle_share"})
"""Metrics keys that are wall times, which differ from run to run."""


class ConformanceError(AssertionError):
    """An algorithm breaks a contract of the interface; the message names the algorithm."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def hints(name: str) -> ConformanceHints:
    return get_algorithm(name).conformance


def run_overrides(name: str) -> list[str]:
    """``algorithm=NAME``, ``rounds=2`` and the algorithm's own ``ConformanceHints.overrides``:
    every run of the checks, on top of the config (``SMALL_RUN`` without one)."""
    return [f"algorithm={name}", f"rounds={ROUNDS}", *hints(name).overrides]


def run_arguments(name: str, config_file: str | os.PathLike | None, overrides: Sequence[str]) -> list[str]:
    """Every run of the checks: one thread per process whatever the config says (SMALL_RUN has it), as the launched
    ranks have (OMP_NUM_THREADS=1): another thread count sums floats in another order, and the
    one-process run would then differ from the 3-rank run in the last digits."""
    return [*(SMALL_RUN if config_file is None else ("runtime.threads=1",)), *run_overrides(name), *overrides]




def play_run(name: str, out_dir: str | os.PathLike, *, config_file: str | os.PathLike | None = None,
             overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The checks' two-round run of ``name`` played in this process (``runtime.simulate``: the
    program's own round loop and outputs, without a process start); its metrics rows."""
    from htfl_dist.runtime.simulate import simulate

    return simulate(config_file, run_arguments(name, config_file, overrides), out=out_dir)


def launch_env() -> dict[str, str]:
    """The environment of a launch: this one, one intra-op thread per rank, no rank variables
    inherited, and this process's import path (what imports here, a plugin included, imports there)."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    paths = [path for path in sys.path if path and Path(path).is_dir()]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, *filter(None, env.get("PYTHONPATH", "").split(
        os.pathsep))]))
    return env


def launch_run(name: str, out_dir: str | os.PathLike, *, nproc: int = 3, config_file: str | os.PathLike | None = None,
               overrides: Sequence[str] = (), imports: Sequence[str] = (), env: Mapping[str, str] | None = None,
               timeout: float = 600) -> list[dict[str, Any]]:
    """The checks' two-round run of ``name`` on ``nproc`` torchrun ranks over Gloo
    (``torchrun --standalone -m htfl_dist.main``, the torchrun next to this Python); its metrics
    rows. ``imports``: modules each rank imports first (``--import``), for an algorithm that an
    installed plugin's entry point does not register; ``env``: the launch's environment
    (default ``launch_env()``)."""
    from htfl_dist.metrics.writer import read_rows

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        raise ConformanceError("torchrun is not installed next to this Python or on PATH")
    out = Path(out_dir)
    command = [torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", "htfl_dist.main",
               *(["--config", str(config_file)] if config_file is not None else []), "--out", str(out),
               *[argument for module in imports for argument in ("--import", module)],
               *run_arguments(name, config_file, overrides), "runtime.backend=gloo", "runtime.device=cpu"]
    result = subprocess.run(command, env=dict(env) if env is not None else launch_env(), capture_output=True,
                            text=True, timeout=timeout)
    require(result.returncode == 0, f"{name} on {nproc} torchrun ranks exited with {result.returncode}:\n"
                                     f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return read_rows(out / "metrics.jsonl")


def _maths(row: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics row without wall times and measured bytes: what must not depend on the world size."""
    return {key: value for key, value in row.items()
            if key not in TIMING_KEYS and not (key.startswith("bytes_") and "theory" not in key)}


def check_world_size_invariance(single: Sequence[Mapping[str, Any]], spread: Sequence[Mapping[str, Any]], *,
                                ranks: int = 3, name: str = "") -> None:
    """The rows of one process (``single``) and of ``ranks`` ranks (``spread``) are equal in every
    key but wall times and measured bytes (the maths, the algorithm's diagnostics, the papers'
    counts), and each measured upload (``bytes_up``, ``bytes_setup_up``) differs by the entry
    count of one message per further rank at most (8 bytes each)."""
    label = name or "the algorithm"
    require(len(single) == len(spread) > 0,
             f"{label}: {len(single)} rows in one process, {len(spread)} on {ranks} ranks")
    for one, many in zip(single, spread, strict=True):
        left, right = _maths(one), _maths(many)
        for key in sorted(left.keys() | right.keys()):
            require(left.get(key) == right.get(key), f"{label}: round {one.get('round')}: {key} is {left.get(key)!r} "
                                                      f"in one process, {right.get(key)!r} on {ranks} ranks")
        for key in ("bytes_up", "bytes_setup_up"):
            if key in one or key in many:
                extra = many.get(key, 0) - one.get(key, 0)
                require(0 <= extra <= 8 * (ranks - 1),
                         f"{label}: round {one.get('round')}: {key} is {one.get(key)} in one process and "
                         f"{many.get(key)} on {ranks} ranks; they may differ by one message header per rank")


# --------------------------------------------------------------------------- bytes against theory


def framing_bytes(spec: PayloadSpec) -> int | None:
    """The most bytes one client's upload adds to the paper's count: its share of the message
    header (the message's entry count, at most one message per client, its id and one row count
    per field) and every field that is not floats (class ids, counts), at ``max_rows``. None
    when such a field declares no ``max_rows``."""
    total = 8 * (2 + len(spec))
    for field in spec:
        if field.dtype.is_floating_point:
            continue
        if field.max_rows is None:
            return None
        total += field.max_rows * field.row_bytes()
    return total


def check_bytes_against_theory(played: PlayedRound, rows: Sequence[Mapping[str, Any]]) -> None:
    """The floats each client of the played round uploads are exactly the paper's count
    (4 bytes each, ``theory_upload_floats``), and every round of the two-round run (``rows``, its
    metrics) measured ``bytes_up`` between ``bytes_theory_up`` and that plus the framing of one
    upload per client (``framing_bytes``); an algorithm that uploads nothing measures 0."""
    name, session = played.algorithm, played.session
    for client_id, upload in decode(session.upload_spec, played.message).items():
        floats = sum(tensor.numel() * tensor.element_size() for tensor in upload.values()
                     if tensor.is_floating_point())
        counted = 4 * played.theory_floats[client_id]
        require(floats == counted, f"{name}: client {client_id} uploads {floats} bytes of floats; the paper's count "
                                    f"(theory_upload_floats) is {counted} bytes")
    framing = framing_bytes(session.upload_spec)
    if framing is None:
        raise ConformanceError(f"{name}: an upload field that is not floats declares no max_rows")
    most = session.config.num_clients * framing
    require(len(rows) > 0, f"{name}: the run wrote no metrics rows")
    for row in rows:
        measured, theory = row["bytes_up"], row["bytes_theory_up"]
        if not session.upload_spec:
            require(measured == 0 and theory == 0, f"{name} declares no upload but round {row['round']} "
                                                    f"measured {measured} bytes (theory {theory})")
            continue
        require(theory <= measured <= theory + most,
                 f"{name}: round {row['round']} sent {measured} bytes; the paper's count is {theory} and the "
                 f"framing of {session.config.num_clients} uploads at most {most}")
