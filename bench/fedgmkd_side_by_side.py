"""FedGMKD beside its official code on the same tensors (docs/algorithms.md, "FedGMKD").

    python bench/fedgmkd_side_by_side.py OFFICIAL_CLONE

OFFICIAL_CLONE is a checkout of github.com/SereinZY/FedGMKD (bd673b0); nothing of its code is
copied here. Its client needs scikit-learn (and scipy) importable; the modules its server file
imports but the compared code never calls (``tqdm``, ``mem_utils`` through ``calmsize``,
``sampling`` through torchvision) are stood in for by empty modules. What is compared, on random
data and a small MLP (``fedpac_side_by_side.small_model``):

1. the client's knowledge: the official ``ClientFedGMKD.generate_knowledge`` (scikit-learn's
   ``GaussianMixture`` on the standardised class features, lowest BIC) against
   ``FedGMKDClient.knowledge`` with ``prototype=standardised_mixture`` (both the mean of
   standardised data, ≈ 0), the official prototype mapped back to feature space
   (``StandardScaler.inverse_transform``) against ours with ``prototype=mixture``, and the mean
   soft predictions Q at temperature T;
2. the server's discrepancy-aware aggregation: the official ``ServerFedGMKD.train`` driven for 3
   rounds by stand-in clients that upload random knowledge, its participants drawn in client-id
   order (with a shuffled order it weighs a client's knowledge with another's count), against
   ``FedGMKDServer.update`` with ``normalise=participants`` started each round from the official
   previous global knowledge; once with every client holding every class and one prototype for
   all its classes (the official code's defects inert), once with random class sets and rows;
3. one local round: the official ``update_weights_GMKD`` (Adam, clip 1.1) against
   ``FedGMKDClient.train`` with ``train.optimizer=adam``, the same initial weights, batch order
   and global knowledge (one class without a global row).

Prints the largest absolute difference of each, and for each a control: ours with the term under
test switched off, to show the comparison resolves it.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import io
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.fedpac_side_by_side import Referenced, small_model
from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.fedgmkd import feature_discrepancy
from htfl_dist.config import TrainConfig
from htfl_dist.models import SplitModel

CLASSES, WIDTH, BATCH, EPOCHS, LR, TEMP, CLIENTS = 4, 8, 10, 2, 0.01, 0.6, 4
LABELS = [0] * 20 + [1] * 20 + [2] * 19 + [3]  # class 3: one sample, the reference's len < 2 branch


class GMKDReferenced(Referenced):
    """The official model contract: (features, logits), ``classifier`` the head, ``num_classes``."""

    def __init__(self, model: SplitModel) -> None:
        super().__init__(model)
        self.classifier, self.num_classes = self.head, CLASSES


class InOrder:
    """numpy for the official server module, ``random.choice`` returning the clients in id order."""

    random = SimpleNamespace(choice=lambda population, m, replace=False: np.arange(m))

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


def stand_in(name: str, **attributes: Any) -> ModuleType:
    """An importable module holding ``attributes``: for imports the compared code never calls."""
    module = ModuleType(name)
    module.__dict__.update(attributes)
    return module


def load_reference(official: Path) -> SimpleNamespace:
    """The official client and server classes. Its files sit flat in the clone but import each
    other as ``Client.ClientBase`` and ``Server.ServerBase``, so those names are aliased while
    they load; afterwards the clone's modules, the aliases and the stand-ins leave ``sys.modules``
    and the clone ``sys.path`` (torch looks modules up by name; another clone may load next)."""
    aliases = {"tqdm": stand_in("tqdm", tqdm=lambda items: items),
               "mem_utils": stand_in("mem_utils", MemReporter=lambda: SimpleNamespace(report=lambda: None)),
               "sampling": stand_in("sampling", LocalDataset=None, LocalDataloaders=None, partition_data=None),
               "Client": stand_in("Client"), "Server": stand_in("Server")}
    shadowed = {name: sys.modules[name] for name in aliases if name in sys.modules}
    sys.path.insert(0, str(official))
    sys.modules.update(aliases)
    try:
        for package, name in (("Client", "ClientBase"), ("Server", "ServerBase"), ("Client", "ClientFedGMKD"),
                              ("Server", "ServerFedGMKD")):
            sys.modules[f"{package}.{name}"] = importlib.import_module(name)
        client, server = sys.modules["ClientFedGMKD"], sys.modules["ServerFedGMKD"]
    finally:
        sys.path.remove(str(official))
        for name in [*aliases, *(n for n, m in list(sys.modules.items()) if from_clone(m, official))]:
            sys.modules.pop(name, None)
        sys.modules.update(shadowed)
    server.np = InOrder()  # type: ignore[attr-defined]
    return SimpleNamespace(client=client.ClientFedGMKD, server=server.ServerFedGMKD)


def from_clone(module: ModuleType | None, official: Path) -> bool:
    """Whether ``module`` was loaded from a file of the clone."""
    file = getattr(module, "__file__", None)
    return file is not None and Path(file).resolve().is_relative_to(official.resolve())


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The official code prints every tenth batch and every round, and torch warns of its implicit
    softmax dimensions and ``KLDivLoss`` mean; none of it is compared."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def client_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ×5, so the gradient norm (≈ 1.4 at the start) exceeds the clip 1.1 and clipping acts."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(len(LABELS), 12, generator=generator) * 5
    return x, torch.tensor(LABELS)[torch.randperm(len(LABELS), generator=generator)]


def reference_client(reference: SimpleNamespace, x: torch.Tensor, y: torch.Tensor) -> Any:
    """The official client on ``small_model(0)``, its loader in stored order."""
    args = SimpleNamespace(lr=LR, lr_sh_rate=10, local_ep=EPOCHS, clip_grad=None, std=0.0, code_len=WIDTH,
                           num_classes=CLASSES)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    logger = SimpleNamespace(add_scalar=lambda *a: None)
    return reference.client(args, GMKDReferenced(small_model(0)), loader, loader, 0, logger, WIDTH, CLASSES, "cpu")


def our_client(x: torch.Tensor, y: torch.Tensor, **options: Any) -> tuple[Any, ClientState]:
    """``FedGMKDClient`` and its state on ``small_model(0)`` with Adam at the official lr."""
    entry = get_algorithm("fedgmkd")
    train = TrainConfig(batch_size=BATCH, lr=LR, local_epochs=EPOCHS, optimizer="adam", batch_order="fixed")
    context = AlgorithmContext(num_classes=CLASSES, feature_dim=WIDTH, seed=0, train=train,
                               options=parse_options(entry, {"temperature": TEMP, **options}), num_clients=1)
    model = small_model(0)
    client = ClientState(0, "mlp", model, torch.optim.Adam(model.parameters(), lr=LR), x, y, x, y,
                         torch.device("cpu"))
    return entry.client(context), client


def rows(table: dict, class_ids: torch.Tensor) -> torch.Tensor:
    """The official ``{class: [row]}`` dict as a [m, ·] tensor in ``class_ids`` order."""
    return torch.stack([table[int(k)][0].detach().double() for k in class_ids])


def unstandardise(row: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """A row of the official code's standardised space mapped back to feature space, as sklearn's
    ``StandardScaler().fit(features).inverse_transform`` does (the official fit standardises
    so): row·σ + μ, σ the population standard deviation per dimension, 1 where it is 0. Written
    out so the script (and its test) need no scikit-learn."""
    scale = features.std(dim=0, unbiased=False)
    return row * torch.where(scale == 0, torch.ones_like(scale), scale) + features.mean(dim=0)


def knowledge_differences(reference: SimpleNamespace) -> dict[str, float]:
    """(1): the uploaded prototypes and soft predictions of the same untrained model."""
    x, y = client_data()
    with quiet():
        their_protos, their_soft = reference_client(reference, x, y).generate_knowledge(TEMP)
    algorithm, client = our_client(x, y, prototype="standardised_mixture")
    standardised = algorithm.knowledge(client, 0)
    algorithm, client = our_client(x, y, prototype="mixture")
    mixture = algorithm.knowledge(client, 0)
    ids = mixture["class_ids"]
    with torch.no_grad():
        features = client.model.forward_with_features(x)[0].double()
    mapped = torch.stack([unstandardise(their_protos[int(k)][0].detach().double(), features[y == k]) for k in ids])
    return {"standardised prototypes": float((rows(their_protos, ids) - standardised["protos"].double()).abs().max()),
            "largest official prototype entry": float(rows(their_protos, ids).abs().max()),
            "mapped-back prototypes": float((mapped - mixture["protos"].double()).abs().max()),
            "soft predictions": float((rows(their_soft, ids) - mixture["soft"].double()).abs().max())}


# --------------------------------------------------------------------------- the server


def random_uploads(generator: torch.Generator, symmetric: bool, scale: float) -> dict[int, dict]:
    """One round's uploads per client: a few samples a class (so a·d is not lost beside n), every
    class held by client 0; ``symmetric``: every client holds every class with one prototype."""
    uploads = {}
    for j in range(CLIENTS):
        held = list(range(CLASSES)) if symmetric or j == 0 else sorted(
            torch.randperm(CLASSES, generator=generator)[: 1 + j % CLASSES].tolist())
        protos = torch.randn(1 if symmetric else len(held), WIDTH, generator=generator).expand(len(held), WIDTH)
        uploads[j] = {"class_ids": torch.tensor(held), "counts": torch.randint(1, 4, (len(held),), generator=generator),
                      "protos": protos.clone() * scale,
                      "soft": torch.softmax(torch.randn(len(held), CLASSES, generator=generator) * 2, dim=1)}
    return uploads


class StandInClient:
    """Plays one client for the official server: its counts, its upload of each round, and a
    record of the global knowledge each ``update_weights_GMKD`` receives."""

    def __init__(self, uploads: list[dict], state: dict) -> None:
        self.uploads, self.state, self.round = uploads, state, 0
        self.received: list[tuple[dict, dict]] = []

    def get_nk_dk(self) -> tuple[int, dict[int, int]]:
        upload = self.uploads[self.round]
        held = zip(upload["class_ids"].tolist(), upload["counts"].tolist(), strict=True)
        counts = dict.fromkeys(range(CLASSES), 0) | dict(held)
        return sum(counts.values()), counts

    def generate_knowledge(self, temp: float) -> tuple[dict, dict]:
        upload = self.uploads[self.round]
        ids = upload["class_ids"].tolist()
        return ({k: [upload["protos"][row]] for row, k in enumerate(ids)},
                {k: [upload["soft"][row]] for row, k in enumerate(ids)})

    def update_weights(self, global_round: int) -> tuple[dict, float]:
        self.round += 1
        return copy.deepcopy(self.state), 0.0

    def update_weights_GMKD(self, global_features: dict, global_soft_prediction: dict, **_: Any) -> tuple[dict, float]:
        self.received.append((global_features, global_soft_prediction))
        return self.update_weights(0)

    def test_accuracy(self) -> float:
        return 0.0

    def load_model(self, weights: dict) -> None:
        pass


class Pair(nn.Module):
    """The official global model's contract, for its per-round test pass: (features, logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.linear(x)


