"""FedRolex (or HeteroFL's static slice) beside FedRolex's official code on one split, round by round.

    python bench/fedrolex_side_by_side.py --reference $REF --out $OUT \\
        [--slice rolling|static --clients 10 --subsample 0.01 --dirichlet 0.1 --rounds 10 --reference-runs 2]

``$REF`` is a clone of AIoT-MLSys-Lab/FedRolex (commit 8135109); nothing of it is fetched or copied.
The script writes PFLlib's Fashion-MNIST split (bench/pfllib_write.py) to ``$OUT/dataset/FMNIST``,
which both sides read: ours with ``data.partition=pfllib``, the reference through the stand-in
runner below (``reference-run``), which imports the reference's own modules unmodified
(``resnet_server.ResnetServerRoll`` / ``ResnetServerStatic``, ``resnet_client.ResnetClient``,
``models.resnet.resnet18``, ``utils.process_control`` / ``make_optimizer`` / ``make_scheduler``) and
plays ``main_resnet.py``'s round loop without its cluster: the official code needs Ray and a CUDA
device, so ``ray`` is a stand-in that runs each actor call in the process, at once, and ``.to('cuda')``
goes to the CPU where there is no GPU (``anytree``, which only its dataset files use, refuses if
called; ``tqdm`` passes its argument through). Its data classes are not used: the runner hands the
split to the reference in the structures its ``main_resnet.py`` builds (a dataset of ``{'img',
'label'}`` items, the per-user index lists, the per-user classes ``label_split``).

Both sides: the pre-activation ResNet18 family at levels a..e (client i at level "abcde"[i mod 5],
ours by its model group; the reference is given the same per-user rates in place of its
contiguous ``fix`` blocks), sBN, the Scaler, masked logits, clipping at 1, a fresh SGD each round,
every client every round, and the rest of ``configs/cifar10_fedrolex_resnet18.yaml`` (momentum,
weight decay, the step schedule), which this script reads and hands to the reference's ``cfg``.
The figure compared is ours, ``test_acc``: each client's sub-model (the slice it would be handed
next round) on its test split, masked, in eval mode (sBN: the batch's statistics; the whole split is
one batch up to 1000 samples on both sides), pooled over clients. The official code reports the
global model instead; the runner computes ours from the reference's own ``distribute``.

The reference runs ``--reference-runs`` times with seeds ``--seed``, ``--seed`` + 1, ... (its
``--num_experiments`` rule); in one process its runs are deterministic (the official Ray workers
are not seeded). Ours runs once (deterministic). The two sides cannot start alike: the initial
weights, client order and batches come from different random streams, so ours is compared with the
reference's run-to-run spread. Prints and writes ``$OUT/fedrolex_side_by_side.{md,json}``.
"""
from __future__ import annotations

import argparse
import functools
import importlib.machinery
import json
import os
import random
import sys
import time
import types
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))  # its siblings, also where a test loads this file by its path
from htfllib_run import _missing, _refusing  # noqa: E402
from side_by_side import (  # noqa: E402,F401
    add_run_arguments,
    cell,
    launch,
    machine,
    markdown,
    our_accuracies,
    reference_commit,
    table_rows,
)

SOURCE = "AIoT-MLSys-Lab/FedRolex at 8135109"
CONFIG = REPO / "configs" / "cifar10_fedrolex_resnet18.yaml"
RUNNER = "reference-run"
"""The first argument that makes this file the reference's stand-in runner."""
SERVERS = {"rolling": "ResnetServerRoll", "static": "ResnetServerStatic"}
"""Our ``algo.slice`` -> the reference's server class (its ``--algo roll | static``). ``random``
is left out: the official one draws a subset per layer, ours one per width (docs/width_scaled.md)."""
REFERENCE_FILES = ("resnet_server.py", "resnet_client.py", "models/resnet.py", "utils.py", "config.yml")
OFFICIAL_OPTIONS = {"label_mask": True, "head_rows": "held_classes", "fresh_optimizer": True, "clip_grad_norm": 1.0}
"""Our options where the reference's code has no switch (``resnet_client.py``: clip 1, a new
optimizer each ``step``; ``combine``: head rows by ``label_split``); the mask is its ``control``."""
TEST_CHUNK = 1000
"""Test samples per forward pass, ours (htfl_dist/runtime/evaluation.py ``TEST_CHUNK``): with sBN the
batch decides the statistics, so the reference's sub-models are tested in the same batches."""


