"""The area under the ROC curve that HtFLlib reports (``rs_test_auc``): one client's test split,
its classes one-vs-rest, micro-averaged, scored by the head's raw outputs.

HtFLlib's ``test_metrics`` binarises the labels over the C classes (``label_binarize``), stacks
the head's outputs, and calls scikit-learn's ``roc_auc_score(average='micro')``: one binary AUC
over all n·C (sample, class) pairs, the positives being each sample's own class. That is the
Mann-Whitney statistic with tied scores counted half, computed here from average ranks, so no
scikit-learn is needed. The run's figure weights each client's AUC by its test samples."""
from __future__ import annotations

import math

import torch


def micro_auc(scores: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """Micro-averaged one-vs-rest AUC of ``scores`` [n, C] for ``labels`` [n]; NaN when there is
    no positive or no negative pair (scikit-learn refuses such a split)."""
    n = labels.shape[0]
    flat = scores.detach().double().reshape(-1)
    positive = torch.zeros(n, num_classes, dtype=torch.bool)
    positive[torch.arange(n), labels.long()] = True
    positive = positive.reshape(-1)
    pos, neg = int(positive.sum()), int((~positive).sum())
    if pos == 0 or neg == 0:
        return math.nan
    return (float(average_ranks(flat)[positive].sum()) - pos * (pos + 1) / 2) / (pos * neg)


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks of ``values``, ties sharing the mean of the ranks they span."""
    _, inverse, counts = torch.unique(values, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # the last rank of each distinct value
    return (ends - (counts.double() - 1) / 2)[inverse]
