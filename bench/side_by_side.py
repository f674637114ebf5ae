"""One method, ours beside its reference code, on one split both read, round by round.

    python bench/side_by_side.py fedproto --reference $REF --out $OUT \\
        [--subsample 0.1 --clients 20 --dirichlet 0.1 --rounds 10 --reference-runs 2]

``$REF`` is a clone of the method's reference code (the ``source`` column of ``--list`` names the
repository and commit); nothing is fetched. The script writes PFLlib's Fashion-MNIST split
(bench/pfllib_write.py, from this machine's FMNIST) to ``$OUT/dataset/FMNIST``, runs the reference
``--reference-runs`` times, each from its own copy of ``$REF/system`` in ``$OUT`` (unmodified,
through bench/htfllib_run.py's stand-ins for imports it never calls), and ours once (ours is
deterministic), with the same rounds, clients, model group (HtCNN8), lr, batch size and local
epochs; METHODS below maps each method's hyper-parameters to both sides' arguments. It prints
the per-round test accuracy of both sides, the reference's run-to-run spread and ours minus the
reference's mean, and writes the table, the machine, the reference's commit and the exact
commands to ``$OUT/side_by_side.{md,json}``.

Only references laid out as HtFLlib (``system/main.py`` with ``-algo``, reading
``../dataset/<NAME>/{train,test}/<id>.npz``) are wired; ``--list`` says which are not and why.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))  # its siblings, also where a test loads this file by its path
from htfllib_run import log_accuracies  # noqa: E402

HTFLLIB = "TsingZ0/HtFLlib at 728e52a (3fb1596^: the last commit with the HCNNs8 family)"
FAMILY = "HCNNs8"
"""The reference's name for our HtCNN8 group (the eight ``CNN(num_cov, hidden_dims)`` members)."""


@dataclasses.dataclass(frozen=True)
class Method:
    """How one method runs on both sides: the reference's ``-algo`` and the flags of its
    hyper-parameters, our config and the overrides that set the same ones."""

    algo: str
    flags: tuple[str, ...]
    config: str
    overrides: tuple[str, ...] = ()
    source: str = HTFLLIB
    data_name: str = "FMNIST"
    """The folder under ``dataset/`` the reference reads (a link to the written split)."""
    classes_flag: str = "-ncl"
    rounds_flag: str = "-gr"
    evaluates_first: bool = True
    """HtFLlib evaluates before each iteration's training (its first evaluation is of the
    untrained models, and ``-gr R`` runs R + 1 iterations); FedORGP evaluates after it."""


REFERENCE_OPTIONS = ("model.init=htfllib", "train.batch_order=fixed", "train.last_batch=drop")
"""The reference's initial weights and batching, on our side for every method."""

METHODS: dict[str, Method] = {
    "fedproto": Method("FedProto", ("-lam", "10"), "fmnist_htcnn8_fedproto_dirichlet.yaml"),
    "fedtgp": Method("FedTGP", ("-lam", "10", "-se", "100", "-mart", "100", "-slr", "0.01"),
                     "fmnist_htcnn8_fedtgp_dirichlet.yaml"),
    "fedgen": Method("FedGen", ("-nd", "32", "-hd", "512", "-glr", "0.1", "-se", "100"),
                     "fmnist_htcnn8_fedgen_dirichlet.yaml"),
    "lgfedavg": Method("LG-FedAvg", (), "fmnist_htcnn8_lgfedavg_dirichlet.yaml"),
    "fml": Method("FML", ("-al", "0.5", "-bt", "0.5"), "fmnist_htcnn8_fml_dirichlet.yaml"),
    "fedkd": Method("FedKD", ("-mlr", "0.01", "-Ts", "0.95", "-Te", "0.98"), "fmnist_htcnn8_fedkd_dirichlet.yaml",
                    ("algo.global_rounds={reference_rounds}",)),  # its energy schedule spans -gr
    "feddistill": Method("FedDistill", ("-lam", "1"), "fmnist_htcnn8_feddistill_dirichlet.yaml"),
    "fedgh": Method("FedGH", ("-se", "1", "-slr", "0.01"), "fmnist_htcnn8_fedgh_dirichlet.yaml"),
    "fedmrl": Method("FedMRL", ("-sfd", "128"), "fmnist_htcnn8_fedmrl_dirichlet.yaml", ("algo.compat=reference",)),
    "fedl2g": Method("FedL2G-feat", ("-slr", "100", "-mdb", "1", "-mqb", "1", "-wu", "0"),
                     "fmnist_htcnn8_fedl2g_dirichlet.yaml",
                     ("algo.compat=reference", "algo.warm_up_rounds=0", "algo.guide=feature"),
                     source="TsingZ0/HtFLlib at e959261 (the only commit with FedL2G; its main.py lacks "
                            "HCNNs8: the user adds 728e52a's eight lines to the clone)"),
    "protonorm": Method("ProtoNorm", ("-pa", "-pu", "-csf", "80", "-lam", "10"),
                        "fmnist_htcnn8_protonorm_dirichlet.yaml",
                        ("algo.proto_from=pre_update", "algo.proto_samples=full_batches"),
                        source="regulationLee/ProtoNorm at e816cef (its main.py lacks HCNNs8: the user adds "
                               "HtFLlib 728e52a's eight lines to the clone; for its models to start from "
                               "HtFLlib's weights, as ours do, also uncomment clientbase.py's "
                               "torch.manual_seed(0))", classes_flag="-nb"),
    "fedorgp": Method("FedOrth", ("-clam", "10", "-slam", "1", "-gam", "10", "-se", "1"),
                      "fmnist_htcnn8_fedorgp_dirichlet.yaml", ("algo.compat=reference",),
                      source="wisheverybodyhapi/FedORGP at ff4a036", data_name="Fashion", classes_flag="-nb",
                      rounds_flag="-er", evaluates_first=False),
}
"""Method -> both sides' arguments; each flag's value is the one our config (or its override) sets."""

