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
