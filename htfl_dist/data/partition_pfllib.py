"""PFLlib's partition rules (``data.partition_rules=pfllib``, the default), reproduced exactly.

The rules of PFLlib's ``dataset/utils/dataset_utils.py``: ``separate_data`` (``pat``, unbalanced
or balanced, ``dir`` and ``exdir``), then ``split_data`` (sklearn's per-client train/test split),
drawn from one legacy
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

PFLLIB_PARTITIONS = ("dirichlet", "pathological", "exdir")

PFLLIB_EXDIR_MIN_SAMPLES = 10
"""PFLlib's ``exdir`` guard (``min_require_size = 10`` in its code, not ``least_samples``)."""


def balance_refusal(partition: str) -> str:
    """The one line for ``data.balance=true`` where PFLlib's ``balance`` changes nothing."""
    return (f"config key 'data.balance' is true but data.partition is {partition!r}: PFLlib's balance "
            f"changes only its pat split (data.partition=pathological; its dir and exdir splits are the "
            f"same either way); leave data.balance false")


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
    n: int, holders: int, least_samples: int, num_classes: int, rng: np.random.RandomState, cls: int = 0,
    balance: bool = False,
) -> list[int]:
    """How many of a class's ``n`` samples each of its ``holders`` (m) clients gets, in order.

    PFLlib's unbalanced ``pat`` rule: every holder but the last draws uniformly from
    [low, high) with high = int(n / m) and low = int(max(n / m / 10, least_samples / C)) (numpy
    truncates the float bounds PFLlib passes to ``randint``); the last holder takes the rest,
    so it always gets more than n / m. This, not a Dirichlet, makes PFLlib's pathological
    clients so unequal in size. A single holder takes all without a draw (numpy draws nothing
    for size 0 and does not check the bounds then).

    ``balance`` (PFLlib's ``balance=True``): every holder but the last gets int(n / m), the last
    the rest (n - (m - 1) * int(n / m), between n / m and n / m + m - 1); nothing is drawn and the
    guard plays no part.
    """
    if holders == 1:
        return [n]
    per = n / holders
    if balance:
        return [int(per)] * (holders - 1) + [n - int(per) * (holders - 1)]
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
    balance: bool = False,
) -> list[np.ndarray]:
    """PFLlib's pathological split (``separate_data``, ``pat``; ``balance`` as PFLlib's).

    Holders by ``pfllib_pathological_holders``, shares by ``pfllib_shares``. Unlike the legacy
    rule nothing is shuffled: each holder takes the next run of the class's indices in
    ascending order. A client's array lists its classes in class order. Balanced, the split
    draws nothing.
    """
    labels = checked_labels(labels, num_clients, num_classes)
    _check_classes_per_client(classes_per_client, num_classes)
    holders = pfllib_pathological_holders(num_clients, classes_per_client, num_classes)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, clients in enumerate(holders):
        if not clients:
            continue
        idx = np.flatnonzero(labels == c)
        shares = pfllib_shares(idx.size, len(clients), least_samples, num_classes, rng, c, balance)
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
    for _ in range(max_tries):
        parts = _dirichlet_attempt(labels, num_clients, num_classes, beta, rng,
                                   lambda c, shares, open_, n: _pfllib_cuts(shares, open_, n))
        if min(part.size for part in parts) >= least_samples:
            return parts
    raise dirichlet_retry_error(beta, least_samples, max_tries)


def _dirichlet_attempt(labels: np.ndarray, num_clients: int, num_classes: int, beta: float,
                       rng: np.random.RandomState, cut) -> list[np.ndarray]:
    """One draw of PFLlib's second level, shared by ``dir`` and ``exdir``: class by class, shuffle
    the class's samples, draw Dir(beta) over every client, and let ``cut(c, shares, open, n)``
    (open: the clients not yet holding N / num_clients samples) say where the pieces end; each
    client's indices in PFLlib's order (class by class, each piece in shuffled order)."""
    cap = labels.size / num_clients
    alpha = np.full(num_clients, float(beta))
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for c in range(num_classes):
        idx_c = np.flatnonzero(labels == c)
        rng.shuffle(idx_c)
        cuts = cut(c, rng.dirichlet(alpha), sizes < cap, idx_c.size)
        for client, piece in enumerate(np.split(idx_c, cuts)):
            pieces[client].append(piece)
            sizes[client] += piece.size
    return [np.concatenate(p).astype(np.int64) for p in pieces]


