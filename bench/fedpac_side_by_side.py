"""FedPAC beside its reference codes on the same tensors (docs/algorithms.md, "FedPAC").

    python bench/fedpac_side_by_side.py OFFICIAL_CLONE PFLLIB_CLONE

OFFICIAL_CLONE is a checkout of github.com/JianXu95/FedPAC (5770f4f), PFLLIB_CLONE one of
github.com/TsingZ0/PFLlib (d832e76); nothing of theirs is copied here. The reference modules need
``cvxpy`` (and scipy) importable. What is compared, on random data and a small MLP:

1. one local round of a client (the official ``LocalUpdate_FedPAC.local_training``, round 1, with
   global prototypes for all but one of its classes) against ``FedPACClient.train`` with the
   official optimiser settings (SGD momentum 0.5, weight decay 5e-4, head lr 0.1, stored order):
   the trained parameters, the pre-training statistics (``statistics_extraction``: V / n and
   h = p·μ) and the post-training prototypes;
2. the server's prototypes (official ``tools.protos_aggregation``) and the heads' combination
   weights (PFLlib ``serverpac.solve_quadratic``, cvxpy, renormalised as the official
   ``agg_classifier_weighted_p`` does; the official ``get_head_agg_weight`` calls ``torch.eig``,
   which current torch no longer has, and is otherwise the same code) for random uploads;
3. 4 whole rounds of one client through the official ``running.train_round_fedpac`` against
   ours with a fresh SGD each round, as the official client builds one (``one_client_rounds``).

Prints the largest absolute difference of each.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import io
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.fedpac import bias_rows, combination_weights
from htfl_dist.config import TrainConfig
from htfl_dist.models import SplitModel

CLASSES, WIDTH, SAMPLES, BATCH, EPOCHS, LR, LAM = 4, 8, 60, 10, 2, 0.05, 1.0


class Referenced(nn.Module):
    """The official code's model contract: forward returns (features, logits); its head's keys."""

    def __init__(self, model: SplitModel) -> None:
        super().__init__()
        self.feature_extractor, self.head = model.feature_extractor, model.head
        self.classifier_weight_keys = ["head.weight", "head.bias"]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.feature_extractor(x)
        return features, self.head(features)


def functions_of(path: Path, names: set[str], namespace: dict) -> dict:
    """The named top-level functions of a reference file, executed in ``namespace`` (the file's
    other imports, such as its package's base classes, are not needed)."""
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    exec(compile(tree, str(path), "exec"), namespace)  # the reference, run beside ours
    return namespace


def small_model(seed: int) -> SplitModel:
    torch.manual_seed(seed)
    extractor = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, WIDTH), nn.ReLU())
    return SplitModel(extractor, nn.Linear(WIDTH, CLASSES), feature_dim=WIDTH)


