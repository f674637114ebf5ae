"""Run HtFLlib's ``system/main.py`` unmodified on a machine that lacks some of its imports.

    python bench/htfllib_run.py SYSTEM_DIR -data FMNIST -m HCNNs8 -algo FedProto ...

HtFLlib's main module imports every algorithm it ships, and with them packages that FedProto and
FedTGP never call: ``higher`` (FedL2G) and scikit-learn (the AUC of the base client's metrics).
Where one is missing, this puts a stand-in module in its place whose functions *raise* when
called, so a run that did need one fails loudly instead of reporting a made-up number (``tqdm``, a
progress bar, and ``calmsize``, the memory report's formatting, pass their argument through).
The same holds for the references built on HtFLlib (ProtoNorm, FedORGP), whose extra imports are
listed below; the stand-ins are placed after the reference's folder is on the path, so its own
modules win. It also keeps ``torch.load``'s pre-2.6 default (``weights_only=False``): the
reference pickles whole models into its own temp folder and reads them back each round, which
newer torch refuses by default. Nothing of the reference's code is changed or copied; it runs
from its own folder (it reads ``../dataset/<name>``) with its own argument parser.
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import re
import runpy
import sys
import types

import torch

STAND_INS = {
    "higher": ("innerloop_ctx",),
    "sklearn": (),
    "sklearn.preprocessing": ("label_binarize",),
    "sklearn.metrics": ("roc_auc_score",),
    "sklearn.manifold": ("TSNE",),  # ProtoNorm's server (its plots)
    "sklearn.cluster": ("KMeans",),  # FedORGP's main.py
    "timm": (),  # FedORGP's models.py
    "torch_utils": (),  # StyleGAN's code, which bench/gpu_prepare.sh leaves out (FedKTL only)
    "torch_utils.gen_utils": (),
    "flcore.servers.servermrl": ("FedMRL",),  # FedORGP's main.py imports it; its repository lacks it
}
"""Module -> functions the reference imports from it (only where the real module is absent)."""
PASS_THROUGH = {"tqdm": "tqdm", "calmsize": "size"}
"""Module -> a function that returns its first argument, for what changes nothing computed:
FedORGP's server loops over ``tqdm(clients)`` (a progress bar); ``calmsize.size`` formats the
memory report the references print after their last evaluation (bytes then stay unformatted;
with the refusing stand-in FedORGP's run ended in an error after its results)."""
ACCURACY = re.compile(r"(?:^|\] )Averaged Test Accuran?cy: ([\d.]+)\s*$", flags=re.M)
"""An evaluation's line: HtFLlib prints it ("Accurancy"); FedORGP's logger writes it to a file,
spelt "Accuracy", after a ``[date]``."""
ITERATION_SECONDS = re.compile(r"^-{50} ([\d.]+)$", flags=re.M)


def log_accuracies(text: str) -> list[float]:
    """The accuracies of a reference's evaluations, in order (HtFLlib evaluates before each
    iteration's training, so its first is of the untrained models)."""
    return [float(m) for m in ACCURACY.findall(text)]


def log_seconds(text: str) -> list[float]:
    """HtFLlib's per-iteration seconds (its ``'-' * 50, seconds`` lines)."""
    return [float(m) for m in ITERATION_SECONDS.findall(text)]


def _refusing(module: str, name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} is not installed on this machine (bench/htfllib_run.py "
                           f"stands in for it only where the algorithm never calls it)")
    return refuse


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is missing
        return True


def install_stand_ins() -> list[str]:
    """Stand-in modules for the absent ones; returns their names (printed, so a log says so)."""
    placed = []
    for module, names in STAND_INS.items():
        if module in sys.modules or not _missing(module):
            continue
        stand_in = types.ModuleType(module)
        stand_in.__spec__ = importlib.machinery.ModuleSpec(module, None)  # torch's import scans ask
        for name in names:
            setattr(stand_in, name, _refusing(module, name))
        sys.modules[module] = stand_in
        parent, _, child = module.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, stand_in)
        placed.append(module)
    for module, name in PASS_THROUGH.items():
        if module not in sys.modules and _missing(module):
            stand_in = types.ModuleType(module)
            stand_in.__spec__ = importlib.machinery.ModuleSpec(module, None)
            setattr(stand_in, name, lambda iterable=None, *args, **kwargs: iterable)
            sys.modules[module] = stand_in
            placed.append(module)
    return placed


def main() -> None:
    if len(sys.argv) < 2 or not os.path.isfile(os.path.join(sys.argv[1], "main.py")):
        sys.exit("usage: htfllib_run.py SYSTEM_DIR [HtFLlib main.py arguments]  (SYSTEM_DIR holds main.py)")
    system_dir = os.path.abspath(sys.argv[1])
    os.chdir(system_dir)
    sys.path.insert(0, system_dir)  # first: a stand-in is placed only where the reference's own module is absent
    placed = install_stand_ins()
    if placed:
        print(f"htfllib_run: stand-ins (raise if called) for absent modules: {', '.join(placed)}", flush=True)
    torch.load = functools.partial(torch.load, weights_only=False)  # type: ignore[assignment]
    sys.argv = [os.path.join(system_dir, "main.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
