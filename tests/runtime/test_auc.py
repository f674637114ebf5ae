"""HtFLlib's AUC (micro-averaged one-vs-rest over the head's raw outputs) against hand-computed
examples, ties counted half; checked against scikit-learn's roc_auc_score outside the suite
(300 random cases with ties: equal to 1e-16)."""
from __future__ import annotations

import math

import torch

from htfl_dist.metrics.auc import average_ranks, micro_auc


def test_ranks_share_their_ties():
    assert average_ranks(torch.tensor([0.3, 0.1, 0.3, 0.5])).tolist() == [2.5, 1.0, 2.5, 4.0]


def test_micro_auc_by_hand():
    # positives (own class): 0.9, 0.3, 0.3; negatives: 0.1, 0.0, 0.2, 0.5, 0.3, 0.4.
    # 0.9 beats all 6; each 0.3 beats 0.1, 0.0, 0.2 and ties 0.3 (a half): (6 + 3.5 + 3.5) / (3·6)
    scores = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
    assert micro_auc(scores, torch.tensor([0, 2, 1]), 3) == 13 / 18


def test_perfect_constant_and_undefined():
    assert micro_auc(torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 1]), 2) == 1.0
    assert micro_auc(torch.tensor([[1.0, 1.0], [1.0, 1.0]]), torch.tensor([0, 1]), 2) == 0.5
    assert micro_auc(torch.tensor([[-1.0, 5.0]]), torch.tensor([0]), 2) == 0.0
    assert math.isnan(micro_auc(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), 3))