def refuse(message: str) -> None:
    """Bad input: one line naming what is wrong, exit 2."""
    print(f"fedrolex_side_by_side: {message}", file=sys.stderr)
    raise SystemExit(2)


# --------------------------------------------------------------------------- the orchestration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, help="a clone of AIoT-MLSys-Lab/FedRolex (holds resnet_server.py)")
    parser.add_argument("--slice", default="rolling", choices=tuple(SERVERS))
    add_run_arguments(parser, subsample=0.01, clients=10)
    parser.add_argument("--seed", type=int, default=31, help="the reference's first seed (its README's)")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Every refusal before anything is written or run."""
    if args.reference is None or args.out is None:
        refuse("--reference DIR and --out DIR are both needed")
    lacking = [name for name in REFERENCE_FILES if not (args.reference / name).is_file()]
    if lacking:
        refuse(f"{args.reference} lacks {', '.join(lacking)}: pass a clone of {SOURCE}")
    if args.out.exists() and any(args.out.iterdir()):
        refuse(f"{args.out} is not empty; name a new directory")
    for name in ("clients", "rounds", "reference_runs", "batch_size", "local_epochs"):
        if getattr(args, name) < 1:
            refuse(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.subsample <= 1 or args.dirichlet <= 0 or args.lr <= 0:
        refuse("--subsample must be in (0, 1], --dirichlet and --lr above 0")


def our_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    """The config's settings, changed only where the reduced run needs it (every client every
    round, evaluated every round, the written split, one thread)."""
    return [f"rounds={args.rounds}", f"num_clients={args.clients}", "join_ratio=1.0", "eval_every=1",
            "checkpoint_every=0", "data.partition=pfllib", f"data.pfllib_dir={out / 'dataset' / 'FMNIST'}",
            "data.allow_pickle=true", f"train.lr={args.lr}", f"train.batch_size={args.batch_size}",
            f"train.local_epochs={args.local_epochs}", f"algo.slice={args.slice}", "runtime.device=cpu",
            "runtime.threads=1"]


def our_argv(args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "htfl_dist.main", "--config", str(CONFIG), "--out", str(out / "ours"),
            *our_overrides(args, out)]


def reference_settings(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """What the reference's ``cfg`` is given, read from our resolved config, so both sides train
    alike: per-user rates (our group's levels), optimiser, schedule, batch, epochs, rounds."""
    from htfl_dist.config import load_config
    from htfl_dist.models import architecture_for_client
    from htfl_dist.models.width_scaled import member_of

    config = load_config(CONFIG, our_overrides(args, out))
    options = {**config.algo, **config.model.options}
    departing = {key: options.get(key) for key, value in {**OFFICIAL_OPTIONS, "roll_direction": "backward",
                                                          "scaler": True, "norm": "static_bn"}.items()
                 if options.get(key, value) != value}
    if departing or config.train.optimizer != "sgd":
        refuse(f"{CONFIG.name} departs from the reference's fixed code ({departing or config.train.optimizer})")
    rates = []
    for client in range(config.num_clients):
        member = member_of(architecture_for_client(config.model.group, client))
        assert member is not None, config.model.group
        rates.append(member[1])
    train = config.train
    return {"rates": rates, "rounds": config.rounds, "lr": train.lr, "momentum": train.momentum,
            "weight_decay": train.weight_decay, "milestone": train.lr_step_rounds, "factor": train.lr_decay,
            "batch_size": train.batch_size, "local_epochs": train.local_epochs, "server": SERVERS[args.slice]}


def reference_argv(args: argparse.Namespace, out: Path, settings: dict[str, Any], run: int) -> list[str]:
    """The stand-in runner's command for run ``run`` (1-based): seed ``--seed`` + run − 1."""
    return [sys.executable, str(Path(__file__).resolve()), RUNNER, "--clone", str(args.reference),
            "--split", str(out / "dataset" / "FMNIST"), "--server", settings["server"],
            "--seed", str(args.seed + run - 1), "--rates", ",".join(f"{rate:g}" for rate in settings["rates"]),
            "--rounds", str(settings["rounds"]), "--lr", f"{settings['lr']:g}",
            "--momentum", f"{settings['momentum']:g}", "--weight-decay", f"{settings['weight_decay']:g}",
            "--milestone", str(settings["milestone"]), "--factor", f"{settings['factor']:g}",
            "--batch-size", str(settings["batch_size"]), "--local-epochs", str(settings["local_epochs"]),
            "--out-json", str(out / f"reference_{run}" / "accuracies.json")]


def write_split(args: argparse.Namespace, out: Path) -> None:
    """PFLlib's Fashion-MNIST split, which both sides read."""
    from pfllib_write import write_fmnist

    partial = out / "dataset" / "FMNIST.partial"
    write_fmnist(partial, args.fmnist_root, args.clients, args.subsample, args.dirichlet)
    os.replace(partial, out / "dataset" / "FMNIST")


def reference_run(argv: list[str], out: Path, run: int) -> tuple[list[float], int]:
    """One reference run: its accuracy after each round, from the JSON the runner writes."""
    run_dir = out / f"reference_{run}"
    run_dir.mkdir()
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # leave the clone as it was (launch passes os.environ on)
    rc = launch(argv, run_dir / "output.log", cwd=REPO)
    result = run_dir / "accuracies.json"
    return (json.loads(result.read_text())["test_acc"] if result.exists() else []), rc


def report(args: argparse.Namespace, out: Path, settings: dict[str, Any], rows: list[dict],
           rcs: dict[str, int]) -> dict[str, Any]:
    first = reference_argv(args, out, settings, 1)
    return {"method": f"fedrolex, algo.slice={args.slice}", "reference_server": settings["server"],
            "reference_source": SOURCE, "reference_commit": reference_commit(args.reference), "machine": machine(),
            "split": {"data": "fmnist", "subsample": args.subsample, "clients": args.clients,
                      "dirichlet": args.dirichlet, "seed": 1},
            "settings": settings,
            "commands": {"split": f"bench/pfllib_write.py's write_fmnist into {out / 'dataset' / 'FMNIST'}",
                         "reference": " ".join(first).replace(f"--seed {args.seed}", "--seed {seed}"),
                         "reference_seeds": [args.seed + k for k in range(args.reference_runs)],
                         "ours": " ".join(our_argv(args, out))},
            "exit_codes": rcs, "rounds": rows}


def write_report(result: dict[str, Any], out: Path, runs: int) -> str:
    commands = result["commands"]
    text = "\n".join([
        f"# {result['method']} beside {result['reference_source']} ({result['reference_server']})", "",
        f"- the clone's commit: {result['reference_commit']}", f"- machine: {result['machine']}",
        f"- split: {result['split']}", f"- exit codes: {result['exit_codes']}",
        f"- split written by {commands['split']}",
        f"- reference, run k with seed {{seed}} = {', '.join(map(str, commands['reference_seeds']))}: "
        f"`{commands['reference']}`",
        f"- ours: `{commands['ours']}`", "",
        "Test accuracy after each round (each client's sub-model on its test split, pooled), %:", "",
        *markdown(result["rounds"], runs)]) + "\n"
    (out / "fedrolex_side_by_side.md").write_text(text)
    (out / "fedrolex_side_by_side.json").write_text(json.dumps(result, indent=1))
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [RUNNER]:
        return run_reference(argv[1:])
    args = parse_args(argv)
    out = args.out.resolve()
    args.reference = args.reference.resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_split(args, out)
    settings = reference_settings(args, out)
    references, rcs = [], {}
    for run in range(1, args.reference_runs + 1):
        accuracies, rcs[f"reference_{run}"] = reference_run(reference_argv(args, out, settings, run), out, run)
        references.append(accuracies)
    rcs["ours"] = launch(our_argv(args, out), out / "ours.log", cwd=REPO)
    ours = our_accuracies(out / "ours" / "metrics.jsonl")
    result = report(args, out, settings, table_rows(ours, references, args.rounds), rcs)
    print(write_report(result, out, args.reference_runs), end="")
    return 0 if not any(rcs.values()) else 1


# --------------------------------------------------------------------------- the reference's runner


class _Call:
    """``actor.method.remote(...)``: the method, run now (its result stands for the object ref)."""

    def __init__(self, method: Any) -> None:
        self.remote = method


class _Actor:
    def __init__(self, instance: Any) -> None:
        self._instance = instance

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self._instance, name))


