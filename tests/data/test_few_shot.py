"""Few-shot clients (``data.few_shot: k``, HtFLlib/PFLlib ``-fs k``): each client's training split
keeps the first k samples of each class in its stored order; the test split is untouched."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from conftest import SMOKE
from htfl_dist.config import load_config
from htfl_dist.data.cache import few_shot_rows, load_client_split, write_cache

CPU = torch.device("cpu")


def test_first_k_of_each_class_in_stored_order_by_hand():
    labels = torch.tensor([3, 1, 3, 3, 0, 1, 1, 3, 0])
    assert few_shot_rows(labels, 2).tolist() == [0, 1, 2, 4, 5, 8]
    assert few_shot_rows(labels, 1).tolist() == [0, 1, 4]
    assert few_shot_rows(labels, 3).tolist() == [0, 1, 2, 3, 4, 5, 6, 8]
    assert few_shot_rows(labels, 9).tolist() == list(range(9))  # a class with fewer keeps all of it
    assert few_shot_rows(torch.tensor([], dtype=torch.int64), 2).tolist() == []


def _reference_rule(labels: list[int], shots: int) -> list[int]:
    """What HtFLlib's ``read_client_data(..., few_shot=k)`` keeps: walking the split in order,
    a sample is kept while its label has been kept fewer than k times."""
    kept, seen = [], defaultdict(int)
    for row, label in enumerate(labels):
        if seen[label] < shots:
            kept.append(row)
            seen[label] += 1
    return kept


@pytest.mark.parametrize("shots", [1, 2, 5, 17])
def test_the_references_walk_on_random_splits(shots):
    generator = torch.Generator().manual_seed(shots)
    for _ in range(20):
        labels = torch.randint(0, 10, (int(torch.randint(0, 300, (1,), generator=generator)),), generator=generator)
        assert few_shot_rows(labels, shots).tolist() == _reference_rule(labels.tolist(), shots)


def _cache(path, clients):
    """A partition cache of ``clients`` (per client: train labels, test labels), x = the row number."""
    def arrays(cid):
        train_y, test_y = (np.asarray(labels, dtype=np.int64) for labels in clients[cid])
        return (np.arange(train_y.size, dtype=np.float32).reshape(-1, 1), train_y,
                np.arange(test_y.size, dtype=np.float32).reshape(-1, 1) + 1000, test_y)

    attrs = {"format_version": 1, "dataset": "toy", "partition": "dirichlet", "num_classes": 4, "in_channels": 0,
             "image_size": 0, "num_clients": len(clients), "x_format": "float32", "key_json": "{}"}
    write_cache(str(path), attrs, len(clients), 4, arrays)
    return str(path)


def test_a_clients_split_keeps_k_per_class_with_its_features_and_an_untouched_test_split(tmp_path):
    path = _cache(tmp_path / "toy.h5", [([2, 2, 0, 2, 1, 0, 2, 0, 0], [0, 1, 1, 2]),
                                        ([3, 3, 3], [3, 0])])
    full = load_client_split(path, 0)
    few = load_client_split(path, 0, few_shot=2)
    assert few.train_y.tolist() == [2, 2, 0, 1, 0]
    assert few.train_x.flatten().tolist() == [0, 1, 2, 4, 5]  # the same rows' inputs, in stored order
    assert torch.equal(few.test_x, full.test_x) and torch.equal(few.test_y, full.test_y)
    assert load_client_split(path, 1, few_shot=2).train_y.tolist() == [3, 3]
    assert torch.equal(load_client_split(path, 1, few_shot=0).train_y, load_client_split(path, 1).train_y)


@pytest.mark.parametrize("shots", [1, 5])
def test_every_runtime_client_trains_on_exactly_k_per_class(shots, tmp_path, cache_dir):
    """Built by the runtime on the smoke config: each client's training split holds min(n_c, k)
    samples of each class c, they are the first of their class in the stored split, its test split
    is the full one's, and placement weighs the clients by the few-shot counts."""
    from htfl_dist.runtime.session import RunContext, Session
    from htfl_dist.runtime.transport import LocalTransport

    full = load_config(SMOKE, [f"data.cache_dir={cache_dir}"])
    config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", f"data.few_shot={shots}"])
    session = Session(RunContext(config, LocalTransport(), CPU, tmp_path))
    info = session.partition
    assert info.class_counts.max() == shots  # the few-shot counts placement uses
    for client_id in range(config.num_clients):
        stored = load_client_split(info.path, client_id)
        counts = torch.bincount(stored.train_y, minlength=info.num_classes)
        client = session.clients.peek(client_id)
        got = torch.bincount(client.train_y, minlength=info.num_classes)
        assert got.tolist() == torch.clamp(counts, max=shots).tolist()
        assert got.tolist() == info.class_counts[client_id].tolist()
        assert counts.max() > shots  # the smoke split has more: something was left out
        kept = _reference_rule(stored.train_y.tolist(), shots)
        assert torch.equal(client.train_x, stored.train_x[kept]) and torch.equal(client.train_y, stored.train_y[kept])
        assert torch.equal(client.test_x, stored.test_x) and torch.equal(client.test_y, stored.test_y)
    session.clients.close()
    assert config.config_hash() != full.config_hash()
    assert load_config(SMOKE, [f"data.cache_dir={cache_dir}", "data.few_shot=0"]).config_hash() == full.config_hash()


def test_a_negative_shot_count_is_refused():
    from htfl_dist.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'data.few_shot' must be >= 0"):
        load_config(SMOKE, ["data.few_shot=-1"])