def client_round(official: Path) -> None:
    sys.path.insert(0, str(official))
    from methods.fedpac import LocalUpdate_FedPAC  # the official client

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 12, generator=generator)
    y = torch.tensor([0, 1, 1, 2, 2, 2] * (SAMPLES // 6))  # class 3 absent
    theirs = Referenced(small_model(0))
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    args = SimpleNamespace(num_classes=CLASSES, device="cpu", lr=LR, lam=LAM)
    reference = LocalUpdate_FedPAC(0, args, loader, loader, theirs)
    global_protos = {0: torch.randn(WIDTH, generator=generator), 1: torch.randn(WIDTH, generator=generator)}
    reference.global_protos = global_protos  # class 2 has none: the official code falls back on its own mean
    v, h = reference.statistics_extraction()
    _, _, _, _, _, their_protos = reference.local_training(local_epoch=EPOCHS, round=1)

    model, upload = our_round(x, y, global_protos, LAM)
    ours = {name: p.detach() for name, p in Referenced(model).named_parameters()}
    start = {name: p.detach() for name, p in Referenced(small_model(0)).named_parameters()}
    control = {name: p.detach() for name, p in Referenced(our_round(x, y, global_protos, 0.0)[0]).named_parameters()}
    parameters = max(float((ours[name] - p.detach()).abs().max()) for name, p in theirs.named_parameters())
    moved = max(float((ours[name] - start[name]).abs().max()) for name in ours)
    without = max(float((control[name] - p.detach()).abs().max()) for name, p in theirs.named_parameters())
    variance = abs(float(upload["variance"][0]) / SAMPLES - v)
    bias = float((bias_rows(upload, CLASSES) - h.double()).abs().max())
    protos = max(float((upload["protos"][row] - their_protos[int(k)]).abs().max())
                 for row, k in enumerate(upload["class_ids"]))
    print(f"client round: parameters {parameters:.2e} (moved by up to {moved:.3f}; ours at λ = 0: {without:.2e} off), "
          f"V/n {variance:.2e} (V/n = {v:.4f}), h = p·μ {bias:.2e}, post-update prototypes {protos:.2e}")


def our_round(x: torch.Tensor, y: torch.Tensor, global_protos: dict, lam: float) -> tuple[SplitModel, dict]:
    """``FedPACClient.train`` on ``small_model(0)`` with the official optimiser settings."""
    entry = get_algorithm("fedpac")
    train = TrainConfig(batch_size=BATCH, lr=LR, local_epochs=EPOCHS, momentum=0.5, weight_decay=5e-4,
                        batch_order="fixed")
    context = AlgorithmContext(num_classes=CLASSES, feature_dim=WIDTH, seed=0, train=train,
                               options=parse_options(entry, {"lam": lam, "head_lr": 0.1}), num_clients=1)
    model = small_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5, weight_decay=5e-4)
    client = ClientState(0, "mlp", model, optimizer, x, y, x, y, torch.device("cpu"))
    knowledge = {"class_ids": torch.tensor([0, 1]), "protos": torch.stack([global_protos[0], global_protos[1]]),
                 "head_ids": torch.empty(0, dtype=torch.int64), "heads": torch.empty(0, WIDTH * CLASSES + CLASSES)}
    return model, entry.client(context).train(client, knowledge, 0, torch.Generator().manual_seed(0)).upload


def server_round(official: Path, pfllib: Path, clients: int = 6, seed: int = 3, scale: float = 1.0) -> None:
    namespace: dict = {"torch": torch, "np": np, "copy": copy}
    import cvxpy
    namespace["cvx"] = cvxpy
    functions_of(official / "tools.py", {"protos_aggregation", "agg_classifier_weighted_p"}, namespace)
    functions_of(pfllib / "system/flcore/servers/serverpac.py", {"solve_quadratic", "pairwise"}, namespace)
    generator = torch.Generator().manual_seed(seed)
    server = get_algorithm("fedpac").server(AlgorithmContext(
        num_classes=CLASSES, feature_dim=WIDTH, seed=0, train=TrainConfig(),
        options=parse_options(get_algorithm("fedpac"), {}), num_clients=clients, model_group="mlp"))
    uploads, their_protos, their_sizes, variances, hs = {}, [], [], [], []
    for j in range(clients):
        held = sorted(torch.randperm(CLASSES, generator=generator)[: 2 + j % 3].tolist())
        counts = torch.randint(1, 30, (len(held),), generator=generator)
        means = torch.randn(len(held), WIDTH, generator=generator) * (1 + j % 2) * scale
        protos = torch.randn(len(held), WIDTH, generator=generator)
        variance = float(torch.rand((), generator=generator)) * 5
        uploads[j] = {"class_ids": torch.tensor(held), "counts": counts, "protos": protos, "means": means,
                      "variance": torch.tensor([variance])}
        sizes = torch.zeros(CLASSES)
        sizes[held] = counts.float()
        their_protos.append({k: protos[row] for row, k in enumerate(held)})
        their_sizes.append(sizes)
        variances.append(variance / float(counts.sum()))
        hs.append(bias_rows(uploads[j], CLASSES).float())
    server.aggregate_prototypes([uploads[j] for j in range(clients)])
    reference = namespace["protos_aggregation"](their_protos, their_sizes)
    protos = max(float((server.protos[row] - reference[int(k)]).abs().max())
                 for row, k in enumerate(server.class_ids))
    ours = combination_weights(torch.stack(hs).double(), torch.tensor(variances, dtype=torch.float64), 1e-3)
    cvx_weights = namespace["solve_quadratic"](clients, variances, hs)
    renormalised = torch.tensor(np.array([np.array(w) / np.sum(w) for w in cvx_weights]), dtype=torch.float64)
    weights = float((ours - renormalised).abs().max())
    print(f"server ({clients} clients, means ×{scale}): prototypes {protos:.2e}, combination weights {weights:.2e} "
          f"(largest weight off 0 and 1: {float(ours[(ours > 0) & (ours < 1)].max()):.3f})")


def one_client_rounds(official: Path, rounds: int = 4) -> None:
    """``rounds`` whole rounds of one client: the official ``running.train_round_fedpac``
    (statistics, local training, prototype aggregation, base-model update; ``agg_g=0``, since one
    client's combined head is its own and the official weights call the removed ``torch.eig``)
    against ``FedPACClient.train`` and ``FedPACServer.update``, ours given a fresh SGD each round
    as the official code builds one (control: the optimiser kept across rounds, as the runtime
    keeps it). With one client the official extractor averaging is the identity, so what carries
    across rounds (the prototypes as next round's targets, the trained model) is compared."""
    sys.path.insert(0, str(official))
    from methods.fedpac import LocalUpdate_FedPAC
    from running import train_round_fedpac

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 12, generator=generator)
    y = torch.tensor([0, 1, 1, 2, 2, 3] * (SAMPLES // 6))  # every class: the official update_global_protos needs all
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    args = SimpleNamespace(num_classes=CLASSES, device="cpu", lr=LR, lam=LAM, num_users=1, frac=1.0, epochs=rounds,
                           local_epoch=EPOCHS, agg_g=0)
    reference = LocalUpdate_FedPAC(0, args, loader, loader, Referenced(small_model(0)))
    fresh, kept = our_rounds(x, y, rounds, fresh=True), our_rounds(x, y, rounds, fresh=False)
    differences = []
    for r in range(rounds):
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the official torch.tensor(tensor) copy
            train_round_fedpac(args, None, [reference], r)
        theirs = {name: p.detach() for name, p in reference.local_model.named_parameters()}
        differences.append(tuple(max(float((ours[r][name] - p).abs().max()) for name, p in theirs.items())
                                 for ours in (fresh, kept)))
    print(f"one client, rounds 1..{rounds}: parameters " + ", ".join(f"{a:.2e}" for a, _ in differences)
          + " (optimiser kept across rounds: " + ", ".join(f"{b:.2e}" for _, b in differences) + ")")


def our_rounds(x: torch.Tensor, y: torch.Tensor, rounds: int, fresh: bool) -> list[dict[str, torch.Tensor]]:
    """Ours for one client on ``small_model(0)``: the parameters after each round (``fresh``: a new
    SGD every round, as the official client; else one kept throughout)."""
    entry = get_algorithm("fedpac")
    context = AlgorithmContext(num_classes=CLASSES, feature_dim=WIDTH, seed=0, num_clients=1, model_group="mlp",
                               train=TrainConfig(batch_size=BATCH, lr=LR, local_epochs=EPOCHS, momentum=0.5,
                                                 weight_decay=5e-4, batch_order="fixed"),
                               options=parse_options(entry, {"lam": LAM, "head_lr": 0.1}))
    model, server, algorithm = small_model(0), entry.server(context), entry.client(context)
    knowledge = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, WIDTH),
                 "head_ids": torch.empty(0, dtype=torch.int64), "heads": torch.empty(0, WIDTH * CLASSES + CLASSES)}
    optimizer, snapshots = None, []
    for r in range(rounds):
        if fresh or optimizer is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5, weight_decay=5e-4)
        client = ClientState(0, "mlp", model, optimizer, x, y, x, y, torch.device("cpu"))
        server.update({0: algorithm.train(client, knowledge, r, torch.Generator().manual_seed(0)).upload}, r,
                      torch.Generator())
        knowledge = server.download()
        snapshots.append({name: p.detach().clone() for name, p in Referenced(model).named_parameters()})
    return snapshots


if __name__ == "__main__":
    torch.set_num_threads(1)
    official_clone, pfllib_clone = Path(sys.argv[1]), Path(sys.argv[2])
    client_round(official_clone)
    for seed, scale in enumerate((1.0, 0.1, 0.03)):
        server_round(official_clone, pfllib_clone, seed=seed, scale=scale)
    one_client_rounds(official_clone)