def reference_globals(reference: SimpleNamespace, rounds: list[dict[int, dict]]) -> list[dict[str, torch.Tensor]]:
    """The global knowledge the official server sends in rounds 2.. (round 1 trains CE alone and
    sends nothing), as payloads; ``rounds[r][j]`` is client j's upload of round r."""
    args = SimpleNamespace(num_epochs=len(rounds), sampling_rate=1, num_clients=CLIENTS, num_classes=CLASSES,
                           temp=TEMP, upload_model=True, lam=0.06, gamma=0.06)
    test = [(torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64))]
    model = Pair()
    server = reference.server(args, model, None, None, test, None, "cpu")
    server.LocalModels = [StandInClient([r[j] for r in rounds], model.state_dict()) for j in range(CLIENTS)]
    with quiet():
        server.train()
    received = [client.received for client in server.LocalModels]
    assert all(len(r) == len(rounds) - 1 for r in received), "every stand-in trains with global knowledge"
    out = []
    for protos, soft in received[0]:
        ids = torch.tensor(sorted(protos))
        out.append({"class_ids": ids, "protos": rows(protos, ids).float(), "soft": rows(soft, ids).float()})
    return out


def our_global(previous: dict[str, torch.Tensor], uploads: dict[int, dict], a: float) -> dict[str, torch.Tensor]:
    """``FedGMKDServer.update`` (``normalise=participants``, discrepancy weight ``a``) from ``previous``."""
    entry = get_algorithm("fedgmkd")
    server = entry.server(AlgorithmContext(
        num_classes=CLASSES, feature_dim=WIDTH, seed=0, train=TrainConfig(), num_clients=CLIENTS, model_group="mlp",
        options=parse_options(entry, {"normalise": "participants", "discrepancy_weight": a})))
    server.load_state_dict(previous)
    server.update(uploads, 0, torch.Generator())
    return server.download()


