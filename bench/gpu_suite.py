"""The GPU suite: what a lent GPU machine should spend its minutes on, in order of value, each step
under its own time cap, with ``OUT/summary.md`` rewritten after every step so that a run cut off
still leaves its figures. Run it through ``bench/gpu_suite.sh DIR OUT`` (docs/running.md).

Steps (the figures each gives):
1. side by side: HtFLlib's FedProto (unmodified, ``bench/htfllib_run.py``) and ours on the same
   PFLlib FMNIST Dirichlet split (20 HtCNN8 clients, 2 rounds): s/round, GPU utilisation and
   memory; ours, in order of value since a short lease ends the list, as 1 process (eager),
   recorded steps with clients side by side (auto width), torchrun with 3 ranks sharing the GPU,
   recorded steps alone, 4 clients side by side (eager), 5 ranks, compiled, and
   ``train.client_batching=vmap``; then one step eager against each compile mode. Before them
   (1a), the tests of recorded steps and clients side by side that only a GPU runs.
2. determinism: the 1-process run of step 1 against its 3-rank, recorded and side-by-side runs,
   round by round (equal or not).
3. paper-size models: HtFE8 on generated CIFAR-100-sized data (20 clients, 100 classes): each
   member's step time and peak memory, FedTGP's s/round on 5 ranks sharing the GPU, and a
   projection (stated as such) of FedTGP Table 1's CIFAR-100 1000-round run on one 8-GPU node.
4. FedTGP's server update on the device, and its share of step 3's round.
5. DP-SGD against plain training (client seconds per round), and study packing: 4 cells at once
   on one device against one after another.
6. pfl-research beside ours and a bare loop on pfl's CIFAR-10 workload on the device, in lockstep
   (bench/pfl_side_by_side.py), pfl from DIR/pfl-wheels.

``--tiny --device cpu`` runs every step at toy sizes on a CPU (the test suite's launch tier does,
so the suite keeps working as the code changes); its figures mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))  # its siblings, also where a test loads this file by its path
from htfllib_run import log_accuracies, log_seconds  # noqa: E402  (the one parser of the reference's log)

FEDPROTO = REPO / "configs" / "fmnist_htcnn8_fedproto_dirichlet.yaml"
FEDTGP_CIFAR100 = REPO / "configs" / "cifar100_htfe8_fedtgp_dirichlet.yaml"
RESERVE_S = 10.0
"""Kept back from the budget for writing the summary after the last step."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a step runs at: the issue's sizes on a GPU, toy ones for the CPU dry run."""

    clients: int
    fmnist_subsample: float
    rounds: int
    ranks: tuple[int, ...]
    cifar_samples: int
    cifar_rounds: int
    arch_steps: int
    server_epochs: int
    study_cells: int
    dp_rounds: int

    @staticmethod
    def pick(tiny: bool) -> Sizes:
        if tiny:
            return Sizes(clients=4, fmnist_subsample=0.05, rounds=2, ranks=(2, 3), cifar_samples=2000,
                         cifar_rounds=1, arch_steps=3, server_epochs=5, study_cells=4, dp_rounds=1)
        return Sizes(clients=20, fmnist_subsample=1.0, rounds=2, ranks=(3, 5), cifar_samples=60000,
                     cifar_rounds=2, arch_steps=50, server_epochs=100, study_cells=4, dp_rounds=2)


@dataclasses.dataclass
class Launch:
    """One command's outcome: exit status, wall seconds, and what the GPU did while it ran."""

    rc: int
    seconds: float
    samples: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    """(epoch seconds, utilisation %, memory used MiB), every 200 ms; empty without nvidia-smi."""
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def gpu_mem_mib(self) -> float | None:
        return max(s[2] for s in self.samples) if self.samples else None

    def gpu_util(self, last_s: float | None = None) -> float | None:
        """Mean utilisation over the run's last ``last_s`` seconds (the timed rounds, so that
        start-up, data loading and teardown do not dilute it), or over all of it."""
        since = self.ended - last_s if last_s else 0.0
        window = [s[1] for s in self.samples if s[0] >= since]
        return statistics.fmean(window) if window else None