def pfllib_exdir_min_holders(num_clients: int, classes_per_client: int, num_classes: int) -> int:
    """How many clients PFLlib's exdir wants per class: ``max(C_k * n // C // 2, 1)``, half the
    mean number of holders a class gets when n clients pick C_k of C classes each, at least 1."""
    return max(classes_per_client * num_clients // num_classes // 2, 1)


def pfllib_exdir_holders(
    num_clients: int, classes_per_client: int, num_classes: int, rng: np.random.RandomState, max_tries: int
) -> list[list[int]]:
    """exdir's first level: per class, the clients that may hold it (ascending).

    Each client in turn picks ``classes_per_client`` distinct classes uniformly
    (``choice(C, k, replace=False)``, one permutation of the classes per client); the whole
    assignment is drawn again until every class has ``pfllib_exdir_min_holders`` clients.
    PFLlib loops forever when that cannot happen; we refuse at once when the clients' slots
    cannot cover every class, and give up after ``max_tries`` assignments otherwise.
    """
    if classes_per_client * num_clients < num_classes:
        raise ConfigError(
            f"exdir partition: {num_clients} clients with data.classes_per_client={classes_per_client} "
            f"cannot cover all {num_classes} classes, and PFLlib's exdir needs every class held "
            f"(it would re-draw forever); raise data.classes_per_client or num_clients"
        )
    need = pfllib_exdir_min_holders(num_clients, classes_per_client, num_classes)
    for _ in range(max_tries):
        holders: list[list[int]] = [[] for _ in range(num_classes)]
        for client in range(num_clients):
            for c in rng.choice(num_classes, classes_per_client, replace=False):
                holders[int(c)].append(client)
        if min(len(h) for h in holders) >= need:
            return holders
    raise DataError(
        f"exdir partition: after {max_tries} tries some class still had fewer than {need} of "
        f"{num_clients} clients (data.classes_per_client={classes_per_client} of {num_classes} "
        f"classes each); raise data.classes_per_client or data.max_partition_tries"
    )


def _exdir_cuts(proportions: np.ndarray, open_clients: np.ndarray, n: int, last_holder: int) -> np.ndarray:
    """exdir's cut points: ``_pfllib_cuts``'s rule over the class's open holders, then PFLlib's
    remainder rule: if the last cut is not n (truncation left samples past the last holder),
    every cut from the last holder on becomes n, so those samples go to it.

    When no holder is open (all full) PFLlib divides by zero; its NaN cut points fail the
    remainder test and are overwritten with n from the last holder on, and the cut points before
    it (NaN cast to int) only delimit empty pieces: the whole class goes to its last holder. We
    give it there directly. With one client there are no cut points (PFLlib fails there:
    it reads the last of none)."""
    masked = proportions * open_clients
    total = masked.sum()
    if not (np.isfinite(total) and total > 0):
        cuts = np.zeros(proportions.size - 1, dtype=np.int64)
        cuts[last_holder:] = n
        return cuts
    cuts = (np.cumsum(masked / total) * n).astype(np.int64)[:-1]
    if cuts.size and cuts[-1] != n:
        cuts[last_holder:] = n
    return cuts


def partition_exdir_pfllib(
    labels: np.ndarray,
    num_clients: int,
    beta: float,
    classes_per_client: int,
    num_classes: int,
    min_samples: int,
    rng: np.random.RandomState,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """PFLlib's ``exdir`` (extended Dirichlet, arXiv 2311.03154; PFLlib PRs #141, #185).

    Two levels. First, ``pfllib_exdir_holders`` says which clients may hold each class. Then
    the ``dir`` rule, restricted to them: for each class in turn, shuffle its samples, draw
    Dir(beta) over all clients, keep the shares of its holders that are not yet full (N /
    num_clients samples), renormalise, cut (``_exdir_cuts``: a truncation remainder goes to the
    class's last holder). The second level is drawn again until every client holds
    ``min_samples`` (PFLlib: 10). Last, each client's indices are shuffled, client by client.
    """
    labels = checked_dirichlet_request(labels, num_clients, num_classes, beta, min_samples, max_tries)
    _check_classes_per_client(classes_per_client, num_classes)
    holders = pfllib_exdir_holders(num_clients, classes_per_client, num_classes, rng, max_tries)
    held = np.zeros((num_classes, num_clients), dtype=bool)
    for c, clients in enumerate(holders):
        held[c, clients] = True
    for _ in range(max_tries):
        parts = _dirichlet_attempt(labels, num_clients, num_classes, beta, rng,
                                   lambda c, shares, open_, n: _exdir_cuts(shares, open_ & held[c], n, holders[c][-1]))
        if min(part.size for part in parts) >= min_samples:
            for part in parts:
                rng.shuffle(part)
            return parts
    raise dirichlet_retry_error(beta, min_samples, max_tries)


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
    balance: bool = False,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client (train, test) positions into ``labels`` under PFLlib's rules.

    One ``RandomState(seed)`` feeds the partition and then every client's split, in client
    order: PFLlib's generators seed numpy's global RNG once (``np.random.seed(1)``) and call
    ``separate_data`` then ``split_data``, so with seed 1 the result is PFLlib's split.
    ``least_samples`` is the guard: PFLlib's ``least_samples`` for dirichlet and pathological,
    ``PFLLIB_EXDIR_MIN_SAMPLES`` for exdir (the caller picks). ``balance`` is PFLlib's, which
    only its ``pat`` rule reads: refused elsewhere rather than ignored.
    """
    if not 0 <= seed < 2**32:
        raise ConfigError(
            f"config key 'seed' is {seed}; data.partition_rules=pfllib seeds numpy's RandomState, "
            f"which takes 0..{2**32 - 1}"
        )
    if balance and partition != "pathological":
        raise ConfigError(balance_refusal(partition))
    rng = np.random.RandomState(seed)
    if partition == "pathological":
        parts = partition_pathological_pfllib(
            labels, num_clients, classes_per_client, num_classes, least_samples, rng, balance
        )
    elif partition == "dirichlet":
        parts = partition_dirichlet_pfllib(
            labels, num_clients, beta, num_classes, least_samples, rng, max_tries
        )
    elif partition == "exdir":
        parts = partition_exdir_pfllib(
            labels, num_clients, beta, classes_per_client, num_classes, least_samples, rng, max_tries
        )
    else:
        raise ConfigError(
            f"config key 'data.partition' is {partition!r}; data.partition_rules=pfllib applies "
            f"to {', '.join(PFLLIB_PARTITIONS)}"
        )
    return [split_train_test_pfllib(part, train_ratio, rng) for part in parts]