NOT_WIRED = {
    "fedktl": "needs its reference's pretrained generator (StyleGAN / Stable Diffusion weights)",
    "fedoc": "version 1 of FedORGP's paper; its reference's main.py runs version 2 (FedOrth) only",
    "fedpcl": "PFLlib's main.py has no heterogeneous model family (HCNNs8)",
    "fedhkd": "own layout", "fednh": "own layout", "fpl": "own layout", "fedpac": "own layout",
    "fedgmkd": "own layout", "fedrolex": "own layout", "heterofl": "own layout",
}
"""Methods with a reference code that this script cannot run, and why (one line each)."""


def refuse(message: str) -> None:
    """Bad input: one line naming what is wrong, exit 2."""
    print(f"side_by_side: {message}", file=sys.stderr)
    raise SystemExit(2)


def add_run_arguments(parser: argparse.ArgumentParser, subsample: float, clients: int) -> None:
    """The options every side-by-side script shares: where, the split and the training sizes
    (also read by bench/fedrolex_side_by_side.py, so both scripts take one spelling)."""
    parser.add_argument("--out", type=Path, help="a new or empty directory: the split, the runs, the table")
    parser.add_argument("--fmnist-root", default=None, help="FMNIST's four IDX files (default: this machine's)")
    parser.add_argument("--subsample", type=float, default=subsample)
    parser.add_argument("--clients", type=int, default=clients)
    parser.add_argument("--dirichlet", type=float, default=0.1, help="β of the Dirichlet split")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reference-runs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", nargs="?", help="e.g. fedproto (--list: every method and its reference)")
    parser.add_argument("--list", action="store_true", help="print the wired and the unwired methods and exit")
    parser.add_argument("--reference", type=Path, help="a clone of the method's reference code (holds system/main.py)")
    parser.add_argument("--data", default="fmnist", choices=("fmnist",))
    add_run_arguments(parser, subsample=0.1, clients=20)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.list:
        return args
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Every refusal before anything is written or run."""
    if not args.method:
        refuse("name a method (--list shows them)")
    if args.method in NOT_WIRED:
        refuse(f"{args.method} is not wired: {NOT_WIRED[args.method]}")
    if args.method not in METHODS:
        refuse(f"unknown method {args.method!r}; wired: {', '.join(METHODS)}")
    if args.reference is None or args.out is None:
        refuse("--reference DIR and --out DIR are both needed")
    main_py = args.reference / "system" / "main.py"
    if not main_py.is_file():
        refuse(f"{args.reference} has no system/main.py: pass a clone laid out as HtFLlib")
    if f'"{FAMILY}"' not in main_py.read_text(errors="replace"):
        refuse(f"{main_py} has no {FAMILY} model family; the reference named for "
               f"{args.method}: {METHODS[args.method].source}")
    if args.out.exists() and any(args.out.iterdir()):
        refuse(f"{args.out} is not empty; name a new directory")
    for name in ("clients", "rounds", "reference_runs", "batch_size", "local_epochs"):
        if getattr(args, name) < 1:
            refuse(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.subsample <= 1 or args.dirichlet <= 0 or args.lr <= 0:
        refuse("--subsample must be in (0, 1], --dirichlet and --lr above 0")


def reference_argv(method: Method, args: argparse.Namespace) -> list[str]:
    """The reference's own arguments: the shared setup, then the method's hyper-parameters."""
    return ["-data", method.data_name, "-m", FAMILY, "-algo", method.algo,
            method.rounds_flag, str(reference_rounds(method, args)), "-nc", str(args.clients),
            method.classes_flag, "10", "-lbs", str(args.batch_size), "-lr", str(args.lr),
            "-ls", str(args.local_epochs), "-jr", "1", "-fd", "512", "-dev", args.device, *method.flags]


def reference_rounds(method: Method, args: argparse.Namespace) -> int:
    """``-gr R`` evaluates R + 1 times, first the untrained models: R rounds of training
    evaluated. FedORGP's ``-er R`` trains and then evaluates R times."""
    return args.rounds