class GpuSampler:
    """Samples utilisation and used memory of GPU 0 every 200 ms through nvidia-smi (absent on a
    CPU machine: then there are no samples and every GPU figure is n/a)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self.process = subprocess.Popen(
                ["nvidia-smi", "--id=0", "--query-gpu=timestamp,utilization.gpu,memory.used",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=self.path.open("w"), stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self.process:
            self.process.terminate()
            self.process.wait()

    def samples(self) -> list[tuple[float, float, float]]:
        if not self.process or not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            match = re.fullmatch(r"\s*(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d)(\.\d+)?\s*,\s*([\d.]+)\s*,\s*([\d.]+)\s*", line)
            if match:
                stamp = time.mktime(time.strptime(match[1], "%Y/%m/%d %H:%M:%S")) + float(match[2] or 0)
                rows.append((stamp, float(match[3]), float(match[4])))
        return rows


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process descended from it. The group alone is not
    enough: torchrun starts each rank in a session of its own, and a rank that outlives its step
    would share the device with the next step's timings."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for member in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.prepared: Path = args.dir.resolve()
        self.out: Path = args.out.resolve()
        self.work: Path = (args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "htfl_gpu_suite").resolve()
        self.sizes = Sizes.pick(args.tiny)
        self.began = time.monotonic()
        self.sections: list[str] = []
        self.results: dict[str, dict] = {}
        self.python = sys.executable

    # ------------------------------------------------------------------ time and launching

    def left(self) -> float:
        return self.args.budget_s - RESERVE_S - (time.monotonic() - self.began)

    def launch(self, name: str, command: list[str], cap_s: float, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> Launch:
        """Run ``command`` with its output in ``logs/<name>.log``, stopped (its whole process group)
        after ``cap_s`` seconds or when the budget ends, whichever comes first."""
        log = self.out / "logs" / f"{name}.log"
        timeout = max(1.0, min(cap_s, self.left()))
        began = time.monotonic()
        with log.open("w") as handle, GpuSampler(self.out / "logs" / f"{name}.gpu.csv") as sampler:
            handle.write(f"$ {' '.join(command)}\n")
            handle.flush()
            # through the study's cell leader: a suite that is killed takes its command along
            # (the parent-death signal), though the command runs in a session of its own
            leader = [self.python, "-I", str(REPO / "htfl_dist" / "study" / "leader.py"), str(os.getpid())]
            process = subprocess.Popen([*leader, *command], stdout=handle, stderr=subprocess.STDOUT, cwd=cwd,
                                       env={**os.environ, **(env or {})}, start_new_session=True)
            try:
                rc = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(process.pid)
                process.wait()
                rc = 124
                handle.write(f"\n[gpu_suite: stopped after {timeout:.0f} s: the step's cap or the budget]\n")
        return Launch(rc, time.monotonic() - began, sampler.samples(), ended=time.time())

    def ours(self, name: str, config: Path, overrides: list[str], ranks: int, cap_s: float) -> Launch:
        run_dir = self.work / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        entry = ["-m", "htfl_dist.main"] if ranks == 1 else \
            ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "htfl_dist.main"]
        device = [f"runtime.device={self.args.device}", f"data.cache_dir={self.work / 'cache'}",
                  "checkpoint_every=0"] + (["runtime.threads=1"] if self.args.device == "cpu" else [])
        return self.launch(name, [self.python, *entry, "--config", str(config), "--out", str(run_dir),
                                  *overrides, *device], cap_s)

    def rows(self, name: str) -> list[dict]:
        path = self.work / "runs" / name / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    # ------------------------------------------------------------------ summary

    def write_summary(self) -> None:
        text = "\n\n".join([self.header(), *self.sections]) + "\n"
        partial = self.out / "summary.md.partial"
        partial.write_text(text)
        os.replace(partial, self.out / "summary.md")
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))

    def header(self) -> str:
        return "\n".join([
            "# GPU suite", "",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- machine: {machine_line(self.args.device)}",
            f"- command: `bash bench/gpu_suite.sh {' '.join(sys.argv[1:])}`",
            f"- sizes: {dataclasses.asdict(self.sizes)}" + (" (tiny: a dry run, figures meaningless)" * self.args.tiny),
            f"- budget {self.args.budget_s:.0f} s; elapsed {time.monotonic() - self.began:.0f} s"])

    def add_section(self, title: str, lines: list[str]) -> None:
        self.sections.append("\n".join([f"## {title}", "", *lines]))
        self.write_summary()


# ---------------------------------------------------------------------------- helpers


def machine_line(device: str) -> str:
    import torch

    parts = [f"torch {torch.__version__}", f"python {sys.version.split()[0]}", f"{os.cpu_count()} CPUs"]
    if device == "cuda" and torch.cuda.is_available():
        parts.insert(0, torch.cuda.get_device_name(0))
        parts.append(f"CUDA {torch.version.cuda}")
        driver = nvidia_smi("driver_version")
        if driver:
            parts.append(f"driver {driver}")
    else:
        parts.insert(0, "CPU only")
    return ", ".join(parts)


def nvidia_smi(field: str) -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    done = subprocess.run(["nvidia-smi", "--id=0", f"--query-gpu={field}", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return done.stdout.strip()


def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def per_round_s(seconds: list[float]) -> float | None:
    """Mean seconds per round after the first (which carries warm-up), or the only one."""
    if not seconds:
        return None
    return statistics.fmean(seconds[1:] if len(seconds) > 1 else seconds)


def reference_figures(log: Path) -> tuple[list[float], list[float]]:
    """HtFLlib's per-iteration seconds (its ``'-' * 50, seconds`` lines) and its evaluated
    accuracies (``Averaged Test Accurancy``, taken before each iteration's training)."""
    text = log.read_text() if log.exists() else ""
    return log_seconds(text), log_accuracies(text)


def unpack_wheels(folder: Path, site: Path) -> bool:
    """The wheels in ``folder`` unpacked into ``site``, a folder for PYTHONPATH (nothing is
    installed): DIR/wheels, the privacy extra's packages (Opacus, cryptography), on the path of
    every step (the DP step needs them, and a test of step 1 checks a refusal that names
    privacy.enabled, which needs Opacus to get that far); DIR/pfl-wheels on pfl's alone (step 6)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return False
    if not site.exists():
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
    return True


# ---------------------------------------------------------------------------- steps


def prepare_data(suite: Suite) -> None:
    """The PFLlib directories both sides read, written on this machine from DIR's four files."""
    dataset = suite.work / "htfllib" / "dataset"
    sizes = suite.sizes
    if not (dataset / "FMNIST").exists():
        launched = suite.launch("0_write_fmnist_split", [
            suite.python, str(BENCH / "pfllib_write.py"), "fmnist", str(dataset / "FMNIST"),
            "--fmnist-root", str(suite.prepared / "fmnist"), "--clients", str(sizes.clients),
            "--subsample", str(sizes.fmnist_subsample)], cap_s=120)
        if not launched.ok:
            raise SystemExit(f"gpu_suite: writing the FMNIST split failed; see {suite.out}/logs/"
                             "0_write_fmnist_split.log")
    system = suite.prepared / "htfllib" / "system"
    if system.exists() and not (suite.work / "htfllib" / "system").exists():
        shutil.copytree(system, suite.work / "htfllib" / "system")


def fedproto_overrides(suite: Suite) -> list[str]:
    return ["data.partition=pfllib", f"data.pfllib_dir={suite.work / 'htfllib' / 'dataset' / 'FMNIST'}",
            "data.allow_pickle=true", f"num_clients={suite.sizes.clients}", f"rounds={suite.sizes.rounds}"]


def step_side_by_side(suite: Suite, cap_s: float) -> None:
    ends = time.monotonic() + cap_s
    step_graphs_equal_eager(suite, min(GRAPH_CHECKS_S, cap_s / 3))
    table = ["| run | s/round | whole run s | GPU util % | GPU mem MiB | accuracy by round % |",
             "|---|---|---|---|---|---|"]
    results: dict[str, dict] = {}
    reference = suite.work / "htfllib" / "system"
    if reference.exists() and not suite.args.no_reference:
        device = "cuda" if suite.args.device == "cuda" else "cpu"
        launched = suite.launch("1_reference_fedproto", [
            suite.python, str(BENCH / "htfllib_run.py"), str(reference), "-data", "FMNIST", "-m", "HCNNs8",
            "-algo", "FedProto", "-lam", "10", "-lbs", "10", "-lr", "0.01", "-nc", str(suite.sizes.clients),
            "-ncl", "10", "-gr", str(suite.sizes.rounds - 1), "-dev", device, "-fd", "512"],
            cap_s=ends - time.monotonic())
        seconds, accuracy = reference_figures(suite.out / "logs" / "1_reference_fedproto.log")
        util = launched.gpu_util(sum(seconds[1:]))
        results["reference"] = {"rc": launched.rc, "s_per_round": per_round_s(seconds), "wall_s": launched.seconds,
                                "gpu_util": util, "acc": accuracy[1:]}
        commit = (suite.prepared / "htfllib" / "COMMIT").read_text().strip()[:7]
        shown = ", ".join(f"{100 * a:.2f}" for a in accuracy[1:])
        table.append(f"| HtFLlib FedProto ({commit}) | {fmt(per_round_s(seconds))} | {launched.seconds:.1f} | "
                     f"{fmt(util, '.0f')} | {fmt(launched.gpu_mem_mib, '.0f')} | {shown} (rc {launched.rc}) |")
    else:
        why = "left out (--no-reference)" if suite.args.no_reference else "not prepared (gpu_prepare.sh --no-reference)"
        table.append(f"| HtFLlib FedProto | {why} | | | | |")
    # in order of value, since a short lease ends the list: the baseline every other run is compared
    # with, issue 45's items 4 + 5 together, ranks sharing the GPU, then each item alone
    variants = [("ours_1proc", 1, []),
                ("ours_graphs_concurrent", 1, ["train.cuda_graphs=auto", "train.concurrent_clients=0"]),
                (f"ours_{suite.sizes.ranks[0]}ranks", suite.sizes.ranks[0], []),
                ("ours_graphs", 1, ["train.cuda_graphs=auto"]),
                ("ours_concurrent4", 1, ["train.concurrent_clients=4"]),
                (f"ours_{suite.sizes.ranks[1]}ranks", suite.sizes.ranks[1], []),
                # every lever at once, towards the goal of 10x the reference's round
                (f"ours_{suite.sizes.ranks[0]}ranks_graphs_concurrent", suite.sizes.ranks[0],
                 ["train.cuda_graphs=auto", "train.concurrent_clients=0"])]
    if not (suite.args.tiny and suite.args.device == "cpu"):  # Inductor's build: minutes on a CPU dry run
        variants.append(("ours_compiled", 1, ["train.compile=reduce-overhead"]))
    variants.append(("ours_vmap", 1, ["train.client_batching=vmap"]))
    if suite.args.variants:
        unknown = sorted(suite.args.variants - {name for name, _, _ in variants})
        if unknown:
            raise SystemExit(f"gpu_suite: --variants {','.join(unknown)}: step 1 runs "
                             f"{', '.join(name for name, _, _ in variants)}")
        variants = [variant for variant in variants if variant[0] in suite.args.variants]
    for name, ranks, extra in variants:
        if ends - time.monotonic() < 5:
            table.append(f"| {name} | skipped: the step's cap was reached | | | | |")
            continue
        launched = suite.ours(f"1_{name}", FEDPROTO, fedproto_overrides(suite) + extra, ranks, ends - time.monotonic())
        rows = suite.rows(f"1_{name}")
        s_round = per_round_s([r["seconds"] for r in rows])
        util = launched.gpu_util(sum(r["seconds"] for r in rows[1:]))
        results[name] = {"rc": launched.rc, "s_per_round": s_round, "wall_s": launched.seconds,
                         "gpu_util": util, "acc": [r["test_acc"] for r in rows]}
        accuracy = ", ".join(f"{100 * row['test_acc']:.2f}" for row in rows)
        fell_back = "cannot be recorded" in (suite.out / "logs" / f"1_{name}.log").read_text(errors="replace")
        results[name]["graphs_fell_back"] = fell_back
        table.append(f"| {name} | {fmt(s_round)} | {launched.seconds:.1f} | {fmt(util, '.0f')} | "
                     f"{fmt(launched.gpu_mem_mib, '.0f')} | {accuracy} (rc {launched.rc}"
                     f"{'; some steps not recorded: see its log' if fell_back else ''}) |")
    suite.results["side_by_side"] = results
    suite.add_section("1. FedProto beside HtFLlib's, same split and device", [
        f"{suite.sizes.clients} HtCNN8 clients, PFLlib's FMNIST Dirichlet 0.1 split (seed 1), "
        f"{suite.sizes.rounds} rounds, batch 10, lr 0.01, λ = 10; ours runs "
        f"configs/{FEDPROTO.name} with data.partition=pfllib on the same directory. s/round: mean over "
        "rounds after the first (HtFLlib: its own per-iteration timer, evaluation included, as ours).",
        "", *table, "", *speedups(results), "", step_compile(suite, ends - time.monotonic())])


GRAPH_CHECKS_S = 150.0
"""At most this of step 1 for the tests of recorded steps and clients side by side before its runs."""


def step_graphs_equal_eager(suite: Suite, cap_s: float) -> None:
    """Issue 45 items 4, 5 and 7 on the device: recorded steps and clients side by side equal
    eager one at a time, bit for bit (the test files' CUDA cases; skipped, saying so, without CUDA)."""
    where = smoke_data_in_place(suite)
    # the cases parametrized on the CPU are CI's: the device's minutes go to what only it can run
    tests = suite.launch("1_graphs_equal_eager", [
        suite.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", "-k", "not cpu",
        str(REPO / "tests" / "algorithms" / "test_step_graphs.py"),
        str(REPO / "tests" / "algorithms" / "test_compiled_step.py"),
        str(REPO / "tests" / "runtime" / "test_concurrent_clients.py")], cap_s=cap_s, cwd=REPO)
    suite.results["graph_checks"] = {"rc": tests.rc, "seconds": tests.seconds}
    suite.add_section("1a. Recorded steps and clients side by side against eager (issue 45 items 4, 5, 7)", [
        f"- tests/algorithms/test_step_graphs.py, test_compiled_step.py and "
        f"tests/runtime/test_concurrent_clients.py on {suite.args.device}: rc {tests.rc} "
        f"({'passed' if tests.ok else 'FAILED'} in {tests.seconds:.0f} s; logs/1_graphs_equal_eager.log says which "
        f"ran and which were skipped); the cases parametrized on the CPU are CI's (`-k 'not cpu'`)",
        *failed_tests(suite.out / "logs" / "1_graphs_equal_eager.log"), f"- {where}"])


def failed_tests(log: Path) -> list[str]:
    """pytest's short summary of failures (``-rf``), one line per failed test, as list items."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [f"  - {line.strip()[:300]}" for line in text.splitlines() if line.startswith("FAILED ")]


def smoke_data_in_place(suite: Suite) -> str:
    """The tests' smoke config reads FMNIST where the Debian package puts it (the config's
    default root); a bare GPU machine has no such folder, so it becomes a link to DIR's copy."""
    from htfl_dist.config import DEFAULT_FMNIST_ROOT

    root = Path(DEFAULT_FMNIST_ROOT)
    if root.exists():
        return f"the smoke config's FMNIST: {root}, already there"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.symlink_to((suite.prepared / "fmnist").resolve(), target_is_directory=True)
    except OSError as error:
        return f"the smoke config's FMNIST: {root} could not be linked ({error}); its tests fail for want of data"
    return f"the smoke config's FMNIST: {root} linked to {suite.prepared / 'fmnist'} (a bare machine has no copy)"