def largest(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """Largest |ours − theirs| over the prototypes and soft predictions of the same classes."""
    assert torch.equal(ours["class_ids"], theirs["class_ids"]), "the same classes"
    return max(float((ours[key].double() - theirs[key].double()).abs().max()) for key in ("protos", "soft"))


def replayed_global(previous: dict[str, torch.Tensor], uploads: dict[int, dict], second_round: bool,
                    a: float = 0.4, b: float = 0.2) -> dict[str, torch.Tensor]:
    """The official round written out with its documented defects (docs/algorithms.md, FedGMKD,
    "Not reproduced"), to show they account for the differences: every class's numerators are
    class 0's scores (its list is not reset per class), and in round 2 each discrepancy is taken
    against softmax of a 0-d tensor, 1 in all K entries: −mean log softmax(P)."""
    totals = torch.tensor([float(u["counts"].sum()) for u in uploads.values()], dtype=torch.float64)
    distances = torch.zeros(CLIENTS, CLASSES, dtype=torch.float64)
    holds = torch.zeros(CLIENTS, CLASSES, dtype=torch.bool)
    table = dict(zip(previous["class_ids"].tolist(), previous["protos"], strict=True))
    for j, upload in uploads.items():
        ids, protos = upload["class_ids"], upload["protos"].double()
        holds[j, ids] = True
        distances[j, ids] = (-torch.log_softmax(protos, dim=1).mean(dim=1) if second_round else
                             feature_discrepancy(torch.stack([table[int(k)] for k in ids]), protos))
    scores = torch.relu(totals.unsqueeze(1) - a * distances + b)
    weights = scores[:, :1] / scores.sum(dim=0)
    protos, soft = torch.zeros(CLASSES, WIDTH, dtype=torch.float64), torch.zeros(CLASSES, CLASSES, dtype=torch.float64)
    for j, upload in uploads.items():
        ids = upload["class_ids"]
        protos[ids] += weights[j, ids].unsqueeze(1) * upload["protos"].double()
        soft[ids] += weights[j, ids].unsqueeze(1) * upload["soft"].double()
    return {"class_ids": torch.arange(CLASSES), "protos": protos, "soft": soft}


def server_differences(reference: SimpleNamespace, symmetric: bool, seed: int = 0,
                       scale: float = 5.0) -> list[tuple[float, float, float]]:
    """(2): per round r ≥ 2, |ours − official|, |ours at a = 0 − official| and |official with its
    defects replayed − official|, ours started from the official global knowledge of round r − 1
    (round 2: ours of round 1, which the official code keeps to itself)."""
    generator = torch.Generator().manual_seed(seed)
    rounds = [random_uploads(generator, symmetric, scale) for _ in range(3)]
    theirs = reference_globals(reference, rounds)
    empty = our_global({"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, WIDTH),
                        "soft": torch.empty(0, CLASSES)}, rounds[0], 0.4)
    starts = [empty, *theirs[:-1]]
    return [(largest(our_global(start, uploads, 0.4), their), largest(our_global(start, uploads, 0.0), their),
             largest(replayed_global(start, uploads, second_round=r == 0), their))
            for r, (start, uploads, their) in enumerate(zip(starts, rounds[1:], theirs, strict=True))]


# --------------------------------------------------------------------------- one local round


def global_knowledge(generator: torch.Generator) -> tuple[dict, dict]:
    """Official-layout global knowledge for classes 0, 1, 3 (class 2 has none)."""
    protos = {k: [torch.randn(WIDTH, generator=generator)] for k in (0, 1, 3)}
    soft = {k: [torch.softmax(torch.randn(CLASSES, generator=generator), dim=0)] for k in (0, 1, 3)}
    return protos, soft


def training_differences(reference: SimpleNamespace) -> dict[str, float]:
    """(3): the parameters after one round of each, from the same weights and batches."""
    x, y = client_data()
    protos, soft = global_knowledge(torch.Generator().manual_seed(2))
    official = reference_client(reference, x, y)
    with quiet():
        official.update_weights_GMKD(protos, soft, lam=0.06, gamma=0.06, temp=TEMP, global_round=1)
    theirs = dict(official.model.named_parameters())
    ids = torch.tensor(sorted(protos))
    knowledge = {"class_ids": ids, "protos": rows(protos, ids).float(), "soft": rows(soft, ids).float()}

    def trained(**options: Any) -> dict[str, torch.Tensor]:
        algorithm, client = our_client(x, y, **options)
        algorithm.train(client, knowledge, 1, torch.Generator().manual_seed(0))
        return {name: p.detach() for name, p in GMKDReferenced(client.model).named_parameters()}

    def off(ours: dict[str, torch.Tensor]) -> float:
        return max(float((ours[name] - p.detach()).abs().max()) for name, p in theirs.items())

    start = {name: p.detach() for name, p in GMKDReferenced(small_model(0)).named_parameters()}
    ours = trained()
    return {"parameters": off(ours), "moved": max(float((ours[n] - start[n]).abs().max()) for n in ours),
            "ours at lam = 0": off(trained(lam=0.0)), "ours at gamma = 0": off(trained(gamma=0.0)),
            "ours unclipped": off(trained(clip_grad_norm=None))}


def one_client_rounds(reference: SimpleNamespace, rounds: int = 4) -> list[tuple[float, float, float, float]]:
    """(4): ``rounds`` whole rounds of the official ``ServerFedGMKD.train`` with one official client
    against ours with ``prototype=standardised_mixture normalise=participants`` and a fresh Adam each
    round, as the official client builds one. Per round: |ours − official|; the same with the
    optimiser kept across rounds, as the runtime keeps it; ours for that round alone, from the
    official parameters of the round before and given the official global knowledge; and the same
    with the official prototypes (≈ 5e-8, float32 rounding of 0) set to exact 0, as ours. With one
    client the official model averaging is the identity, and its defects cannot act: its
    prototypes are 0, so every discrepancy, its class-0 numerators and round-2 scalar included, is
    the same for every class and each weight is 1."""
    x, y = client_data()
    official = reference_client(reference, x, y)
    snapshots: list[dict[str, torch.Tensor]] = []
    received: list[dict[str, torch.Tensor]] = []
    for name in ("update_weights", "update_weights_GMKD"):
        setattr(official, name, recorded(getattr(official, name), official.model, snapshots, received))
    args = SimpleNamespace(num_epochs=rounds, sampling_rate=1, num_clients=1, num_classes=CLASSES, temp=TEMP,
                           upload_model=True, lam=0.06, gamma=0.06)
    server = reference.server(args, GMKDReferenced(small_model(0)), None, None, [(x, y)], None, "cpu")
    server.LocalModels = [official]
    with quiet():
        server.train()
    fresh, kept = our_rounds(x, y, rounds, fresh=True), our_rounds(x, y, rounds, fresh=False)
    alone = [fresh[0]] + [our_round_from(x, y, snapshots[r - 1], received[r - 1], r) for r in range(1, rounds)]
    zeroed = [fresh[0]] + [our_round_from(x, y, snapshots[r - 1], {**received[r - 1], "protos": 0 * received[r - 1][
        "protos"]}, r) for r in range(1, rounds)]
    return [tuple(max(float((ours[r][name] - p).abs().max()) for name, p in snapshots[r].items())  # type: ignore[misc]
                  for ours in (fresh, kept, alone, zeroed)) for r in range(rounds)]


def recorded(update: Any, model: nn.Module, snapshots: list, received: list) -> Any:
    """``update``, also recording the model's parameters after each call and the global knowledge
    it was given, if any, as our payload."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = update(*args, **kwargs)
        snapshots.append({name: p.detach().clone() for name, p in model.named_parameters()})
        if "global_features" in kwargs:
            protos, soft = kwargs["global_features"], kwargs["global_soft_prediction"]
            ids = torch.tensor(sorted(protos))
            received.append({"class_ids": ids, "protos": rows(protos, ids).float(), "soft": rows(soft, ids).float()})
        return result
    return wrapper


def our_round_from(x: torch.Tensor, y: torch.Tensor, start: dict[str, torch.Tensor], knowledge: dict,
                   round_index: int) -> dict[str, torch.Tensor]:
    """Ours for one round from the parameters ``start``, given ``knowledge``, with a fresh Adam."""
    algorithm, client = our_client(x, y, prototype="standardised_mixture", normalise="participants")
    model = GMKDReferenced(client.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(start[name])
    algorithm.train(client, knowledge, round_index, torch.Generator().manual_seed(0))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def our_rounds(x: torch.Tensor, y: torch.Tensor, rounds: int, fresh: bool) -> list[dict[str, torch.Tensor]]:
    """Ours for one client: the parameters after each round (``fresh``: a new Adam every round)."""
    options = {"prototype": "standardised_mixture", "normalise": "participants"}
    algorithm, client = our_client(x, y, **options)
    entry = get_algorithm("fedgmkd")
    server = entry.server(AlgorithmContext(
        num_classes=CLASSES, feature_dim=WIDTH, seed=0, train=TrainConfig(), num_clients=1, model_group="mlp",
        options=parse_options(entry, {"temperature": TEMP, **options})))
    knowledge = server.download()
    snapshots = []
    for r in range(rounds):
        if fresh:
            client.optimizer = torch.optim.Adam(client.model.parameters(), lr=LR)
        server.update({0: algorithm.train(client, knowledge, r, torch.Generator().manual_seed(0)).upload}, r,
                      torch.Generator())
        knowledge = server.download()
        snapshots.append({name: p.detach().clone() for name, p in GMKDReferenced(client.model).named_parameters()})
    return snapshots


def main(official: Path) -> None:
    torch.set_num_threads(1)
    reference = load_reference(official)
    knowledge = knowledge_differences(reference)
    print("client knowledge: " + ", ".join(f"{name} {value:.2e}" for name, value in knowledge.items()))
    for symmetric in (True, False):
        label = "every class held, one prototype a client" if symmetric else "random classes and rows"
        for r, (ours, control, replayed) in enumerate(server_differences(reference, symmetric), start=2):
            print(f"server, {label}, round {r}: {ours:.2e} (ours at a = 0: {control:.2e}; "
                  f"the official defects replayed: {replayed:.2e})")
    training = training_differences(reference)
    print("client round: " + ", ".join(f"{name} {value:.2e}" for name, value in training.items()))
    columns = list(zip(*one_client_rounds(reference), strict=True))
    print(f"one client, rounds 1..{len(columns[0])}: parameters " + listed(columns[0])
          + " (optimiser kept across rounds: " + listed(columns[1])
          + "; each round alone from the official state and knowledge: " + listed(columns[2])
          + ", the same with the official prototypes set to exact 0: " + listed(columns[3]) + ")")


def listed(values: tuple[float, ...]) -> str:
    return ", ".join(f"{value:.2e}" for value in values)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
