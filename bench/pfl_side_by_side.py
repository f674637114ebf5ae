"""pfl-research beside htfl_dist on pfl's own CIFAR-10 benchmark workload (issue 45, item 8), all
sides paired in one invocation on one machine, one thread each:

- ``pfl``   Apple's pfl 0.6.0 in its own venv (bench/pfl_setup.sh), bench/pfl_runner.py;
- ``pfl2``  the same with 2 worker processes (torchrun, gloo: pfl splits each cohort by worker);
- ``bare``  a plain PyTorch loop doing exactly our run's SGD steps (bench/pfl_bare.py): the floor;
- ``ours``  ``python -m htfl_dist.main`` in one process, the workload as a plugin (bench/pfl_workload.py);
- ``ours2`` ours with 2 training workers: torchrun, 3 ranks (rank 0 server, 2 client ranks);
- ``ours2h`` ours with 2 training workers in 2 processes: torchrun, 2 ranks, rank 0 serving and
  training (``runtime.server_hosts_clients=true``), as pfl2's two workers.
Both multi-rank sides pre-sum (``runtime.presum_uploads=true``): each rank adds its clients'
models in exact fixed point and sends rank 0 one sum, as pfl's workers all-reduce one.

Workload (pfl's benchmarks/image_classification/configs/baseline.yaml, apple/pfl-research
c9d1f32f6e84): 1,000 clients, 50 sampled a round, 50 samples each, local batch 10, one local
epoch (250 SGD steps a round), local SGD at 0.1, FedAvg (uniform mean), pfl's 2-conv + 2-dense
CNN, CIFAR-shaped generated pictures (nothing downloaded). Per side: seconds a round (median over
``--rounds`` timed rounds after ``--warmup`` rounds), SGD steps a round as counted inside every
process (bench/pfl_probe.py), start-up (launch to the first SGD step), peak RSS summed over the
side's processes, and the ratios ours/pfl and ours/bare. Every side plays warmup + rounds + 1
rounds; the last is not timed (ours evaluates every client on its last round; on the others it
tests one client, since its metrics row, which holds the round's seconds, is written on
evaluation rounds only). When ``bare`` and
``ours`` both run, their global models after round 1 are compared (same data, clients, initial
weights and dropout seeds: equal within float tolerance) and their step totals must be equal;
the exit status is 1 when they are not or a side fails.

By default the sides run one after another, so a VM whose speed drifts (here up to 40 % within
minutes) skews their ratios. ``--lockstep`` (the sides pfl, pfl2, bare, ours and ours2h; ours2
is refused, exit status 2) starts them one after another, each start-up alone, and keeps them
alive: each waits at a gate (bench/pfl_gate.py: two named pipes a side under WORK/gate/SIDE,
named in HTFL_PFL_BENCH_GATE, which torchrun's workers reach too; rank 0 alone talks to it)
before every round, and the driver lets one side play one round at a time, round r in the sides'
order rotated by r, so round k of every side runs seconds from round k of the others. A round's
time is then measured by the driver, from the go it writes to the side's done (its exit, for the
last round): the same clock for every side and never the wait at the gate. Where each side waits
and what its round covers: bare, before each round's loop, done where its clock stops; pfl and
pfl2, in ``RoundClock`` (``on_train_begin``, then ``after_central_iteration``: one iteration's
end to the next), pfl2's rank 1 held at a ``torch.distributed`` barrier that both workers meet
after rank 0's go; ours and ours2h, in the plugin server's ``download`` on rank 0, before the
knowledge is broadcast (ours2h's rank 1 waits for the broadcast), done at the next download: one
broadcast to the next, a whole turn of the engine's loop (a plugin cannot add a round observer).
The sides' own seconds are kept (``own_round_seconds``; ours' include the wait, the gate being
inside its round); start-up is launch to the first SGD step less the wait before round 1; peak
memory stays per side (each side's process tree). Besides each side's median the report gives the
paired per-round ratios (ours/bare, ours/pfl, bare/pfl, ours2h/pfl2, pfl2/pfl, ours2h/ours) of the
timed rounds, their median and min..max. A side that dies, or is silent for GATE_TIMEOUT_S, is
taken out of the rotation and fails; the rest go on.

    bash bench/pfl_setup.sh                      # once: pfl's venv
    python bench/pfl_side_by_side.py --out pfl.json
    python bench/pfl_side_by_side.py --sides bare,ours --rounds 2 --warmup 1 --clients 100
    python bench/pfl_side_by_side.py --lockstep --sides pfl,bare,ours --out pfl-lockstep.json
    python bench/pfl_side_by_side.py --lockstep --sides pfl2,ours2h --out pfl-lockstep2.json
    # on a GPU machine without network (the GPU suite's step 6): pfl from unpacked wheels
    python bench/pfl_side_by_side.py --lockstep --sides pfl,bare,ours --device cuda \
        --pfl-python python3 --pfl-path SITE
"""
from __future__ import annotations

