"""Find out who we are (rank, world, local rank), pin a device, open the transport.

Launchers, in the order they are recognised:

1. torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``);
2. ``mpirun``/``mpiexec`` (``PMI_RANK``/``PMI_SIZE`` of MPICH's Hydra, ``OMPI_COMM_WORLD_*``
   of Open MPI, ``PMIX_RANK``): mpi4py provides rank and world;
3. SLURM ``srun`` without torchrun (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``; the
   sbatch script exports ``MASTER_ADDR``/``MASTER_PORT``);
4. nothing: world size 1, server and every client in this process.

Rank 0 also locks the run directory (``lock_run_directory``) for the run's life, and every rank
learns whether rank 0 let the run go ahead (``agree_to_start``) before it touches anything.
"""
from __future__ import annotations

import errno
import fcntl
import importlib.metadata
import json
import os
import platform
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from htfl_dist.atomic import os_errors
from htfl_dist.config import RuntimeConfig
from htfl_dist.errors import ConfigError, HtflError, RefusedByRank0
from htfl_dist.runtime.liveness import Liveness, StoreAddress
from htfl_dist.runtime.supervisor import MPI_RANK_VARS
from htfl_dist.runtime.transport import LocalTransport, MPITransport, TorchTransport, Transport
from htfl_dist.runtime.wire import BROADCAST_ENTRY, Field, decode, encode


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # torchrun | mpi | slurm | single
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def make_deterministic() -> None:
    """Bitwise-repeatable runs on GPU too: deterministic cuDNN/cuBLAS kernels (a few percent
    slower, and the price of comparing world sizes, resumed runs, recorded and side-by-side
    steps exactly). Every run takes it: the program before CUDA starts, ``simulate`` as well.
    cuBLAS reads its workspace setting when it first starts, so a process that used cuBLAS before
    this keeps what it had (the test suite sets it at its own start)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def software_versions() -> dict[str, str | dict[str, str]]:
    """The installed versions that decide a run's numbers, for summary.json: the engine, Python,
    torch and friends, and every plugin module loaded (with its package's version)."""
    import h5py
    import numpy

    from htfl_dist import __version__
    from htfl_dist.resolution import plugin_versions

    # torchvision's version from its installed metadata: importing it costs 1.5 s, and a run of
    # HtCNN members never needs it.
    versions: dict[str, str | dict[str, str]] = {
        "htfl_dist": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "torchvision": importlib.metadata.version("torchvision"), "numpy": numpy.__version__,
        "h5py": h5py.__version__}
    plugins = plugin_versions()
    return {**versions, "plugins": plugins} if plugins else versions


def _int_env(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise HtflError(f"environment variable {name} is not set; launch with torchrun, srun or mpirun")
        return default
    return int(value)


def _is_srun_task(env: os._Environ | dict[str, str]) -> bool:
    """A task of a multi-task srun step. The step variables matter: a batch script (or an
    salloc shell) also carries SLURM_PROCID=0 and SLURM_NTASKS=N, and a plain
    ``python -m htfl_dist.main`` run there is one process, not rank 0 of N."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return False
    try:
        return int(env["SLURM_STEP_NUM_TASKS"]) > 1
    except ValueError:
        return False


def detect_launch() -> LaunchInfo:
    """Rank and world from the launcher's environment (no communication yet)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int_env("WORLD_SIZE")
        return LaunchInfo("torchrun", _int_env("RANK"), world, _int_env("LOCAL_RANK", 0),
                          _int_env("LOCAL_WORLD_SIZE", world))
    if any(name in env for name in MPI_RANK_VARS):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        return LaunchInfo("mpi", comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size())
    if _is_srun_task(env):
        return LaunchInfo("slurm", _int_env("SLURM_PROCID"), _int_env("SLURM_STEP_NUM_TASKS"),
                          _int_env("SLURM_LOCALID", 0), _int_env("SLURM_NTASKS_PER_NODE", 1))
    return LaunchInfo("single", 0, 1, 0, 1)


def launch_rank_hint() -> int:
    """Best guess of this process's rank before any communication (to print errors once)."""
    for name in ("RANK", *MPI_RANK_VARS, "SLURM_PROCID"):
        if name in os.environ:
            try:
                return int(os.environ[name])
            except ValueError:
                return 0
    return 0


def pick_device(runtime: RuntimeConfig, launch: LaunchInfo) -> torch.device:
    """``cuda:LOCAL_RANK`` (modulo the GPUs present) when GPUs exist, else CPU; with
    ``runtime.gpu_memory_gib`` the allocator is capped there."""
    available = runtime.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() > 0
    if runtime.device == "cuda" and not available:
        raise ConfigError("runtime.device=cuda but no GPU is visible; use runtime.device=auto or cpu")
    if not available:
        if runtime.gpu_memory_gib:
            raise ConfigError(f"runtime.gpu_memory_gib={runtime.gpu_memory_gib:g} caps GPU memory, but this rank "
                              f"computes on the CPU; leave it at 0")
        return torch.device("cpu")
    index = launch.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    if runtime.gpu_memory_gib:
        cap_allocator(index, runtime.gpu_memory_gib)
    return torch.device("cuda", index)


def gpu_memory_gib(index: int) -> float:
    """Total memory of CUDA device ``index`` (numbered as this process sees them), in GiB."""
    return torch.cuda.get_device_properties(index).total_memory / 2**30


def cap_allocator(index: int, gib: float) -> None:
    """PyTorch's caching allocator on device ``index`` holds at most ``gib`` GiB (a share of the
    device's memory; refused when the device has less)."""
    total_gib = gpu_memory_gib(index)
    if gib > total_gib:
        raise ConfigError(f"runtime.gpu_memory_gib={gib:g} but GPU {index} has {total_gib:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib / total_gib, index)


def pick_backend(runtime: RuntimeConfig, launch: LaunchInfo, device: torch.device) -> str:
    """NCCL only when every rank on the node owns a GPU; MPI under mpirun; Gloo otherwise."""
    if launch.world_size == 1:
        return "local"
    if runtime.backend != "auto":
        backend = runtime.backend
    elif launch.launcher == "mpi":
        backend = "mpi"
    elif device.type == "cuda" and torch.cuda.device_count() >= launch.local_world_size:
        backend = "nccl"
    else:
        backend = "gloo"
    if backend == "nccl" and (device.type != "cuda" or torch.cuda.device_count() < launch.local_world_size):
        raise ConfigError(
            f"runtime.backend=nccl needs one GPU per rank ({launch.local_world_size} ranks on this node, "
            f"{torch.cuda.device_count()} GPUs); use runtime.backend=gloo"
        )
    if backend == "mpi" and launch.launcher != "mpi":
        raise ConfigError("runtime.backend=mpi needs the job to be started by mpirun/mpiexec")
    return backend


def _mpi_rendezvous_for_torch() -> tuple[str, int]:
    """Under mpirun with backend gloo/nccl: use MPI once to agree on the TCP store rank 0 serves."""
    import socket

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        address = (socket.gethostbyname(socket.gethostname()), port)
    return comm.bcast(address, root=0)  # start-up only, never in the round loop


def store_address(launch: LaunchInfo) -> StoreAddress:
    """Where this launch's rendezvous store is, who serves it, and the key prefix of this attempt
    (after an elastic restart the new workers must not read the dead attempt's addresses)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"htfl_dist/attempt_{attempt}"
    if launch.launcher == "mpi":
        host, port = _mpi_rendezvous_for_torch()
        return StoreAddress(host, port, hosted_by_rank0=True, prefix=prefix)
    if launch.launcher == "slurm":
        if "MASTER_ADDR" not in os.environ:
            raise HtflError("under srun without torchrun, export MASTER_ADDR (the first node's host name)")
        os.environ.setdefault("MASTER_PORT", "29500")
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return StoreAddress(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        hosted_by_rank0=not agent_serves, prefix=prefix)


def open_transport(runtime: RuntimeConfig, launch: LaunchInfo, device: torch.device) -> Transport:
    transport = _open_transport(runtime, launch, device)
    transport.max_message_bytes = int(runtime.max_message_mb * (1 << 20))
    return transport


def _open_transport(runtime: RuntimeConfig, launch: LaunchInfo, device: torch.device) -> Transport:
    backend = pick_backend(runtime, launch, device)
    if backend == "local":
        return LocalTransport()
    if backend == "mpi":
        from mpi4py import MPI

        return MPITransport(MPI.COMM_WORLD)
    comm_device = device if backend == "nccl" else torch.device("cpu")
    return TorchTransport(backend, launch.rank, launch.world_size, comm_device, runtime.timeout_s,
                          store_address(launch))


def open_liveness(runtime: RuntimeConfig, transport: Transport) -> Liveness | None:
    """Heartbeats through the job's store (Gloo/NCCL only; MPI has none); None when switched off
    (runtime.heartbeat_timeout_s=0) or alone."""
    address = getattr(transport, "address", None)
    if address is None or runtime.heartbeat_timeout_s <= 0:
        return None
    return Liveness(address, transport.rank, transport.world_size, runtime.heartbeat_timeout_s)


# --------------------------------------------------------------------------- one writer per run directory

LOCK_FILE = ".htfl_dist.lock"
"""In the run directory; holds the holder's host, pid and start time while a run owns the directory."""


class RunDirectoryLock:
    """An exclusive ``fcntl`` (POSIX record) lock on ``RUN/.htfl_dist.lock``, held by rank 0 from
    start-up to exit. The kernel drops it when the process ends, however it ends (kill -9, a node
    reboot for NFS's lock manager), so a lock left by a dead run never blocks the next one; the
    file itself stays. POSIX locks work across the nodes of an NFS mount, which ``flock`` does
    not on every system. They belong to the process and end when it closes *any* descriptor of
    the file, so nothing else in the holding process may open it."""

    def __init__(self, fd: int, directory: Path) -> None:
        self._fd: int | None = fd
        self.directory = directory
        self._previous_record = b""

    def record_holder(self) -> None:
        """Write who holds the directory (host, pid, start time), for a second run's line."""
        holder = {"host": platform.node(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        assert self._fd is not None, "the lock is held"
        self._previous_record = os.pread(self._fd, 4096, 0)
        self._write(json.dumps(holder).encode() + b"\n")

    def withdraw_record(self) -> None:
        """Put back the record this run replaced: a start refused after the directory was taken
        (a checkpoint of another experiment, metrics rows missing) leaves every byte as it was.
        The record only matters while the lock is held, so which one stays is otherwise moot."""
        if self._fd is not None:
            self._write(self._previous_record)

    def _write(self, record: bytes) -> None:
        assert self._fd is not None, "the lock is held"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, record, 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DirectoryInUse(HtflError):
    """``lock_run_directory`` refused: a live process holds the lock; ``holder`` says which."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


def lock_run_directory(directory: Path, what: str = "run") -> RunDirectoryLock:
    """Take ``directory``'s lock (the directory must exist), or raise one HtflError line naming the
    run that holds it (``DirectoryInUse``). ``what`` names the directory in that line: a study
    (``python -m htfl_dist.study``) locks its DIR with this very lock, ``what="study"``."""
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd)
        os.close(fd)
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise DirectoryInUse(f"{what} directory {directory} is in use by {holder}; wait for that {what} to end "
                                 f"(or stop it), or pass a new --out", holder) from None
        raise HtflError(f"cannot lock the {what} directory {directory} ({exc.strerror}): its file system has no "
                        f"working fcntl locks; pass an --out on one that has") from None
    return RunDirectoryLock(fd, directory)


def _holder(fd: int) -> str:
    """'pid P on host H (started T)' from the lock file, or what is known of it."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {int(record['pid'])} on host {str(record['host'])[:100]} (started {str(record['started'])[:40]})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it is still starting)"


_FIX = "pass a new --out"


def check_run_directory(directory: Path, files: dict[str, str] | None = None) -> None:
    """Rank 0, after taking the lock and before writing anything (the lock's record included):
    every entry the run will write is of its kind, so that a run which would fail rounds later,
    on its first metrics row or its first checkpoint, is refused now with one line and nothing
    changed. metrics.jsonl, summary.json, config.yaml and ``files`` (name: what the run keeps
    there), which the run rewrites by rename, reads back or removes, must be regular files;
    ``checkpoints/`` a directory the run can list and create files in (a probe file, removed
    again), whatever checkpoint_every says: a SIGTERM saves a checkpoint in any run. A failing OS
    call is an ``OutputError`` naming path, operation and errno."""
    from htfl_dist.metrics.report import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
    from htfl_dist.runtime.checkpoint import CHECKPOINT_DIR  # here: the lock alone needs no torch models

    run_files = {METRICS_FILE: "its metrics rows", SUMMARY_FILE: "its summary", CONFIG_FILE: "its resolved config"}
    for name, role in {**run_files, **(files or {})}.items():
        _check_kind(directory, name, role, "regular file")
    checkpoints = directory / CHECKPOINT_DIR
    if _check_kind(directory, CHECKPOINT_DIR, "its checkpoints", "directory"):
        hint = f"make it writable (the run keeps its checkpoints there), or {_FIX}"
        with os_errors(f"list the directory {checkpoints}", checkpoints, hint=hint):
            os.listdir(checkpoints)
        with os_errors(f"create a file in {checkpoints}", checkpoints, hint=hint):
            fd, probe = tempfile.mkstemp(dir=checkpoints, prefix=".write-test.")
            os.close(fd)
            os.unlink(probe)


def _check_kind(directory: Path, name: str, role: str, wanted: str) -> bool:
    """Whether ``directory/name`` exists; refused (one line) when it is not a ``wanted``."""
    path = directory / name
    with os_errors(f"inspect {path}", path, hint=_FIX):
        kind = _kind_of(path)
    if kind is not None and kind != wanted:
        raise HtflError(f"run directory {directory}: {name} is a {kind}, not a {wanted}; the run keeps {role} "
                        f"there: move it away, or {_FIX}")
    return kind is not None


def _kind_of(path: Path) -> str | None:
    """What ``path`` names, symbolic links followed ('regular file', 'directory', ...); None: nothing
    (a dangling link too: the run replaces or follows it, as it would create the file)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    kinds = ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "named pipe"),
             (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
    return next((kind for test, kind in kinds if test(mode)), "special file")


VERDICT_SPEC = (Field("refused", torch.int64),)


def agree_to_start(transport: Transport, refusal: HtflError | None) -> None:
    """Rank 0 tells every rank whether it accepted the run directory (``refusal`` is its reason
    not to, None on the other ranks); all raise together, rank 0 its reason, the others a
    ``RefusedByRank0`` that prints nothing, so a refused run is one line and nobody has touched
    a file. One broadcast at start-up."""
    if transport.world_size > 1:
        verdict = {BROADCAST_ENTRY: {"refused": torch.tensor([int(refusal is not None)])}}
        message = transport.broadcast(encode(VERDICT_SPEC, verdict) if transport.rank == 0 else None)
        if transport.rank != 0 and bool(decode(VERDICT_SPEC, message)[BROADCAST_ENTRY]["refused"][0]):
            raise RefusedByRank0("rank 0 refused to start; its line says why")
    if refusal is not None:
        raise refusal
