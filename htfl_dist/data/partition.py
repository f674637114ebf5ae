"""Partitioners: which sample indices each logical client holds (the legacy rules and the
checks both rule sets share).

All functions are pure given their ``rng``, so a split is deterministic by seed. There are two
rule sets, chosen by ``data.partition_rules``:

- legacy (this module): ``numpy.random.Generator`` streams derived with ``seeding.numpy_rng``;
  every returned index array is sorted ascending, int64.
- PFLlib's (:mod:`htfl_dist.data.partition_pfllib`): PFLlib's own draws, reproduced number for
  number from one ``numpy.random.RandomState``.

This module also holds what does not depend on the rule set: the label and request checks
(:func:`checked_labels`, :func:`checked_dirichlet_request`, one message per mistake whichever
rules draw), the Dirichlet give-up error, and the class-stratified subsample that both rule sets
draw their split from.
"""
from __future__ import annotations

import math

import numpy as np

from htfl_dist.config.rules import check_value
from htfl_dist.errors import ConfigError, DataError

LEGACY_MIN_SAMPLES = 10
"""The legacy Dirichlet guard, used when ``data.min_samples_per_client`` is unset."""


# --------------------------------------------------------------------------- checks both rule sets share


def checked_labels(labels: np.ndarray, num_clients: int, num_classes: int) -> np.ndarray:
    """``labels`` as int64 after the checks every partitioner makes before drawing: 1-D, labels
    within 0..num_classes - 1, and at least one sample per client."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be a 1-D array, got shape {labels.shape}")
    check_value("num_clients", num_clients, at_least=1)
    if num_clients > labels.size:  # checked before any per-client list is allocated
        raise ConfigError(f"config key 'num_clients' is {num_clients}, but the data has {labels.size} samples to "
                          f"split and every client needs at least one; lower num_clients or raise data.subsample")
    if num_classes < 1:
        raise DataError(f"num_classes must be >= 1, got {num_classes}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(
            f"labels span [{int(labels.min())}, {int(labels.max())}] but num_classes={num_classes}"
        )
    return labels.astype(np.int64, copy=False)


def checked_dirichlet_request(labels: np.ndarray, num_clients: int, num_classes: int, beta: float,
                              min_samples: int, max_tries: int) -> np.ndarray:
    """The checks both Dirichlet rules make before drawing: one line naming the key to change
    for a request that cannot be met at all (num_clients * min_samples > N fails at once)."""
    labels = checked_labels(labels, num_clients, num_classes)
    check_value("data.beta", beta, above=0, note="Dirichlet concentration")
    check_value("data.max_partition_tries", max_tries, at_least=1)
    if num_clients * min_samples > labels.size:
        raise DataError(
            f"Dirichlet partition (beta={beta}) cannot give {num_clients} clients at least "
            f"{min_samples} samples each from {labels.size} samples; lower num_clients or "
            f"data.min_samples_per_client, or raise data.subsample"
        )
    return labels


def dirichlet_retry_error(beta: float, min_samples: int, tries: int) -> DataError:
    """What both Dirichlet rules raise when ``tries`` re-draws all left a client too small."""
    return DataError(
        f"Dirichlet partition (beta={beta}) left a client with fewer than {min_samples} samples "
        f"after {tries} tries; raise data.beta, lower num_clients or data.min_samples_per_client"
    )


# --------------------------------------------------------------------------- the legacy rules


def pathological_classes(num_clients: int, classes_per_client: int, num_classes: int) -> list[list[int]]:
    """Client i holds classes (i*k + j) mod C, j < k: every class used as evenly as possible."""
    k = classes_per_client
    return [[(i * k + j) % num_classes for j in range(k)] for i in range(num_clients)]


def partition_pathological(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    num_classes: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Pathological non-IID split: each client holds exactly ``classes_per_client`` classes.

    Non-redundant: all samples of a class are shared out among the clients that hold it, each
    sample to exactly one of them. Unbalanced: a class of ``n`` samples held by ``m`` clients
    gives each holder ``max(1, n // (10 m))`` samples (the floor; PFLlib's ``num_per / 10``)
    plus a multinomial share of the rest under Dirichlet(1) weights.
    """
    labels = checked_labels(labels, num_clients, num_classes)
    check_value("data.classes_per_client", classes_per_client, at_least=1)
    if classes_per_client > num_classes:
        raise ConfigError(
            f"config key 'data.classes_per_client' is {classes_per_client} but the dataset has "
            f"only {num_classes} classes; use a value in 1..{num_classes}"
        )
    assignment = pathological_classes(num_clients, classes_per_client, num_classes)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for client, classes in enumerate(assignment):
        for c in classes:
            holders[c].append(client)

    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        clients = holders[c]
        if not clients:
            continue
        idx = np.flatnonzero(labels == c)
        n, m = idx.size, len(clients)
        if n < m:
            raise DataError(
                f"pathological partition: class {c} has {n} samples but {m} clients hold it; "
                f"lower num_clients or data.classes_per_client, or raise data.subsample"
            )
        rng.shuffle(idx)
        floor = max(1, n // (10 * m))
        weights = rng.dirichlet(np.ones(m))
        shares = floor + rng.multinomial(n - floor * m, weights)
        bounds = np.cumsum(shares)[:-1]
        for client, piece in zip(clients, np.split(idx, bounds), strict=True):
            parts[client].append(piece)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    beta: float,
    num_classes: int,
    rng: np.random.Generator,
    min_samples: int = LEGACY_MIN_SAMPLES,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Practical non-IID split (PFLlib's ``dir``): per class, shares ~ Dir(beta) over clients.

    PFLlib's balancing trick applies: a client already holding >= N / num_clients samples gets
    no share of the next class. The whole draw is repeated until every client holds at least
    ``min_samples``; after ``max_tries`` draws a DataError says what to change. A request that
    cannot be met at all (num_clients * min_samples > N) fails at once.
    """
    labels = checked_dirichlet_request(labels, num_clients, num_classes, beta, min_samples, max_tries)
    n_total = labels.size
    per_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    cap = n_total / num_clients
    alpha = np.full(num_clients, float(beta))
    for _ in range(max_tries):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx_c in per_class:
            if idx_c.size == 0:
                continue
            idx_c = idx_c.copy()
            rng.shuffle(idx_c)
            proportions = rng.dirichlet(alpha)
            masked = proportions * (sizes < cap)
            total = masked.sum()
            # Tiny beta can put all mass on already-full clients; fall back to the raw draw.
            if not np.isfinite(total) or total <= 0:
                masked, total = proportions, proportions.sum()
            cuts = (np.cumsum(masked / total) * idx_c.size).astype(np.int64)[:-1]
            for client, piece in enumerate(np.split(idx_c, cuts)):
                if piece.size:
                    pieces[client].append(piece)
                    sizes[client] += piece.size
        if sizes.min() >= min_samples:
            return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in pieces]
    raise dirichlet_retry_error(beta, min_samples, max_tries)


# --------------------------------------------------------------------------- legacy train/test split, shared subsample


def train_count(n: int, train_ratio: float) -> int:
    """Train size for ``n`` samples: floor(train_ratio * n), clamped to [1, n - 1] when n >= 2.

    So every client with >= 2 samples has a non-empty train and test split (sklearn's
    ``train_test_split(train_size=r)`` as PFLlib uses it also floors the train size); a client
    with 1 sample keeps it for training.
    """
    if n <= 0:
        return 0
    if n == 1:
        return 1
    k = math.floor(train_ratio * n + 1e-9)
    return min(max(k, 1), n - 1)


def split_train_test(
    indices: np.ndarray, train_ratio: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle one client's indices, then cut ``train_count(n, train_ratio)`` for training."""
    check_value("data.train_ratio", train_ratio, above=0, below=1)
    shuffled = np.asarray(indices, dtype=np.int64).copy()
    rng.shuffle(shuffled)
    k = train_count(shuffled.size, train_ratio)
    return shuffled[:k], shuffled[k:]


def subsample_indices(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A class-stratified random subset: round(fraction * n_c) of each class (>= 1 if n_c > 0).

    Returns sorted indices; ``fraction == 1`` returns every index without drawing.
    """
    labels = np.asarray(labels)
    check_value("data.subsample", fraction, above=0, at_most=1)
    if fraction == 1.0:
        return np.arange(labels.size, dtype=np.int64)
    chosen = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        take = max(1, round(fraction * idx.size))
        chosen.append(rng.choice(idx, size=take, replace=False))
    if not chosen:
        return np.zeros(0, np.int64)
    return np.sort(np.concatenate(chosen)).astype(np.int64)