def step_compile(suite: Suite, cap_s: float) -> str:
    """Issue 45 item 6: one step eager against each compile mode with the compile counted
    (bench/compile_step.py; not in a CPU dry run: Inductor's build). Last in step 1: its figures
    say whether compiling pays, which the runs above already show for a whole round."""
    if suite.args.tiny and suite.args.device == "cpu":
        return "- bench/compile_step.py: not in a CPU dry run (Inductor builds for minutes)"
    if cap_s < 5:
        return "- bench/compile_step.py: skipped, the step's cap was reached"
    launched = suite.launch("1_compile_step", [suite.python, str(BENCH / "compile_step.py"), "--device",
                                               suite.args.device, "--modes", "default,reduce-overhead", "--steps",
                                               "30"], cap_s=cap_s)
    log = (suite.out / "logs" / "1_compile_step.log").read_text().splitlines()
    return "\n".join([f"- bench/compile_step.py (rc {launched.rc}):", "", "```",
                      *[line for line in log[1:] if not line.startswith(("W", "["))], "```"])


def speedups(results: dict[str, dict]) -> list[str]:
    reference = (results.get("reference") or {}).get("s_per_round")
    if not reference:
        return ["No reference figure: no speed-up computed."]
    lines = []
    for name, result in results.items():
        if name != "reference" and result.get("s_per_round"):
            lines.append(f"- {name}: {reference / result['s_per_round']:.1f}× the reference's round")
    return lines