def our_argv(method: Method, args: argparse.Namespace, out: Path) -> list[str]:
    extra = [o.format(reference_rounds=reference_rounds(method, args)) for o in method.overrides]
    return [sys.executable, "-m", "htfl_dist.main", "--config", str(REPO / "configs" / method.config),
            "--out", str(out / "ours"), f"rounds={args.rounds}", f"num_clients={args.clients}", "join_ratio=1.0",
            "data.partition=pfllib", f"data.pfllib_dir={out / 'dataset' / 'FMNIST'}", "data.allow_pickle=true",
            f"train.lr={args.lr}", f"train.batch_size={args.batch_size}", f"train.local_epochs={args.local_epochs}",
            "model.feature_dim=512", *REFERENCE_OPTIONS, f"runtime.device={args.device}", "runtime.threads=1",
            "checkpoint_every=0", *extra]


def write_split(args: argparse.Namespace, out: Path) -> None:
    """PFLlib's layout, which both sides read (the reference under its own name for it)."""
    from pfllib_write import write_fmnist

    dataset = out / "dataset"
    partial = dataset / "FMNIST.partial"
    write_fmnist(partial, args.fmnist_root, args.clients, args.subsample, args.dirichlet)
    os.replace(partial, dataset / "FMNIST")
    for method in METHODS.values():
        if method.data_name != "FMNIST" and not (dataset / method.data_name).exists():
            (dataset / method.data_name).symlink_to("FMNIST")


def copy_system(reference: Path, run_dir: Path) -> Path:
    """A fresh copy of the reference's ``system/`` per run (its temp files and logs stay apart),
    beside a link to the split: it reads ``../dataset/<NAME>``. The generators' folders, which
    no wired method reads, are left out."""
    system = run_dir / "system"
    shutil.copytree(reference / "system", system, symlinks=True,
                    ignore=shutil.ignore_patterns("stylegan", "stable-diffusion", "__pycache__", "temp"))
    (run_dir / "dataset").symlink_to(Path("..") / "dataset")
    return system


