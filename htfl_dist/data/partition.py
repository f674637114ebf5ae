"""Partitioners: which sample indices each logical client holds.

All functions are pure given their ``rng``, so a split is deterministic by seed. Two rule sets:

- legacy (``data.partition_rules=legacy``): ``numpy.random.Generator`` streams derived with
  ``seeding.numpy_rng``; every returned index array is sorted ascending, int64.
- PFLlib's (``data.partition_rules=pfllib``, the ``*_pfllib`` functions): the rules of PFLlib's
  ``dataset/utils/dataset_utils.py`` (``separate_data`` unbalanced ``pat`` / ``dir``, then
  ``split_data``) drawn from one legacy ``numpy.random.RandomState`` in PFLlib's call order, so
  seed 1 on the same labels gives PFLlib's split sample for sample. Their index arrays keep
  PFLlib's order (class by class), because PFLlib's train/test split permutes positions.
"""
from __future__ import annotations

import math

import numpy as np

from htfl_dist.errors import ConfigError, DataError

LEGACY_MIN_SAMPLES = 10
"""The legacy Dirichlet guard, used when ``data.min_samples_per_client`` is unset."""


def _check_common(labels: np.ndarray, num_clients: int, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be a 1-D array, got shape {labels.shape}")
    if num_clients < 1:
        raise ConfigError(f"config key 'num_clients' must be >= 1, got {num_clients}")
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
    labels = _check_common(labels, num_clients, num_classes)
    if classes_per_client < 1:
        raise ConfigError(
            f"config key 'data.classes_per_client' must be >= 1, got {classes_per_client}"
        )
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


def _check_dirichlet_request(labels: np.ndarray, num_clients: int, num_classes: int, beta: float,
                             min_samples: int, max_tries: int) -> np.ndarray:
    """The checks both Dirichlet rules make before drawing: one line naming the key to change
    for a request that cannot be met at all (num_clients * min_samples > N fails at once)."""
    labels = _check_common(labels, num_clients, num_classes)
    if not beta > 0:
        raise ConfigError(f"config key 'data.beta' must be > 0 (Dirichlet concentration), got {beta}")
    if max_tries < 1:
        raise ConfigError(f"config key 'data.max_partition_tries' must be >= 1, got {max_tries}")
    if num_clients * min_samples > labels.size:
        raise DataError(
            f"Dirichlet partition (beta={beta}) cannot give {num_clients} clients at least "
            f"{min_samples} samples each from {labels.size} samples; lower num_clients or "
            f"data.min_samples_per_client, or raise data.subsample"
        )
    return labels


def _dirichlet_error(beta: float, min_samples: int, tries: int) -> DataError:
    return DataError(
        f"Dirichlet partition (beta={beta}) left a client with fewer than {min_samples} samples "
        f"after {tries} tries; raise data.beta, lower num_clients or data.min_samples_per_client"
    )


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
    labels = _check_dirichlet_request(labels, num_clients, num_classes, beta, min_samples, max_tries)
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
    raise _dirichlet_error(beta, min_samples, max_tries)


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
    if not 0.0 < train_ratio < 1.0:
        raise ConfigError(f"config key 'data.train_ratio' must be in (0, 1), got {train_ratio}")
    shuffled = np.asarray(indices, dtype=np.int64).copy()
    rng.shuffle(shuffled)
    k = train_count(shuffled.size, train_ratio)
    return shuffled[:k], shuffled[k:]


def subsample_indices(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A class-stratified random subset: round(fraction * n_c) of each class (>= 1 if n_c > 0).

    Returns sorted indices; ``fraction == 1`` returns every index without drawing.
    """
    labels = np.asarray(labels)
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"config key 'data.subsample' must be in (0, 1], got {fraction}")
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


# --------------------------------------------------------------------------- PFLlib's rules

PFLLIB_BATCH_SIZE = 10
"""PFLlib's generator constant ``batch_size`` (also our ``train.batch_size`` default)."""

PFLLIB_PARTITIONS = ("dirichlet", "pathological")


def pfllib_least_samples(n_samples: int, num_clients: int, batch_size: int, train_ratio: float) -> int:
    """PFLlib's guard ``least_samples = int(min(batch_size / (1 - r), N / num_clients / 2))``.

    PFLlib wants every client to keep at least one test batch (40 samples for batch 10 and a
    75 % train share), capped at half the mean client size so that small datasets stay
    feasible. The float expression is evaluated as PFLlib writes it, so the truncation agrees.
    """
    return int(min(batch_size / (1 - train_ratio), n_samples / num_clients / 2))


def pfllib_pathological_holders(
    num_clients: int, classes_per_client: int, num_classes: int
) -> list[list[int]]:
    """Per class, the clients that hold it under PFLlib's rule.

    Each client has ``classes_per_client`` (k) class slots. Classes are handed out in order:
    class c goes to the first ``ceil(num_clients / C * k)`` clients that still have a free
    slot, so clients form blocks that share the same classes (20 clients, 10 classes, k = 2:
    clients 0-3 hold classes 0 and 1, clients 4-7 classes 2 and 3, ...). The block size is the
    float expression PFLlib evaluates, e.g. (7 / 25) * 25 = 7.000000000000001 gives 8 clients,
    not 7. Once every slot is taken, the remaining classes are held by nobody and their samples
    are left out, as in PFLlib.
    """
    slots = [classes_per_client] * num_clients
    block = math.ceil((num_clients / num_classes) * classes_per_client)
    holders: list[list[int]] = []
    for _ in range(num_classes):
        chosen = [client for client in range(num_clients) if slots[client] > 0][:block]
        for client in chosen:
            slots[client] -= 1
        holders.append(chosen)
    return holders


def pfllib_shares(
    n: int, holders: int, least_samples: int, num_classes: int, rng: np.random.RandomState, cls: int = 0
) -> list[int]:
    """How many of a class's ``n`` samples each of its ``holders`` (m) clients gets, in order.

    PFLlib's unbalanced ``pat`` rule: every holder but the last draws uniformly from
    [low, high) with high = int(n / m) and low = int(max(n / m / 10, least_samples / C)) (numpy
    truncates the float bounds PFLlib passes to ``randint``); the last holder takes the rest,
    so it always gets more than n / m. This, not a Dirichlet, makes PFLlib's pathological
    clients so unequal in size. A single holder takes all without a draw (numpy draws nothing
    for size 0 and does not check the bounds then).
    """
    if holders == 1:
        return [n]
    per = n / holders
    low, high = int(max(per / 10, least_samples / num_classes)), int(per)
    if low >= high:
        raise DataError(
            f"pathological partition (data.partition_rules=pfllib): class {cls} has {n} samples "
            f"for {holders} clients, too few for PFLlib's share rule (each draws from [{low}, "
            f"{high})); lower num_clients or data.min_samples_per_client, or raise data.subsample"
        )
    draws = rng.randint(low, high, holders - 1)
    return [*draws.tolist(), n - int(draws.sum())]


def _check_classes_per_client(classes_per_client: int, num_classes: int) -> None:
    if not 1 <= classes_per_client <= num_classes:
        raise ConfigError(
            f"config key 'data.classes_per_client' is {classes_per_client} but the dataset has "
            f"{num_classes} classes; use a value in 1..{num_classes}"
        )


def partition_pathological_pfllib(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    num_classes: int,
    least_samples: int,
    rng: np.random.RandomState,
) -> list[np.ndarray]:
    """PFLlib's unbalanced pathological split (``separate_data``, ``pat``, ``balance=False``).

    Holders by ``pfllib_pathological_holders``, shares by ``pfllib_shares``. Unlike the legacy
    rule nothing is shuffled: each holder takes the next run of the class's indices in
    ascending order. A client's array lists its classes in class order.
    """
    labels = _check_common(labels, num_clients, num_classes)
    _check_classes_per_client(classes_per_client, num_classes)
    holders = pfllib_pathological_holders(num_clients, classes_per_client, num_classes)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, clients in enumerate(holders):
        if not clients:
            continue
        idx = np.flatnonzero(labels == c)
        shares = pfllib_shares(idx.size, len(clients), least_samples, num_classes, rng, c)
        for client, piece in zip(clients, np.split(idx, np.cumsum(shares)[:-1]), strict=True):
            parts[client].append(piece)
    return [np.concatenate(p).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]


def _pfllib_cuts(proportions: np.ndarray, open_clients: np.ndarray, n: int) -> np.ndarray:
    """PFLlib's cut points: shares of full clients zeroed, renormalised, cumulated, truncated."""
    masked = proportions * open_clients
    total = masked.sum()
    if not (np.isfinite(total) and total > 0):
        # PFLlib divides by zero here (NaN cut points, whose int cast is undefined); like the
        # legacy rule, fall back to the raw draw.
        masked, total = proportions, proportions.sum()
    if not (np.isfinite(total) and total > 0):
        raise DataError("the Dirichlet draw underflowed (no finite share); raise data.beta")
    return (np.cumsum(masked / total) * n).astype(np.int64)[:-1]


def partition_dirichlet_pfllib(
    labels: np.ndarray,
    num_clients: int,
    beta: float,
    num_classes: int,
    least_samples: int,
    rng: np.random.RandomState,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """PFLlib's ``dir`` split, drawn in its order from a ``RandomState``.

    The algorithm of ``partition_dirichlet``, with three differences that keep the stream and
    the result equal to PFLlib's: the guard is ``least_samples`` (re-draw until every client
    holds that many), every class is drawn even when empty, and a client's indices stay in
    PFLlib's order (class by class, each piece in shuffled order). PFLlib re-draws forever; we
    stop after ``max_tries`` with a DataError.
    """
    labels = _check_dirichlet_request(labels, num_clients, num_classes, beta, least_samples, max_tries)
    n_total = labels.size
    cap = n_total / num_clients
    alpha = np.full(num_clients, float(beta))
    for _ in range(max_tries):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for c in range(num_classes):
            idx_c = np.flatnonzero(labels == c)
            rng.shuffle(idx_c)
            cuts = _pfllib_cuts(rng.dirichlet(alpha), sizes < cap, idx_c.size)
            for client, piece in enumerate(np.split(idx_c, cuts)):
                pieces[client].append(piece)
                sizes[client] += piece.size
        if sizes.min() >= least_samples:
            return [np.concatenate(p).astype(np.int64) for p in pieces]
    raise _dirichlet_error(beta, least_samples, max_tries)


def split_train_test_pfllib(
    indices: np.ndarray, train_ratio: float, rng: np.random.RandomState
) -> tuple[np.ndarray, np.ndarray]:
    """PFLlib's ``split_data`` for one client: sklearn's ``train_test_split(train_size=r)``.

    sklearn keeps floor(r * n) samples for training, draws one permutation of the client's
    positions from the global RandomState (PFLlib passes no ``random_state``), takes the test
    split from its head and the train split from its tail. Both keep the permutation's order.
    sklearn refuses an empty train split; so do we.
    """
    if not 0.0 < train_ratio < 1.0:
        raise ConfigError(f"config key 'data.train_ratio' must be in (0, 1), got {train_ratio}")
    indices = np.asarray(indices, dtype=np.int64)
    n = indices.size
    n_train = math.floor(train_ratio * n)
    if n_train == 0:
        raise DataError(
            f"a client holds {n} samples, so PFLlib's train/test split (data.train_ratio="
            f"{train_ratio}) leaves it no training sample; lower num_clients or raise data.subsample"
        )
    order = rng.permutation(n)
    n_test = n - n_train
    return indices[order[n_test:]], indices[order[:n_test]]


def pfllib_client_splits(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    *,
    partition: str,
    seed: int,
    least_samples: int,
    train_ratio: float,
    beta: float = 0.1,
    classes_per_client: int = 2,
    max_tries: int = 1000,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client (train, test) positions into ``labels`` under PFLlib's rules.

    One ``RandomState(seed)`` feeds the partition and then every client's split, in client
    order: PFLlib's generators seed numpy's global RNG once (``np.random.seed(1)``) and call
    ``separate_data`` then ``split_data``, so with seed 1 the result is PFLlib's split.
    """
    if not 0 <= seed < 2**32:
        raise ConfigError(
            f"config key 'seed' is {seed}; data.partition_rules=pfllib seeds numpy's RandomState, "
            f"which takes 0..{2**32 - 1}"
        )
    rng = np.random.RandomState(seed)
    if partition == "pathological":
        parts = partition_pathological_pfllib(
            labels, num_clients, classes_per_client, num_classes, least_samples, rng
        )
    elif partition == "dirichlet":
        parts = partition_dirichlet_pfllib(
            labels, num_clients, beta, num_classes, least_samples, rng, max_tries
        )
    else:
        raise ConfigError(
            f"config key 'data.partition' is {partition!r}; data.partition_rules=pfllib applies "
            f"to {', '.join(PFLLIB_PARTITIONS)}"
        )
    return [split_train_test_pfllib(part, train_ratio, rng) for part in parts]