def step_determinism(suite: Suite, cap_s: float) -> None:
    one = suite.rows("1_ours_1proc")
    others = [f"ours_{suite.sizes.ranks[0]}ranks", "ours_graphs", "ours_graphs_concurrent", "ours_concurrent4",
              f"ours_{suite.sizes.ranks[0]}ranks_graphs_concurrent"]
    verdicts = {name: same_rows(one, suite.rows(f"1_{name}")) for name in others}
    suite.results["determinism"] = verdicts
    suite.add_section(f"2. Determinism: 1 process against {suite.sizes.ranks[0]} ranks, recorded steps and "
                      f"clients side by side (issue 45 item 7)", [
        "Step 1's ours_1proc against each (deterministic kernels are always on):", "",
        *[f"- {name}: {verdict}" for name, verdict in verdicts.items()]])


def same_rows(one: list[dict], other: list[dict]) -> str:
    """Whether two runs' rows agree round by round, in words."""
    keys = ("test_acc", "test_acc_head", "train_loss")
    if not one or not other:
        return "not compared: a run of step 1 is missing"
    differing = [(a["round"], k) for a, b in zip(one, other, strict=False) for k in keys if a.get(k) != b.get(k)]
    if not differing and len(one) == len(other):
        return "identical: every round's " + ", ".join(keys) + f" equal ({len(one)} rounds)"
    return f"DIFFERENT at {differing[:5]} ({len(one)} vs {len(other)} rounds)"


