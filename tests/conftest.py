"""Helpers to launch the real program the way users do: python -m, torchrun, mpirun."""
from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from htfl_dist.runtime.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMOKE = REPO / "configs" / "smoke.yaml"


def pytest_configure(config) -> None:
    # One intra-op thread in the test process too, as every run it launches has (OMP_NUM_THREADS=1,
    # runtime.threads=1): on the 2-core machines this suite runs on, torch's default of one thread
    # per core makes the in-process tests fight the ranks and any run beside them for the cores
    # (resnet152's three forward passes: 12 s with 2 threads under load, 1.3 s with one).
    import torch

    torch.set_num_threads(1)
    # The kernels every rank runs with (deterministic cuDNN and cuBLAS), set before any test starts
    # CUDA: cuBLAS reads its workspace setting once, and the GPU tests compare recorded and side-by-side
    # steps with one at a time, bit for bit. simulate() sets it too; here it holds from the first test on.
    from htfl_dist.runtime.bootstrap import make_deterministic

    make_deterministic()
    config.addinivalue_line("markers", "slurm: starts a throw-away SLURM cluster (root, slurm-wlm, munge); "
                                       "deselect with -m 'not slurm'")
    config.addinivalue_line("markers", "launch: starts the program in processes (python -m, torchrun, mpirun)")
    config.addinivalue_line("markers", "integration: plays whole runs in this process (runtime.simulate, "
                                       "htfl_dist.main.main); deselect with -m 'not integration'")


RUN_FIXTURES = frozenset({"single_run", "checkpointed", "two_rounds_then_resume", "fedtgp_run", "played"})
"""Fixtures that play whole runs in this process (shared between tests): a test using one is an
integration test whichever test happens to play the run first."""


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if RUN_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


_RUNNING_TEST: list = [None]
"""The test being run (its function-scoped part), so a launch can check how the test is marked."""


@pytest.fixture(autouse=True)
def _remember_running_test(request):
    _RUNNING_TEST[0] = request.node
    yield
    _RUNNING_TEST[0] = None


@pytest.fixture(autouse=True)
def _sigterm_unblocked_after_each_test():
    """``htfl_dist.main.main`` called in this process (the catalogue of bad inputs, the data-kind
    runs) blocks SIGTERM in this thread for its preemption listener, and a blocked signal is
    inherited by every process started later: torchrun or a study started by a later test would
    never see the SIGTERM the test sends. Each test ends with SIGTERM unblocked again."""
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


@pytest.fixture(autouse=True, scope="session")
def _whole_runs_are_marked():
    """Every whole run played in this process goes through ``Federation.run``: a test that plays
    one without the integration mark (or a launch or slurm mark) fails, naming itself, so the
    fastest tier (``-m "not launch and not slurm and not integration"``) stays maths alone."""
    from htfl_dist.runtime.loop import Federation

    original = Federation.run

    def run(self, *args, **kwargs):
        node = _RUNNING_TEST[0]
        if node is not None and not any(node.get_closest_marker(mark) for mark in ("integration", "launch", "slurm")):
            raise AssertionError(f"{node.nodeid} plays a whole run in this process: mark it @pytest.mark.integration")
        return original(self, *args, **kwargs)

    Federation.run = run
    yield
    Federation.run = original


def _require_launch_mark() -> None:
    """The quick tier (``-m "not launch and not slurm"``) must never start a process: a test that
    does without the mark fails here, naming itself."""
    node = _RUNNING_TEST[0]
    if node is not None and not (node.get_closest_marker("launch") or node.get_closest_marker("slurm")):
        raise AssertionError(f"{node.nodeid} starts the program in a process: mark it @pytest.mark.launch")