class _ActorClass:
    """What ``@ray.remote`` makes of a class: ``.remote(...)`` builds an instance in this process."""

    def __init__(self, cls: type) -> None:
        self._cls = cls

    def remote(self, *args: Any, **kwargs: Any) -> _Actor:
        return _Actor(self._cls(*args, **kwargs))


def _remote(*args: Any, **options: Any) -> Any:
    """``@ray.remote`` and ``@ray.remote(num_gpus=...)`` (resources mean nothing in one process)."""
    if len(args) == 1 and not options and isinstance(args[0], type):
        return _ActorClass(args[0])
    return _ActorClass


def ray_stand_in() -> types.ModuleType:
    """Ray in one process: ``put`` and ``get`` pass values through, actors run their calls at once,
    in the order the driver makes them (the official workers ran them in parallel, unseeded)."""
    ray = types.ModuleType("ray")
    ray.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    ray.init = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    ray.put = lambda value: value  # type: ignore[attr-defined]
    ray.get = lambda ref: list(ref) if isinstance(ref, list) else ref  # type: ignore[attr-defined]
    ray.kill = lambda actor: None  # type: ignore[attr-defined]
    ray.remote = _remote  # type: ignore[attr-defined]
    return ray


def _names_cuda(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("cuda")


def _on_cpu(method: Any) -> Any:
    @functools.wraps(method)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple("cpu" if _names_cuda(arg) else arg for arg in args)
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return method(self, *args, **kwargs)
    return to


def _anytree_attribute(name: str) -> Any:
    """Any public name of the anytree stand-in: a function that refuses when called (only the
    reference's dataset files, which the runner does not use, call anytree)."""
    if name.startswith("__"):  # what import machinery and inspect ask of every module
        raise AttributeError(name)
    return _refusing("anytree", name)


def install_reference_stand_ins() -> list[str]:
    """Ray (working, in process), anytree (refuses), tqdm (pass-through) where absent, and
    ``.to('cuda')`` on the CPU where there is no GPU; returns what was placed (the log says so)."""
    import torch

    placed = []
    if _missing("tqdm"):  # datasets/utils.py: ``from tqdm import tqdm`` (a progress bar)
        tqdm = types.ModuleType("tqdm")
        tqdm.__spec__ = importlib.machinery.ModuleSpec("tqdm", None)
        tqdm.tqdm = lambda iterable=None, *args, **kwargs: iterable  # type: ignore[attr-defined]
        sys.modules["tqdm"] = tqdm
        placed.append("tqdm")
    if _missing("ray"):
        sys.modules["ray"] = ray_stand_in()
        placed.append("ray")
    if _missing("anytree"):
        anytree = types.ModuleType("anytree")
        anytree.__spec__ = importlib.machinery.ModuleSpec("anytree", None)
        anytree.__getattr__ = _anytree_attribute  # type: ignore[attr-defined]
        sys.modules["anytree"] = anytree
        placed.append("anytree")
    if not torch.cuda.is_available():
        torch.Tensor.to = _on_cpu(torch.Tensor.to)  # type: ignore[method-assign]
        torch.nn.Module.to = _on_cpu(torch.nn.Module.to)  # type: ignore[method-assign]
        placed.append("cuda -> cpu")
    return placed


def runner_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"fedrolex_side_by_side.py {RUNNER}")
    parser.add_argument("--clone", type=Path, required=True)
    parser.add_argument("--split", type=Path, required=True, help="PFLlib's layout: train/<id>.npz, test/<id>.npz")
    parser.add_argument("--server", choices=tuple(SERVERS.values()), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--rates", required=True, help="per user, comma-separated")
    for name in ("--rounds", "--milestone", "--batch-size", "--local-epochs"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--lr", "--momentum", "--weight-decay", "--factor"):
        parser.add_argument(name, type=float, required=True)
    parser.add_argument("--out-json", type=Path, required=True)
    return parser.parse_args(argv)


def read_split(directory: Path, users: int) -> tuple[Any, dict[int, list[int]], list[list[int]], list[tuple]]:
    """The split as ``main_resnet.py`` hands it to the server and clients: one training dataset of
    ``{'img', 'label'}`` items (every user's samples, one user after another), each user's indices
    into it, each user's classes (``label_split``: those of its training part, ours
    ``client.classes``), and each user's test part as tensors."""
    import numpy as np
    import torch

    from htfl_dist.data.pfllib import read_pfllib_file

    def read(part: str, user: int) -> tuple[np.ndarray, np.ndarray]:
        return read_pfllib_file(str(directory / part / f"{user}.npz"), True, str(directory))

    trains = [read("train", user) for user in range(users)]
    images = torch.from_numpy(np.concatenate([x for x, _ in trains]))
    labels = np.concatenate([y for _, y in trains]).tolist()
    bounds = np.cumsum([0, *(len(y) for _, y in trains)]).tolist()
    data_split = {user: list(range(bounds[user], bounds[user + 1])) for user in range(users)}
    label_split = [sorted(set(y.tolist())) for _, y in trains]
    tests = [tuple(torch.from_numpy(a) for a in read("test", user)) for user in range(users)]

    class Items(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(labels)

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"img": images[index], "label": labels[index]}

    return Items(), data_split, label_split, tests


def configure(cfg: dict[str, Any], utils: Any, args: argparse.Namespace, users: int) -> None:
    """The reference's ``cfg`` as its ``main_resnet.py`` and ``process_control`` leave it, for a
    ``1_{users}_1_iid_fix_a1-b1-c1-d1-e1_bn_1_1`` control on its 1 x 28 x 28 data (MNIST's
    branch), then our settings where they differ: per-user rates, SGD, lr, schedule, batch, epochs."""
    cfg["control"] = {"fed": "1", "num_users": str(users), "frac": "1", "data_split_mode": "iid",
                      "model_split_mode": "fix", "model_mode": "a1-b1-c1-d1-e1", "norm": "bn", "scale": "1",
                      "mask": "1"}
    cfg["data_name"] = "MNIST"
    utils.process_control()
    cfg.update({
        "classes_size": 10, "model_rate": [float(rate) for rate in args.rates.split(",")], "optimizer_name": "SGD",
        "lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay,
        "scheduler_name": "MultiStepLR", "milestones": [args.milestone], "factor": args.factor,
        "batch_size": {"train": args.batch_size, "test": TEST_CHUNK}, "shuffle": {"train": True, "test": False},
        "num_workers": 0, "num_epochs": {"global": args.rounds, "local": args.local_epochs}, "device": "cpu",
        "world_size": 1, "overlap": None, "weighting": "avg", "active_user": users, "init_seed": args.seed,
        "model_tag": f"{args.seed}_side_by_side", "pivot_metric": "Global-Accuracy",
        "metric_name": {"train": {"Local": ["Local-Loss", "Local-Accuracy"]},
                        "test": {"Local": ["Local-Loss", "Local-Accuracy"],
                                 "Global": ["Global-Loss", "Global-Accuracy"]}}})
    if len(cfg["model_rate"]) != users:
        raise SystemExit(f"--rates gives {len(cfg['model_rate'])} rates for {users} users")


def sub_model_accuracy(server: Any, resnet: Any, cfg: dict[str, Any], tests: list[tuple],
                       label_split: list[list[int]]) -> float:
    """Ours ``test_acc`` of the reference's global model: each user's slice for the next round
    (the server's own ``distribute``) in its member, eval mode, masked logits, pooled. The torch
    RNG is put back afterwards, so testing changes nothing the training draws."""
    import torch

    state = torch.get_rng_state()
    users = list(range(len(tests)))
    local_parameters, _ = server.distribute(users)
    correct = total = 0
    with torch.no_grad():
        for user, (x, y) in enumerate(tests):
            model = resnet.resnet18(model_rate=server.model_rate[user], cfg=cfg)
            model.load_state_dict(local_parameters[user])
            model.train(False)
            for start in range(0, len(y), TEST_CHUNK):
                batch = {"img": x[start : start + TEST_CHUNK], "label": y[start : start + TEST_CHUNK],
                         "label_split": torch.tensor(label_split[user])}
                correct += int((model(batch)["score"].argmax(dim=1) == batch["label"]).sum())
                total += len(batch["label"])
    torch.set_rng_state(state)
    return correct / max(total, 1)


def run_reference(argv: list[str]) -> int:
    """``main_resnet.py``'s ``run_experiment`` without Ray or CUDA, on the given split, testing
    each round's sub-models as ours are tested; writes the accuracies to ``--out-json``."""
    args = runner_args(argv)
    clone, split, out_json = args.clone.resolve(), args.split.resolve(), args.out_json.resolve()
    os.chdir(clone)  # its config.py reads config.yml from the working directory
    sys.path.insert(0, str(clone))
    print(f"{RUNNER}: stand-ins: {', '.join(install_reference_stand_ins())}", flush=True)
    import numpy as np
    import resnet_server  # the reference's modules, unmodified
    import torch
    import utils
    from config import cfg
    from models import resnet
    from resnet_client import ResnetClient

    users = len(list((split / "train").glob("*.npz")))
    configure(cfg, utils, args, users)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    dataset, data_split, label_split, tests = read_split(split, users)
    global_model = resnet.resnet18(model_rate=cfg["global_model_rate"], cfg=cfg)
    optimizer = utils.make_optimizer(global_model, cfg["lr"])
    scheduler = utils.make_scheduler(optimizer)
    dataset_ref = {"dataset": dataset, "split": data_split, "label_split": label_split}
    server = getattr(resnet_server, args.server)(global_model, cfg["model_rate"], dataset_ref, cfg)
    local = [ResnetClient.remote(str(out_json.parent), [cfg]) for _ in range(cfg["active_user"])]
    accuracies: list[float] = []
    for round_number in range(1, args.rounds + 1):
        scheduler.step()
        local, param_idx, user_idx = server.broadcast(local, optimizer.param_groups[0]["lr"])
        start = time.time()
        trained = [client.step.remote(m, len(local), start) for m, client in enumerate(local)]
        server.step(trained, param_idx, user_idx)
        accuracies.append(sub_model_accuracy(server, resnet, cfg, tests, label_split))
        print(f"{RUNNER}: round {round_number} test_acc {accuracies[-1]:.6f} ({time.time() - start:.1f}s)",
              flush=True)
        out_json.write_text(json.dumps({"seed": args.seed, "server": args.server, "test_acc": accuracies}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