def step_paper_size(suite: Suite, cap_s: float) -> None:
    ends = time.monotonic() + cap_s
    sizes, device = suite.sizes, suite.args.device
    arch = suite.launch("3_arch_cost_htfe8", [
        suite.python, str(BENCH / "arch_cost.py"), "--group", "HtFE8", "--image-size", "32", "--channels", "3",
        "--classes", "100", "--device", device, "--steps", str(sizes.arch_steps), "--repeats", "2"],
        # a dry run (--tiny) checks the step works, on a CPU that may be shared: the step's whole cap
        cap_s=min(ends - time.monotonic() if suite.args.tiny else 60, ends - time.monotonic()))
    command = f"bench/arch_cost.py --group HtFE8 --image-size 32 --channels 3 --classes 100 --device {device}"
    lines = [f"Per member, batch 10, random 3 × 32 × 32 input (`{command}`; rc {arch.rc}):", ""]
    lines += table_lines(suite.out / "logs" / "3_arch_cost_htfe8.log")
    generated = suite.work / "Cifar100"
    if not generated.exists():
        suite.launch("3_write_generated", [suite.python, str(BENCH / "pfllib_write.py"), "generated", str(generated),
                                           "--clients", str(sizes.clients), "--samples", str(sizes.cifar_samples)],
                     # a dry run (--tiny) checks the step works, on a CPU that may be shared: the step's whole cap
        cap_s=min(ends - time.monotonic() if suite.args.tiny else 60, ends - time.monotonic()))
    ranks = sizes.ranks[1]
    overrides = ["data.partition=pfllib", f"data.pfllib_dir={generated}", "data.allow_pickle=true",
                 f"num_clients={sizes.clients}", f"rounds={sizes.cifar_rounds}",
                 f"algo.server_epochs={sizes.server_epochs}"]
    run = suite.ours(f"3_fedtgp_htfe8_{ranks}ranks", FEDTGP_CIFAR100, overrides, ranks, ends - time.monotonic())
    rows = suite.rows(f"3_fedtgp_htfe8_{ranks}ranks")
    s_round = per_round_s([r["seconds"] for r in rows])
    client_s = per_round_s([r["client_s"] for r in rows])
    server_s = per_round_s([r["server_s"] for r in rows])
    util = run.gpu_util(sum(r["seconds"] for r in rows[1:]) or None)
    suite.results["paper_size"] = {"rc": run.rc, "s_per_round": s_round, "client_s": client_s, "server_s": server_s,
                                   "gpu_util": util, "gpu_mem_mib": run.gpu_mem_mib}
    lines += ["", f"FedTGP (configs/{FEDTGP_CIFAR100.name}, S = {sizes.server_epochs}) on {ranks} ranks sharing "
              f"the device, {sizes.clients} clients, generated data with CIFAR-100's sizes ({sizes.cifar_samples} "
              f"samples), {sizes.cifar_rounds} rounds (rc {run.rc}): {fmt(s_round)} s/round (clients "
              f"{fmt(client_s)} s, server {fmt(server_s, '.3f')} s), GPU utilisation "
              f"{fmt(util, '.0f', ' %')}, peak GPU memory in use {fmt(run.gpu_mem_mib, '.0f', ' MiB')}.", ""]
    lines += projection(client_s, server_s, s_round, sizes.clients)
    lines += fedtgp_one_process_graphs_concurrent(suite, overrides, ends)
    suite.add_section("3. Paper-size models: HtFE8, CIFAR-100 sizes", lines)