import argparse
import json
import math
import os
import select
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SIDES = ("pfl", "pfl2", "bare", "ours", "ours2", "ours2h")
LOCKSTEP_SIDES = ("pfl", "pfl2", "bare", "ours", "ours2h")
"""The sides ``--lockstep`` holds: one round loop each, or (pfl2, ours2h) one a rank, rank 0's at
the gate and the other rank held by it (ours2, 3 ranks, is not measured in lockstep)."""
GATE_ENV = "HTFL_PFL_BENCH_GATE"
"""bench/pfl_gate.py's variable: ``ROUNDS,DIR``, DIR holding the side's two named gate pipes."""
GATE_GO, GATE_SAY = "go", "say"
"""The named pipes' names (bench/pfl_gate.py's GO and SAY): the driver's lines, the side's."""
GATE_TIMEOUT_S = 1800.0
"""Longest the lockstep driver waits for one line of a side (a start-up, a round) before it
gives that side up: far above a full-size round, below our run's round watchdog (3600 s)."""
EXIT_GRACE_S = 5.0
"""How long a side given up may take to exit by itself before it is killed."""
PAIRS = (("ours/bare", "ours", "bare"), ("ours/pfl", "ours", "pfl"), ("bare/pfl", "bare", "pfl"),
         ("ours2h/pfl2", "ours2h", "pfl2"), ("pfl2/pfl", "pfl2", "pfl"), ("ours2h/ours", "ours2h", "ours"))
"""The paired per-round ratios ``--lockstep`` reports."""
PFL_VENV_ENV = "HTFL_PFL_VENV"
DEFAULT_PFL_VENV = Path.home() / ".cache" / "htfl_dist" / "pfl-venv"
"""bench/pfl_setup.sh's default."""
DEFAULT_WORK = Path.home() / ".cache" / "htfl_dist" / "pfl-bench"
"""Beside the engine's venv and partition caches: the generated pictures and their partition
cache are built once and reused by later invocations (so start-up times never include them)."""
TOLERANCE = 1e-5
"""Largest |ours − bare| allowed in the global model after round 1: float32 sums of 50 models in
another order (ours averages in float64) differ by ~1e-7; a wrong step, sample or seed by ~1e-3."""
PFL_SOURCE = "apple/pfl-research c9d1f32f6e84 (benchmarks/image_classification/configs/baseline.yaml)"


class UsageError(Exception):
    """Bad command-line input: one line, exit status 2."""


# --------------------------------------------------------------------------- measuring a side


