"""How the reference codes draw their server-side starts, written out from their code (not from
ours), for the ``model.init=htfllib`` tests: a side-by-side is exact from round 1 only if these
first draws are the reference's (issue 47 item 3)."""
from __future__ import annotations

import torch
from torch import nn


def trainable_prototypes(seed: int, num_classes: int, width: int) -> torch.Tensor:
    """HtFLlib's FedTGP (TsingZ0/HtFLlib ``servertgp.py``) and FedORGP's FedOrth (both versions,
    wisheverybodyhapi/FedORGP ``serverorth.py``) as they start: every client (``clientTGP``,
    ``clientOrtho``) ends its ``__init__`` with ``torch.manual_seed(0)``; the server, right after
    ``set_clients``, builds ``Trainable_Global_Prototypes`` / ``Trainable_prototypes(C, K, K)``:
    ``nn.Embedding(C, K)``, ``nn.Sequential(nn.Linear(K, K), nn.ReLU())`` and ``nn.Linear(K, K)``,
    drawn in that order. Its prototypes are ``fc(middle(embedings(c)))`` for every class c.
    ``seed`` stands for the reference's 0 (the run seed under our htfllib init)."""
    torch.manual_seed(seed)
    embedings = nn.Embedding(num_classes, width)
    middle = nn.Sequential(nn.Linear(width, width), nn.ReLU())
    fc = nn.Linear(width, width)
    with torch.no_grad():
        return fc(middle(embedings(torch.arange(num_classes))))


def fedgen_generator(seed: int, noise_dim: int, num_classes: int, hidden_dim: int,
                     feature_dim: int) -> list[torch.Tensor]:
    """HtFLlib's FedGen (TsingZ0/HtFLlib ``servergen.py``) as it starts: the last ``clientGen``
    calls ``torch.manual_seed(0)``, then counts its samples per class with one pass over
    ``load_train_data()`` (``DataLoader(train_data, batch_size, drop_last=True, shuffle=False)``);
    ``FedGen.__init__`` then builds ``Generator``: ``fc1 = Sequential(Linear(nd + C, hd),
    BatchNorm1d(hd), ReLU())``, ``fc = Linear(hd, K)``. Returns fc1's Linear weight and bias, fc's
    weight and bias. ``seed`` stands for the reference's 0."""
    torch.manual_seed(seed)
    samples = torch.utils.data.TensorDataset(torch.zeros(5, 2), torch.tensor([0, 1, 0, 1, 0]))
    per_class = torch.zeros(num_classes)
    for _, y in torch.utils.data.DataLoader(samples, 2, drop_last=True, shuffle=False):
        for yy in y:
            per_class[yy.item()] += 1
    fc1 = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU())
    fc = nn.Linear(hidden_dim, feature_dim)
    return [fc1[0].weight.detach(), fc1[0].bias.detach(), fc.weight.detach(), fc.bias.detach()]


def fedsa_anchors(seed: int, num_classes: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lokinko/FedSA@75bf106 (``serversa.py``) as it starts: every ``clientSA`` ends its
    ``__init__`` with ``torch.manual_seed(0)``; ``FedSA.__init__`` then builds
    ``projecter_linear = Sequential(Linear(K, K), SyncBN(K), ReLU, Linear(K, K), SyncBN(K), ReLU)``
    (SyncBN, outside a process group, computes as BatchNorm1d), then ``random_center =
    torch.randn(C, K)``, and ``semantic_anchors = projecter_linear(random_center)`` in train mode.
    Returns (random_center, semantic_anchors). ``seed`` stands for the reference's 0."""
    torch.manual_seed(seed)
    projecter_linear = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True),
                                     nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True))
    random_center = torch.randn(num_classes, width)
    with torch.no_grad():
        return random_center, projecter_linear(random_center).detach()