def fedtgp_one_process_graphs_concurrent(suite: Suite, overrides: list[str], ends: float) -> list[str]:
    """Issue 45's FedTGP goal (<= 10 s a round) the other way: one process, local steps recorded
    and clients side by side (auto width), against the ranks above."""
    name = "3_fedtgp_htfe8_1proc_graphs_concurrent"
    if ends - time.monotonic() < 30:
        return ["", f"{name}: skipped, the step's cap was reached."]
    extra = ["train.cuda_graphs=auto", "train.concurrent_clients=0"]
    run = suite.ours(name, FEDTGP_CIFAR100, overrides + extra, 1, ends - time.monotonic())
    rows = suite.rows(name)
    s_round = per_round_s([r["seconds"] for r in rows])
    util = run.gpu_util(sum(r["seconds"] for r in rows[1:]) or None)
    suite.results["paper_size_1proc_graphs_concurrent"] = {"rc": run.rc, "s_per_round": s_round, "gpu_util": util}
    return ["", f"The same in one process with `{' '.join(extra)}` (rc {run.rc}): {fmt(s_round)} s/round, GPU "
            f"utilisation {fmt(util, '.0f', ' %')}; logs/{name}.log says the width auto settled on."]


def projection(client_s: float | None, server_s: float | None, s_round: float | None, clients: int) -> list[str]:
    if client_s is None or server_s is None or s_round is None:
        return ["Projection: not made (the run gave no rounds)."]
    per_gpu = -(-clients // 7)
    other = max(0.0, s_round - client_s - server_s)
    projected = client_s * per_gpu / clients + server_s + other
    return [f"**Projection, not a measurement**: FedTGP Table 1's CIFAR-100 run (1000 rounds) on one 8-GPU "
            f"node, rank 0 the server on GPU 0 and the {clients} clients on 7 GPUs (at most {per_gpu} each), "
            f"if a GPU trains its {per_gpu} clients at the pace the shared device trained all {clients}: "
            f"{client_s:.2f} × {per_gpu}/{clients} + server {server_s:.3f} + rest {other:.2f} "
            f"= {projected:.2f} s/round, "
            f"{projected * 1000 / 3600:.2f} h for 1000 rounds (measured here: {s_round:.2f} s/round, "
            f"{s_round * 1000 / 3600:.2f} h)."]


def table_lines(log: Path) -> list[str]:
    text = log.read_text() if log.exists() else ""
    return [line for line in text.splitlines() if line.startswith("|")] or ["(no table: see the log)"]


def step_server(suite: Suite, cap_s: float) -> None:
    ends = time.monotonic() + cap_s
    lines = []
    for classes, held in ((10, 5), (100, 10)):
        name = f"4_fedtgp_server_C{classes}"
        launched = suite.launch(name, [
            suite.python, str(BENCH / "fedtgp_server_step.py"), "--device", suite.args.device,
            "--classes", str(classes), "--held", str(held), "--epochs", str(suite.sizes.server_epochs),
            "--rounds", "3"],
            cap_s=ends - time.monotonic())
        log = (suite.out / "logs" / f"{name}.log").read_text()
        figures = [line for line in log.splitlines() if line.startswith("C=")]
        lines += figures or [f"C={classes}: no figure (rc {launched.rc})"]
    paper = suite.results.get("paper_size") or {}
    if paper.get("server_s") and paper.get("s_per_round"):
        lines.append(f"In step 3's FedTGP round the server took {paper['server_s']:.3f} of "
                     f"{paper['s_per_round']:.2f} s ({100 * paper['server_s'] / paper['s_per_round']:.1f} %).")
    suite.add_section("4. FedTGP's server update on the device", [
        f"`bench/fedtgp_server_step.py --device {suite.args.device}`, 20 clients, K = 512, "
        f"S = {suite.sizes.server_epochs}:", "", *[f"    {line}" for line in lines]])


def step_dp_and_packing(suite: Suite, cap_s: float) -> None:
    ends = time.monotonic() + cap_s
    dp_ends = time.monotonic() + DP_SHARE * cap_s  # the rest is the packing's
    lines: list[str] = []
    # post-update prototypes: what a private release's sensitivity covers
    base = [*fedproto_overrides(suite), "algo.proto_from=post_update", f"rounds={suite.sizes.dp_rounds}"]
    timings = {}
    for name, extra in (("5_plain", []), ("5_dpsgd", ["privacy.enabled=true", "privacy.target_epsilon=4"])):
        launched = suite.ours(name, FEDPROTO, base + extra, 1, dp_ends - time.monotonic())
        timings[name] = per_round_s([r["client_s"] for r in suite.rows(name)])
        lines.append(f"- {name[2:]}: client s/round {fmt(timings[name])} (rc {launched.rc})")
    if timings.get("5_plain") and timings.get("5_dpsgd"):
        ratio = timings["5_dpsgd"] / timings["5_plain"]
        lines.append(f"- DP-SGD (secret noise, ε = 4) costs {ratio:.2f}× a plain round's client time")
    lines += ["", *packing(suite, ends)]
    suite.add_section("5. DP-SGD against plain training; study packing", lines)


def packing(suite: Suite, ends: float) -> list[str]:
    study = suite.work / "packing.yaml"
    study.write_text(json.dumps({
        "title": "GPU suite: packing", "base": str(FEDPROTO),
        "set": dict(o.split("=", 1) for o in [
            *fedproto_overrides(suite), "rounds=1", f"runtime.device={suite.args.device}",
            f"data.cache_dir={suite.work / 'cache'}", "checkpoint_every=0"]),
        "seeds": list(range(suite.sizes.study_cells))}))
    if suite.args.device == "cuda":
        together = ["--jobs", str(suite.sizes.study_cells), "--gpu-memory-per-cell", "8"]
    else:
        together = ["--jobs", "2", "--cores", str(os.cpu_count() or 2)]
    lines, walls = [], {}
    for name, flags in (("together", together), ("one_after_another", ["--jobs", "1"])):
        out = suite.work / f"study_{name}"
        shutil.rmtree(out, ignore_errors=True)
        command = [suite.python, "-m", "htfl_dist.study", str(study), "--out", str(out), *flags]
        launched = suite.launch(f"5_study_{name}", command, cap_s=ends - time.monotonic())
        walls[name] = launched.seconds if launched.ok else None
        lines.append(f"- {suite.sizes.study_cells} cells, `{' '.join(flags)}`: {launched.seconds:.1f} s wall "
                     f"(rc {launched.rc})")
    if walls.get("together") and walls.get("one_after_another"):
        lines.append(f"- packed: {walls['one_after_another'] / walls['together']:.2f}× faster than one after another")
    return lines


def step_pfl(suite: Suite, cap_s: float) -> None:
    """Issue 45 item 8 on the device: pfl-research beside ours and the bare loop on pfl's CIFAR-10
    workload (bench/pfl_side_by_side.py --lockstep --device cuda), pfl from DIR/pfl-wheels on a
    PYTHONPATH of its own with this machine's torch."""
    title = "6. pfl-research beside ours on its CIFAR-10 workload, same device (issue 45 item 8)"
    if not unpack_wheels(suite.prepared / "pfl-wheels", suite.work / "site-pfl"):
        suite.add_section(title, ["Not prepared: DIR has no pfl-wheels/ (bench/gpu_prepare.sh writes it, "
                                  "not with --no-wheels)."])
        return
    sizes = ["--clients", "100", "--per-round", "5", "--samples", "20", "--rounds", "2", "--warmup", "1"] \
        if suite.args.tiny else ["--rounds", "8", "--warmup", "2"]
    report = suite.work / "pfl" / "report.json"
    report.unlink(missing_ok=True)
    launched = suite.launch("6_pfl_side_by_side", [
        suite.python, str(BENCH / "pfl_side_by_side.py"), "--lockstep", "--sides", "pfl,bare,ours", "--device",
        suite.args.device, "--pfl-python", suite.python, "--pfl-path", str(suite.work / "site-pfl"),
        "--work", str(suite.work / "pfl"), "--out", str(report), *sizes], cap_s=cap_s)
    log = (suite.out / "logs" / "6_pfl_side_by_side.log").read_text().splitlines()
    report_starts = [i for i, line in enumerate(log) if line.startswith("pfl's CIFAR-10 workload")]
    shown = log[report_starts[0]:] if report_starts else log[-12:]  # the bench's own report, or how it ended
    if report.exists():
        suite.results["pfl"] = json.loads(report.read_text())
    suite.add_section(title, [
        f"`bench/pfl_side_by_side.py --lockstep --sides pfl,bare,ours --device {suite.args.device} "
        f"{' '.join(sizes)}` (rc {launched.rc}; pfl 0.6.0 with this machine's torch; peak RSS is host memory):",
        "", "```", *shown, "```"])


STEPS: list[tuple[str, float, Callable[[Suite, float], None]]] = [
    ("side by side", 0.50, step_side_by_side),
    ("determinism", 0.0, step_determinism),
    ("paper-size models", 0.24, step_paper_size),
    ("FedTGP server", 0.06, step_server),
    ("DP-SGD and packing", 0.20, step_dp_and_packing),
    ("pfl beside ours", 0.10, step_pfl),
]
"""Steps in order of value, each with its share of the budget as its cap."""
DP_SHARE = 0.55
"""Of step 5's cap, what DP-SGD against plain training may take; the study packing has the rest."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="what bench/gpu_prepare.sh wrote")
    parser.add_argument("out", type=Path, help="summary.md, results.json and logs/ go here")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole suite ends before this")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a dry run of every step")
    parser.add_argument("--no-reference", action="store_true",
                        help="leave HtFLlib's run out of step 1 though prepared (its figure is in bench/RESULTS.md; "
                             "a short lease then goes to ours)")
    parser.add_argument("--steps", default=",".join(str(n) for n in range(1, len(STEPS) + 1)),
                        help="which steps to run, by number (e.g. 3,5: a rerun of two steps; "
                             "the budget is shared among them; 2 needs 1)")
    parser.add_argument("--variants", default="",
                        help="step 1's runs of ours to make, by name (e.g. ours_1proc,ours_graphs: a lease that "
                             "rechecks a fix; default all, in order of value)")
    parser.add_argument("--work", type=Path, default=None,
                        help="scratch for data and runs (default $TMPDIR/htfl_gpu_suite; keep it off OUT)")
    args = parser.parse_args(argv)
    try:
        args.steps = {int(number) for number in args.steps.split(",")}
    except ValueError:
        parser.error(f"--steps {args.steps}: step numbers separated by commas, e.g. 3,5")
    if not args.steps or not args.steps <= set(range(1, len(STEPS) + 1)):
        parser.error(f"--steps: numbers from 1 to {len(STEPS)}")
    args.variants = {name for name in args.variants.split(",") if name}
    if 2 in args.steps and 1 not in args.steps:
        parser.error("--steps: step 2 compares step 1's runs; name 1 too")
    if not (args.dir / "fmnist").is_dir():
        parser.error(f"{args.dir} holds no fmnist/: run bench/gpu_prepare.sh {args.dir} first")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            parser.error("--device cuda but torch sees no GPU; use --device cpu --tiny for a dry run")
    return args


def main(argv: list[str] | None = None) -> int:
    suite = Suite(parse_args(argv))
    (suite.out / "logs").mkdir(parents=True, exist_ok=True)
    suite.work.mkdir(parents=True, exist_ok=True)
    print(f"gpu_suite: {machine_line(suite.args.device)}", flush=True)
    suite.write_summary()
    if unpack_wheels(suite.prepared / "wheels", suite.work / "site"):
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(suite.work / "site"),
                                                    os.environ.get("PYTHONPATH", "")])
    prepare_data(suite)
    total = suite.left()
    chosen = [(number, *entry) for number, entry in enumerate(STEPS, 1) if number in suite.args.steps]
    shares = sum(share for _, _, share, _ in chosen)
    for _, title, share, step in chosen:
        # a dry run checks that every step works, not that it fits a GPU's shares of the budget
        cap = (suite.left() if suite.args.tiny else total * share / shares) if share else 0.0
        if share and suite.left() < min(cap, 20):
            suite.add_section(title, [f"Skipped: {suite.left():.0f} s of the budget left."])
            continue
        began = time.monotonic()
        step(suite, min(cap, suite.left()) if share else 0.0)
        print(f"gpu_suite: {title}: {time.monotonic() - began:.0f} s", flush=True)
    suite.write_summary()
    print(f"gpu_suite: done in {time.monotonic() - suite.began:.0f} s; {suite.out / 'summary.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