def launch(command: list[str], log: Path, cwd: Path | None = None) -> int:
    """One run, its output in ``log`` (one thread: the numbers do not depend on it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        return subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd, env=env).returncode


def reference_run(method: Method, args: argparse.Namespace, out: Path, run: int) -> tuple[list[float], int]:
    """The accuracy after each of ``args.rounds`` rounds, from the run's output and any log file
    it wrote (FedORGP logs to a file only)."""
    run_dir = out / f"reference_{run}"
    run_dir.mkdir()
    system = copy_system(args.reference, run_dir)
    log = run_dir / "output.log"
    rc = launch([sys.executable, str(BENCH / "htfllib_run.py"), str(system), *reference_argv(method, args)], log)
    texts = [log.read_text(errors="replace")]
    texts += [p.read_text(errors="replace") for p in sorted(system.rglob("*.log"))]
    accuracies = log_accuracies("\n".join(texts))
    return accuracies[1:] if method.evaluates_first else accuracies, rc


def our_run(method: Method, args: argparse.Namespace, out: Path) -> tuple[list[float], int]:
    rc = launch(our_argv(method, args, out), out / "ours.log", cwd=REPO)
    return our_accuracies(out / "ours" / "metrics.jsonl"), rc


def our_accuracies(metrics: Path) -> list[float]:
    """``test_acc`` of each evaluated round (runtime/records.py writes one row per evaluation)."""
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row["test_acc"] for row in sorted(rows, key=lambda row: row["round"])]


def table_rows(ours: list[float], references: list[list[float]], rounds: int) -> list[dict]:
    """Per round, in %: ours, each reference run, the runs' spread (max − min) and ours minus
    their mean; None where a side has no figure for that round."""
    rows = []
    for index in range(rounds):
        mine = 100 * ours[index] if index < len(ours) else None
        theirs = [100 * run[index] if index < len(run) else None for run in references]
        present = [value for value in theirs if value is not None]
        mean = statistics.fmean(present) if present else None
        rows.append({"round": index + 1, "ours": mine, "reference": theirs,
                     "spread": max(present) - min(present) if present else None,
                     "ours_minus_mean": mine - mean if mine is not None and mean is not None else None})
    return rows


def cell(value: float | None) -> str:
    return "–" if value is None else f"{round(value, 2) + 0.0:.2f}"  # + 0.0: no "-0.00"


def markdown(rows: list[dict], runs: int) -> list[str]:
    head = ["round", "ours", *(f"reference {k}" for k in range(1, runs + 1)), "reference spread",
            "ours − reference mean"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        values = [row["ours"], *row["reference"], row["spread"], row["ours_minus_mean"]]
        lines.append(f"| {row['round']} | " + " | ".join(cell(v) for v in values) + " |")
    return lines


def machine() -> str:
    """The CPU's model name, core count, and the GPU if one is used."""
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{model}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}, python {platform.python_version()}"


def reference_commit(reference: Path) -> str:
    done = subprocess.run(["git", "-C", str(reference), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def report(name: str, method: Method, args: argparse.Namespace, out: Path, rows: list[dict],
           rcs: dict[str, int]) -> dict:
    return {"method": name, "reference_algo": method.algo, "reference_source": method.source,
            "reference_commit": reference_commit(args.reference), "machine": machine(),
            "split": {"data": args.data, "subsample": args.subsample, "clients": args.clients,
                      "dirichlet": args.dirichlet, "seed": 1},
            "commands": {"split": f"bench/pfllib_write.py's write_fmnist into {out / 'dataset' / 'FMNIST'}",
                         "reference": "cd {run}/system && " + " ".join(
                             [sys.executable, str(BENCH / "htfllib_run.py"), ".", *reference_argv(method, args)]),
                         "ours": " ".join(our_argv(method, args, out))},
            "exit_codes": rcs, "rounds": rows}


def write_report(result: dict, out: Path, runs: int) -> str:
    commands = result["commands"]
    text = "\n".join([
        f"# {result['method']} beside its reference ({result['reference_algo']})", "",
        f"- reference: {result['reference_source']}; the clone's commit: {result['reference_commit']}",
        f"- machine: {result['machine']}",
        f"- split: {result['split']}", f"- exit codes: {result['exit_codes']}",
        f"- split written by {commands['split']}",
        f"- reference (each run from its own copy, {{run}} = "
        f"{', '.join(f'reference_{k}' for k in range(1, runs + 1))}): "
        f"`{commands['reference']}`",
        f"- ours: `{commands['ours']}`", "",
        "Test accuracy after each round, %:", "", *markdown(result["rounds"], runs)]) + "\n"
    (out / "side_by_side.md").write_text(text)
    (out / "side_by_side.json").write_text(json.dumps(result, indent=1))
    return text


def list_methods() -> None:
    for name, method in METHODS.items():
        print(f"{name}: -algo {method.algo} {' '.join(method.flags)}  [{method.source}]")
    for name, why in NOT_WIRED.items():
        print(f"{name}: not wired: {why}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_methods()
        return 0
    method, out = METHODS[args.method], args.out.resolve()
    args.reference = args.reference.resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_split(args, out)
    references, rcs = [], {}
    for run in range(1, args.reference_runs + 1):
        accuracies, rcs[f"reference_{run}"] = reference_run(method, args, out, run)
        references.append(accuracies)
    ours, rcs["ours"] = our_run(method, args, out)
    result = report(args.method, method, args, out, table_rows(ours, references, args.rounds), rcs)
    print(write_report(result, out, args.reference_runs), end="")
    return 0 if not any(rcs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