def _env(pythonpath: tuple[str, ...] = ()) -> dict[str, str]:
    _require_launch_mark()
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(REPO)])
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def launch(launcher: str, nproc: int, args: list[str], timeout: float = 300,
           pythonpath: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``htfl_dist.main`` under ``launcher`` (single | torchrun | mpirun) with ``nproc`` ranks
    (``pythonpath``: directories put before the repository on PYTHONPATH, e.g. a plugin's)."""
    program = ["-m", "htfl_dist.main", *args]
    if launcher == "single":
        command = [sys.executable, *program]
    elif launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *program]
    elif launcher == "mpirun":
        mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
        command = [mpirun, "-n", str(nproc), sys.executable, *program]
    else:
        raise ValueError(launcher)
    return subprocess.run(command, cwd=REPO, env=_env(pythonpath), capture_output=True, text=True, timeout=timeout)


def run_program(args: list[str]) -> subprocess.CompletedProcess:
    """``htfl_dist.main`` with ``args`` called in this process, as ``python -m htfl_dist.main``
    runs it without a launcher: its exit status and what it printed. For what one process shows
    (run directories, checkpoints, resumes, refusals) without a Python and torch start per run;
    :func:`launch` keeps what only separate processes show. The program blocks SIGTERM for its
    preemption listener; the mask is put back, so a process the test starts next still sees it."""
    from htfl_dist.main import main

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as exit_request:  # what the interpreter would turn into a status
                code = exit_request.code if isinstance(exit_request.code, int) else int(exit_request.code is not None)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return subprocess.CompletedProcess(["htfl_dist.main", *args], code, stdout.getvalue(), stderr.getvalue())


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_smoke(launcher: str, nproc: int, out: Path, cache_dir: Path, *overrides: str) -> list[dict]:
    """The smoke config under ``launcher`` with ``overrides``; must succeed; its metrics rows.
    ``single`` plays it in this process (``runtime.simulate``, the program's own loop without a
    process start, which the conformance launches hold equal to torchrun); the others launch."""
    if launcher == "single":
        return simulate(SMOKE, [f"data.cache_dir={cache_dir}", *overrides], out=out)
    result = launch(launcher, nproc, ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}",
                                      *overrides])
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(out)


TIMING_KEYS = {"seconds", "client_s", "comm_s", "server_s", "bytes_up", "bytes_down", "rank_idle_share"}
"""Wall times, and bytes, which carry one message header per client rank."""


def maths_only(rows: list[dict]) -> list[dict]:
    """Metrics rows without wall times and wire bytes: what must not depend on the world size."""
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One partition cache for the whole session, shared by pytest-xdist's workers (the first run
    builds each file; the cache writes atomically, so two builders of one file cannot clash)."""
    path = _shared_between_workers(tmp_path_factory) / "partition-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def single_run(tmp_path_factory, cache_dir):
    """One-process smoke runs shared by the whole session: ``single_run(*overrides)`` plays the
    smoke config with ``overrides`` in this process (``runtime.simulate``: the program's own round
    loop, config resolution and outputs, without a process start) the first time any test asks for
    those overrides, and returns its run directory and a fresh copy of its metrics rows to every
    test that asks for them. The conformance test and an algorithm's own
    tests often need the very same reference run; it is played once. The run directory is shared:
    read it, never write into it (resume into a directory of your own)."""
    runs: dict[tuple[str, ...], tuple[Path, list[dict]]] = {}
    shared = _shared_between_workers(tmp_path_factory) / "single-runs"
    shared.mkdir(exist_ok=True)

    def run(*overrides: str) -> tuple[Path, list[dict]]:
        keys = [override.split("=", 1)[0] for override in overrides]
        key = tuple(sorted(overrides)) if len(set(keys)) == len(keys) else overrides  # order matters on repeats
        if key not in runs:
            out = shared / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
            with open(f"{out}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another worker playing the same run: wait for it
                if not (out / "summary.json").is_file():
                    shutil.rmtree(out, ignore_errors=True)
                    simulate(SMOKE, [f"data.cache_dir={cache_dir}", *overrides], out=out)
            runs[key] = (out, read_metrics(out))
        out, rows = runs[key]
        return out, copy.deepcopy(rows)

    return run


def _shared_between_workers(tmp_path_factory) -> Path:
    """The session's temporary directory, or under pytest-xdist the one above every worker's:
    the suite's shared runs are played once for all workers, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
