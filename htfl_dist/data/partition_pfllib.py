"""PFLlib's partition rules (``data.partition_rules=pfllib``, the default), reproduced exactly.

The rules of PFLlib's ``dataset/utils/dataset_utils.py``: ``separate_data`` (unbalanced ``pat``
and ``dir``), then ``split_data`` (sklearn's per-client train/test split), drawn from one legacy
``numpy.random.RandomState`` in PFLlib's call order, so seed 1 on the same labels gives the split
PFLlib's generators write, sample for sample. Every paper's split came from these generators.

They live apart from the legacy rules (:mod:`htfl_dist.data.partition`) because exactness
constrains them differently: every draw must happen in PFLlib's order and with PFLlib's float
expressions, and the index arrays keep PFLlib's order (class by class, not sorted), because
PFLlib's train/test split permutes positions. They share that module's label and request
checks, so a mistake gets the same one-line message under either rule set. (Reading a directory
PFLlib already wrote is another matter: :mod:`htfl_dist.data.pfllib`.)
"""
from __future__ import annotations

import math

import numpy as np

from htfl_dist.config.rules import check_value
from htfl_dist.errors import ConfigError, DataError

from .partition import checked_dirichlet_request, checked_labels, dirichlet_retry_error

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
    labels = checked_labels(labels, num_clients, num_classes)
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
    labels = checked_dirichlet_request(labels, num_clients, num_classes, beta, least_samples, max_tries)
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
    raise dirichlet_retry_error(beta, least_samples, max_tries)


def split_train_test_pfllib(
    indices: np.ndarray, train_ratio: float, rng: np.random.RandomState
) -> tuple[np.ndarray, np.ndarray]:
    """PFLlib's ``split_data`` for one client: sklearn's ``train_test_split(train_size=r)``.

    sklearn keeps floor(r * n) samples for training, draws one permutation of the client's
    positions from the global RandomState (PFLlib passes no ``random_state``), takes the test
    split from its head and the train split from its tail. Both keep the permutation's order.
    sklearn refuses an empty train split; so do we.
    """
    check_value("data.train_ratio", train_ratio, above=0, below=1)
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