def _children_of() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def _peak_rss(pid: int) -> int | None:
    """The process's high-water RSS in bytes (VmHWM), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class TreeMemory:
    """Polls the peak RSS of a process and all its descendants (launchers included) while it runs;
    each process's own figure at exit (the probe's) replaces its last polled one when larger."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.root, self.period_s = pid, period_s
        self.peaks: dict[int, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.is_set():
            tree, pending, seen = _children_of(), [self.root], set()
            while pending:
                pid = pending.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                peak = _peak_rss(pid)
                if peak is not None:
                    self.peaks[pid] = max(peak, self.peaks.get(pid, 0))
                pending.extend(tree.get(pid, []))
            self.done.wait(self.period_s)

    def stop(self, probes: list[dict]) -> int:
        self.done.set()
        self.thread.join()
        for probe in probes:
            self.peaks[probe["pid"]] = max(probe["peak_rss_bytes"], self.peaks.get(probe["pid"], 0))
        return sum(self.peaks.values())


@dataclass
class Launched:
    """A side's process on its way: what finishing it needs."""

    name: str
    command: list[str]
    process: subprocess.Popen
    memory: TreeMemory
    launched: float
    log: Path
    probe_dir: Path


def launch_side(name: str, command: list[str], env: dict[str, str], work: Path) -> Launched:
    """Start one side, its peak memory polled from now on."""
    probe_dir = work / "probes" / name
    probe_dir.mkdir(parents=True, exist_ok=True)
    for old in probe_dir.glob("probe-*.json"):
        old.unlink()
    env = {**env, "HTFL_PFL_BENCH_PROBE": str(probe_dir), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = work / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {' '.join(command)}", flush=True)
    with open(log, "w") as output:
        launched = time.time()
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
    return Launched(name, command, process, TreeMemory(process.pid), launched, log, probe_dir)


def finish_side(side: Launched, held_s: float = 0.0, timeout_s: float | None = None) -> dict[str, Any]:
    """Wait for a side and collect what its processes counted (bench/pfl_probe.py). ``held_s``:
    how long the lockstep gate held it before its first round, which is no start-up; past
    ``timeout_s`` it is killed."""
    try:
        code = side.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        print(f"[{side.name}] still running {timeout_s:.0f} s after its last round: killed", flush=True)
        side.process.kill()
        code = side.process.wait()
    wall = time.time() - side.launched
    probes = [json.loads(path.read_text()) for path in sorted(side.probe_dir.glob("probe-*.json"))]
    peak = side.memory.stop(probes)
    firsts = [p["first_step"] for p in probes if p["first_step"] is not None]
    result: dict[str, Any] = {"command": side.command, "returncode": code, "wall_s": wall, "log": str(side.log),
                              "processes_counted": len(probes), "steps_total": sum(p["steps"] for p in probes),
                              "startup_s": (min(firsts) - side.launched - held_s) if firsts else None,
                              "peak_rss_bytes": peak}
    if code != 0:
        tail = side.log.read_text().splitlines()[-15:]
        print(f"[{side.name}] failed with status {code}; the end of {side.log}:\n  " + "\n  ".join(tail),
              flush=True)
    return result


def run_side(name: str, command: list[str], env: dict[str, str], work: Path) -> dict[str, Any]:
    """Launch one side, wait, and collect what its processes counted (bench/pfl_probe.py)."""
    return finish_side(launch_side(name, command, env, work))


# --------------------------------------------------------------------------- the lockstep gate


class GateBroken(Exception):
    """A gated side said something out of turn, went quiet too long, or ended early."""


class GatedSide:
    """One side under ``--lockstep``: its process and the driver's ends of the two named pipes
    its bench/pfl_gate.py reads and writes (``WORK/gate/SIDE/go`` and ``say``, named with the
    side's rounds in HTFL_PFL_BENCH_GATE), which every process of the side can reach, torchrun's
    workers too. The driver holds both open read-write from before the launch to ``finish``, so
    neither end's open ever blocks and the side reads end-of-file once the driver is gone; the
    side's end it learns from its process (``_line`` polls it), never from the pipe."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], work: Path, rounds: int) -> None:
        self.gate = work / "gate" / name
        self.gate.mkdir(parents=True, exist_ok=True)
        for fifo in (self.gate / GATE_GO, self.gate / GATE_SAY):
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo, 0o600)
        self.go = os.open(self.gate / GATE_GO, os.O_RDWR)  # on Linux a FIFO opened read-write never blocks
        self.say = os.open(self.gate / GATE_SAY, os.O_RDWR | os.O_NONBLOCK)  # read after select alone
        env = {**env, GATE_ENV: f"{rounds},{self.gate}"}
        try:
            self.side = launch_side(name, command, env, work)
        except BaseException:
            self._close()
            raise
        self.name = name
        self.buffer = b""
        self.seconds: list[float] = []
        """Go-to-done seconds of each round, on the driver's clock."""
        self.held_s = 0.0
        self.ready_at: float | None = None
        self.failure = ""

    def _line(self) -> str | None:
        """The side's next line, None once its process exited (and what it wrote before is read);
        GateBroken past GATE_TIMEOUT_S."""
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GateBroken(f"no word from it in {GATE_TIMEOUT_S:.0f} s")
            readable, _, _ = select.select([self.say], [], [], min(left, 1.0))
            if not readable and self.side.process.poll() is not None:
                readable, _, _ = select.select([self.say], [], [], 0)  # what it wrote just before it exited
                if not readable:
                    return None
            if readable:
                chunk = os.read(self.say, 4096)
                if not chunk:
                    return None
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode("ascii", "replace")

    def await_ready(self, round_index: int) -> None:
        """Until the side waits at the gate before round ``round_index``."""
        line = self._line()
        if line != f"ready {round_index}":
            raise GateBroken(f"expected 'ready {round_index}', got " + ("its exit" if line is None else repr(line)))
        self.ready_at = time.time()

    def play(self, round_index: int, last: bool) -> None:
        """Let the side play one round and time it from the go to its done (its exit ends the last)."""
        if round_index > 0:
            self.await_ready(round_index)
        else:
            assert self.ready_at is not None, "ready 0 is awaited at launch"
            self.held_s = time.time() - self.ready_at
        if self.side.process.poll() is not None:
            raise GateBroken(f"it exited before round {round_index}")
        began = time.perf_counter()
        os.write(self.go, f"go {round_index}\n".encode())  # into the pipe's buffer: never blocks
        line = self._line()
        ended = time.perf_counter()
        if line != f"done {round_index}" and not (line is None and last):
            raise GateBroken(f"expected 'done {round_index}', got " + ("its exit" if line is None else repr(line)))
        self.seconds.append(ended - began)
        if last and line is not None:  # its exit (results, teardown) overlaps no other side's round
            line = self._line()
            if line is not None:
                raise GateBroken(f"expected its exit after its last round, got {line!r}")

    def give_up(self, why: str) -> None:
        """Out of the rotation: said, and its process ended so that no one waits on it."""
        self.failure = why
        print(f"[{self.name}] lockstep: {why}; stopped", flush=True)
        try:
            self.side.process.wait(EXIT_GRACE_S)  # one that is exiting keeps its own status
        except subprocess.TimeoutExpired:
            self.side.process.kill()

    def _close(self) -> None:
        """The driver's ends closed (a side still at the gate reads end-of-file and ends) and the
        named pipes removed (a side yet to open them fails at once)."""
        for fd in (self.go, self.say):
            os.close(fd)
        shutil.rmtree(self.gate, ignore_errors=True)

    def finish(self) -> dict[str, Any]:
        self._close()
        measured = finish_side(self.side, self.held_s, GATE_TIMEOUT_S)
        measured["go_to_done_s"] = self.seconds
        if self.failure:
            measured["lockstep_failure"] = self.failure
            if measured["returncode"] == 0:
                measured["returncode"] = f"lockstep: {self.failure}"
        return measured


def run_lockstep(plans: dict[str, tuple[list[str], dict[str, str]]], work: Path,
                 total_rounds: int) -> dict[str, dict[str, Any]]:
    """Launch the sides one after another (each start-up alone: the earlier ones wait at the gate),
    then play round r of every side in turn, in the sides' order rotated by r, one side at a time."""
    gated: list[GatedSide] = []
    try:
        for name, (command, env) in plans.items():
            side = GatedSide(name, command, env, work, total_rounds)
            gated.append(side)
            _guarded(side, side.await_ready, 0)
        for round_index in range(total_rounds):
            turn = round_index % len(gated)
            for side in gated[turn:] + gated[:turn]:
                if not side.failure:
                    _guarded(side, side.play, round_index, round_index == total_rounds - 1)
    finally:
        for side in gated:
            if side.side.process.poll() is None and not side.failure and len(side.seconds) < total_rounds:
                side.give_up("the driver stopped early")
    return {side.name: side.finish() for side in gated}


def _guarded(side: GatedSide, step: Callable[..., None], *args: Any) -> None:
    """One gate step of a side; a broken gate takes that side out, never the driver."""
    if side.failure:
        return
    try:
        step(*args)
    except GateBroken as exc:
        side.give_up(str(exc))


def paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """Per-round ratios a/b of two lockstep sides' timed rounds, and their median and range."""
    ratios = [x / y for x, y in zip(a, b, strict=True) if y > 0]
    if not ratios:
        return {"per_round": [], "median": None, "min": None, "max": None}
    return {"per_round": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def timed(seconds: list[float], warmup: int, rounds: int) -> dict[str, Any]:
    window = seconds[warmup:warmup + rounds]
    return {"round_seconds": seconds, "timed_rounds": window,
            "s_per_round": statistics.median(window) if window else None}


# --------------------------------------------------------------------------- the workload


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """Our run's config (and the data it names); the other sides take the same numbers."""
    if args.clients < 1 or not 1 <= args.per_round <= args.clients:
        raise UsageError(f"--per-round must be 1..--clients ({args.clients}), not {args.per_round}")
    if args.samples < 1 or args.rounds < 1 or args.warmup < 0 or args.batch < 1:
        raise UsageError("--samples, --rounds and --batch must be at least 1, --warmup at least 0")
    per_client = 10 * (args.samples // 10 + 1)  # every client holds samples + (1..10) pictures, 10 classes alike
    join_ratio = args.per_round / args.clients
    while int(args.clients * join_ratio) < args.per_round:  # int(N·ρ) is the engine's cohort size
        join_ratio = math.nextafter(join_ratio, 2.0)
    root = args.work / "data" / f"c{args.clients}-n{per_client}-seed{args.seed}"
    return {
        "algorithm": "pfl_fedavg", "plugins": ["pfl_workload"], "seed": args.seed,
        "rounds": args.warmup + args.rounds + 1, "num_clients": args.clients, "join_ratio": join_ratio,
        # metrics.jsonl has a row (with the round's seconds) on evaluation rounds only: every round
        # evaluates, one client (10 test pictures, a few ms), and the last round every client
        "eval_every": 1, "eval": {"clients_fraction": 1 / args.clients},
        "data": {"dataset": "pfl_cifar_like", "root": str(root), "partition": "pathological",
                 "partition_rules": "pfllib", "classes_per_client": 10, "balance": True,
                 # floor(ratio · per_client) = samples training pictures per client, the rest tests
                 "train_ratio": (args.samples + 0.5) / per_client, "cache_dir": str(args.work / "partitions")},
        "model": {"group": "pfl_cnn", "feature_dim": 128},
        "train": {"batch_size": args.batch, "lr": args.lr, "local_epochs": 1, "optimizer": "sgd",
                  "batch_order": "fixed"},  # pfl walks a user's data in its stored order
        "runtime": {"threads": 1, "device": args.device},
    }


def prepare(config: dict[str, Any], config_path: Path, per_class: int) -> None:
    """Our run's config file, the pictures (``per_class`` of each class) and their partition
    cache, built once here, outside every side's clock."""
    sys.path.insert(0, str(BENCH))
    import pfl_workload
    import yaml

    from htfl_dist.config import load_config
    from htfl_dist.data import prepare_partition

    pfl_workload.write_dataset(config["data"]["root"], per_class, config["seed"])
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    loaded = load_config(str(config_path))
    prepare_partition(loaded.data, loaded.num_clients, loaded.seed, batch_size=loaded.train.batch_size)


def compare_round_one(work: Path) -> dict[str, Any]:
    import torch

    ours = torch.load(work / "dump" / "ours" / "global-round-1.pt", map_location="cpu")
    bare = torch.load(work / "dump" / "bare" / "global-round-1.pt", map_location="cpu")
    if ours.shape != bare.shape:
        return {"equal": False, "why": f"shapes differ: ours {list(ours.shape)}, bare {list(bare.shape)}"}
    difference = float((ours.double() - bare.double()).abs().max())
    return {"equal": difference <= TOLERANCE, "max_abs_diff": difference, "tolerance": TOLERANCE}


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--clients", type=int, default=1000, help="clients (pfl's benchmark: 1000)")
    parser.add_argument("--per-round", type=int, default=50, help="clients sampled a round (cohort_size 50)")
    parser.add_argument("--samples", type=int, default=50, help="training samples a client (50)")
    parser.add_argument("--batch", type=int, default=10, help="local batch (local_batch_size 10)")
    parser.add_argument("--lr", type=float, default=0.1, help="local SGD rate (local_learning_rate 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the runs (seed 0)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--out", type=Path, help="JSON of the results")
    parser.add_argument("--lockstep", action="store_true",
                        help=f"run the sides ({', '.join(LOCKSTEP_SIDES)} only) at once, one round of one side at a "
                             "time in rotating order, and report paired per-round ratios")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"data, caches, logs (default {DEFAULT_WORK})")
    parser.add_argument("--pfl-venv", type=Path, default=Path(os.environ.get(PFL_VENV_ENV, DEFAULT_PFL_VENV)),
                        help=f"pfl's venv (${PFL_VENV_ENV}, else {DEFAULT_PFL_VENV})")
    parser.add_argument("--pfl-python", type=Path, default=None,
                        help="pfl's interpreter, instead of --pfl-venv's (a GPU machine without network: its "
                             "python3 with --pfl-path)")
    parser.add_argument("--pfl-path", type=Path, default=None,
                        help="a folder put on pfl's PYTHONPATH alone: pfl and its packages unpacked from wheels "
                             "(bench/gpu_prepare.sh)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every side trains (cuda: pfl on its default device, ours and the bare loop "
                             "with runtime.device=cuda; each round's time ends after its kernels)")
    parser.add_argument("--pfl-layout", choices=("nchw", "nhwc"), default="nchw",
                        help="nhwc: pfl's pictures NHWC and transposed in its model, as its benchmark does "
                             "(default nchw: every side runs the same kernels)")
    parser.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override for our runs, e.g. runtime.resident_clients=64 (repeatable)")
    args = parser.parse_args(argv)
    args.work = args.work.expanduser().resolve()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        raise UsageError(f"--sides: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SIDES)}")
    not_gated = [s for s in sides if s not in LOCKSTEP_SIDES]
    if args.lockstep and not_gated:
        raise UsageError(f"--lockstep runs the sides {', '.join(LOCKSTEP_SIDES)} only, not {', '.join(not_gated)}")
    if args.pfl_python is not None:  # a name on PATH (python3) or a file
        found = shutil.which(str(args.pfl_python))
        if found is None:
            raise UsageError(f"--pfl-python {args.pfl_python}: no such interpreter")
        args.pfl_python = Path(found)
    args.side_list = sides
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        config = workload(args)
    except UsageError as exc:
        print(f"pfl_side_by_side: error: {exc}", file=sys.stderr)
        return 2
    work, sides = args.work, args.side_list
    total_rounds = config["rounds"]
    config_path = work / f"ours-c{args.clients}-p{args.per_round}-n{args.samples}-r{total_rounds}.yaml"
    work.mkdir(parents=True, exist_ok=True)
    prepare(config, config_path, per_class=args.clients * (args.samples // 10 + 1))
    check = "bare" in sides and "ours" in sides
    results: dict[str, Any] = {}
    plans: dict[str, tuple[list[str], dict[str, str]]] = {}
    for side in sides:
        plan = side_plan(side, args, config_path, total_rounds, check)
        if plan is None:
            results[side] = {"skipped": "pfl venv not found: run bench/pfl_setup.sh"}
        else:
            plans[side] = plan
            if not args.lockstep:
                results[side] = collect(side, run_side(side, *plan, work), work, args, total_rounds)
    if args.lockstep and plans:
        measured = run_lockstep(plans, work, total_rounds)
        results = {side: results.get(side) or collect(side, measured[side], work, args, total_rounds)
                   for side in sides}
    report = summarise(args, config, results, work if check else None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    failed = [s for s, r in results.items() if r.get("returncode", 0) != 0]
    return 1 if failed or report.get("check", {}).get("ok") is False else 0


def side_plan(side: str, args: argparse.Namespace, config_path: Path, total_rounds: int,
              check: bool) -> tuple[list[str], dict[str, str]] | None:
    """A side's command and environment, its old results and run directory cleared; None (said)
    when it is pfl's and pfl's venv is missing."""
    work = args.work
    ours_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), str(REPO)])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", GATE_ENV):  # the gate's pipes are run_lockstep's alone
        ours_env.pop(key, None)
    dump = work / "dump" / side
    env = dict(ours_env)
    if check and side in ("ours", "bare"):
        dump.mkdir(parents=True, exist_ok=True)
        env["HTFL_PFL_BENCH_DUMP"] = str(dump)
    result_file = work / "results" / f"{side}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    for old in result_file.parent.glob(f"{side}.json*"):
        old.unlink()
    if side in ("pfl", "pfl2"):
        pfl_python = args.pfl_python or args.pfl_venv / "bin" / "python"
        if not pfl_python.is_file():
            print(f"[{side}] skipped: pfl venv not found: run bench/pfl_setup.sh (looked for {pfl_python})")
            return None
        pfl_args = [str(BENCH / "pfl_runner.py"), "--clients", str(args.clients), "--per-round", str(args.per_round),
                    "--samples", str(args.samples), "--rounds", str(total_rounds), "--batch", str(args.batch),
                    "--lr", str(args.lr), "--seed", str(args.seed), "--layout", args.pfl_layout]
        launcher = [] if side == "pfl" else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH", GATE_ENV)}
        if args.pfl_path is not None:  # pfl's packages alone: never htfl_dist's
            env["PYTHONPATH"] = str(args.pfl_path)
        if args.device == "cpu":  # pfl picks a GPU wherever one is visible
            env["CUDA_VISIBLE_DEVICES"] = ""
        return [str(pfl_python), *launcher, *pfl_args, "--result", str(result_file)], env
    if side == "bare":
        command = [sys.executable, str(BENCH / "pfl_bare.py"), "--config", str(config_path), "--result",
                   str(result_file)]
        return command + (["--dump", str(dump)] if check else []), env
    out = work / "runs" / side
    ranks = {"ours": 1, "ours2": 3, "ours2h": 2}[side]
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    # with several ranks each sums its own clients' models and rank 0 receives one sum a rank,
    # as pfl's workers all-reduce one (FedAvg's server needs only the sum: registry.sums_only)
    transport = [] if ranks == 1 else ["runtime.backend=gloo", "runtime.presum_uploads=true"]
    if side == "ours2h":
        transport.append("runtime.server_hosts_clients=true")
    if out.exists():
        shutil.rmtree(out)
    return [sys.executable, *launcher, "-m", "htfl_dist.main", "--config", str(config_path), "--out", str(out),
            "--resume", "never", *transport, *args.ours_set], env


def collect(side: str, measured: dict[str, Any], work: Path, args: argparse.Namespace,
            total_rounds: int) -> dict[str, Any]:
    """A finished side's round seconds and steps, read from what it wrote. Under ``--lockstep`` the
    timed figures are the driver's go-to-done seconds and the side's own are kept beside them."""
    if measured["returncode"] != 0:
        return measured
    result_file = work / "results" / f"{side}.json"
    if side in ("ours", "ours2", "ours2h"):
        rows = [json.loads(line) for line in (work / "runs" / side / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        if len(rows) != total_rounds:
            measured["returncode"] = "no row for every round"
            print(f"[{side}] metrics.jsonl has {len(rows)} rows for {total_rounds} rounds", flush=True)
        own = [row["seconds"] for row in rows]
    else:
        ranks = [json.loads(path.read_text()) for path in sorted(result_file.parent.glob(f"{side}.json*"))]
        own = ranks[0]["round_seconds"]
        measured["round_steps"] = [sum(r["round_steps"][i] for r in ranks) for i in range(total_rounds)]
    if "go_to_done_s" in measured:
        measured["own_round_seconds"] = own
        measured.update(timed(measured["go_to_done_s"], args.warmup, args.rounds))
    else:
        measured.update(timed(own, args.warmup, args.rounds))
    measured["steps_per_round"] = measured["steps_total"] / total_rounds
    return measured


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired_ratios(results: dict[str, Any], rounds: int) -> dict[str, Any]:
    """``--lockstep``: the ratio of two sides' times of the same timed round (run seconds apart,
    so the VM's drift cancels), for each pair that both finished; printed as median (min..max)."""
    found: dict[str, Any] = {}
    for label, mine, theirs in PAIRS:
        a, b = results.get(mine, {}), results.get(theirs, {})
        if a.get("returncode") == 0 and b.get("returncode") == 0:
            found[label] = paired(a["timed_rounds"], b["timed_rounds"])
    if found:
        print(f"paired per-round ratios (lockstep), median (min..max) over {rounds} timed rounds:")
    for label, ratio in found.items():
        if ratio["median"] is None:
            print(f"  {label:11} -")
            continue
        each = " ".join(f"{r:.3f}" for r in ratio["per_round"])
        print(f"  {label:11} {ratio['median']:.3f}x ({ratio['min']:.3f}x..{ratio['max']:.3f}x)   per round: {each}")
    return found


def summarise(args: argparse.Namespace, config: dict[str, Any], results: dict[str, Any],
              check_dir: Path | None) -> dict[str, Any]:
    steps_a_client = math.ceil(args.samples / args.batch) - (1 if args.samples > 1 and args.samples % args.batch == 1
                                                              else 0)
    report: dict[str, Any] = {
        "workload": {"clients": args.clients, "per_round": args.per_round, "samples": args.samples,
                     "batch": args.batch, "lr": args.lr, "local_epochs": 1, "seed": args.seed,
                     "rounds_played": config["rounds"], "warmup": args.warmup, "timed_rounds": args.rounds,
                     "expected_steps_per_round": args.per_round * steps_a_client, "pfl_settings_from": PFL_SOURCE,
                     "pfl_layout": args.pfl_layout, "ours_overrides": args.ours_set, "threads": 1,
                     "device": args.device, "lockstep": args.lockstep},
        "sides": results}
    print(f"\npfl's CIFAR-10 workload: {args.clients} clients, {args.per_round} a round, {args.samples} samples, "
          f"batch {args.batch}, 1 epoch ({report['workload']['expected_steps_per_round']} SGD steps a round); "
          f"median of {args.rounds} rounds after {args.warmup}"
          + ("; lockstep: one round of one side at a time, rotating, timed from go to done" if args.lockstep else ""))
    print(f"{'side':6} {'s/round':>8} {'steps/round':>12} {'start-up s':>11} {'peak RSS GiB':>13}")
    for side, r in results.items():
        if "skipped" in r:
            print(f"{side:6} skipped: {r['skipped']}")
            continue
        if r["returncode"] != 0:
            print(f"{side:6} failed (status {r['returncode']}, {r['log']})")
            continue
        startup = f"{r['startup_s']:.2f}" if r["startup_s"] is not None else "-"
        per_round = "-" if r["s_per_round"] is None else f"{r['s_per_round']:.3f}"
        print(f"{side:6} {per_round:>8} {r['steps_per_round']:12.1f} {startup:>11} "
              f"{r['peak_rss_bytes'] / 2**30:13.2f}")
    ratios: dict[str, Any] = {}
    pairs = (("ours/pfl", "ours", "pfl"), ("ours/bare", "ours", "bare"), ("ours2/pfl2", "ours2", "pfl2"),
             ("ours2/bare", "ours2", "bare"), ("ours2h/pfl2", "ours2h", "pfl2"),
             ("ours2h/bare", "ours2h", "bare"), ("pfl/bare", "pfl", "bare"))
    for label, mine, theirs in pairs:
        a, b = results.get(mine, {}), results.get(theirs, {})
        if a.get("returncode") == 0 and b.get("returncode") == 0:
            ratios[label] = {key: _ratio(a.get(key), b.get(key)) for key in ("s_per_round", "startup_s",
                                                                              "peak_rss_bytes")}
    if ratios:
        print("ratios (time a round, start-up, peak memory):")
        for label, values in ratios.items():
            shown = ["-" if v is None else f"{v:.2f}x" for v in values.values()]
            print(f"  {label:11} {'  '.join(shown)}")
    report["ratios"] = ratios
    if args.lockstep:
        report["paired_ratios"] = paired_ratios(results, args.rounds)
    if check_dir is not None and results["bare"].get("returncode") == 0 and results["ours"].get("returncode") == 0:
        check = compare_round_one(check_dir)
        check["steps_equal"] = results["bare"]["steps_total"] == results["ours"]["steps_total"]
        check["ok"] = bool(check["equal"] and check["steps_equal"])
        report["check"] = check
        print(f"check ours = bare: steps {results['ours']['steps_total']} vs {results['bare']['steps_total']}, "
              f"global model after round 1: max |diff| {check.get('max_abs_diff', float('nan')):.2e} "
              f"(tolerance {TOLERANCE:g}) -> {'ok' if check['ok'] else 'MISMATCH'}")
    return report


if __name__ == "__main__":
    sys.exit(main())
