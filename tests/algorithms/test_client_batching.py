"""train.client_batching=vmap: a rank's participants of one architecture train as one batched
model (training.run_batched_training) and must end where training them one by one ends, within
float tolerance: parameters, uploads, loss sums and sample counts; through the runtime, the same
metrics whatever the number of ranks; refused where it cannot hold."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from conftest import SMOKE, maths_only, run_program, run_smoke
from htfl_dist.algorithms import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    algorithm_names,
    get_algorithm,
    parse_options,
)
from htfl_dist.algorithms.class_rows import ClassMeans, GroupClassMeans
from htfl_dist.algorithms.training import (
    Batch,
    batching_obstacle,
    group_schedule,
    run_batched_training,
    run_local_training,
)
from htfl_dist.config import TrainConfig, load_config
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel, initial_client_model
from htfl_dist.runtime.startup import check_client_batching
from htfl_dist.seeding import torch_generator

SIZES = (23, 37, 8, 21)
"""One architecture, four clients: partial batches of 3 and 7 samples, a client smaller than one
batch (no step at all with last_batch=drop), one whose trailing batch holds a single sample (left
out); with 2 epochs they take 6, 8, 2 and 4 steps (keep), so three of them are masked at the end."""
K, CLASSES, IMAGE = 16, 10, 12  # htcnn1 on 12×12 images: the same layers, fast
PARAMETERS = dict(rtol=1e-5, atol=1e-6)
"""Float tolerance (observed on CPU: parameters within 3e-8 after a round, uploads within 2e-7, loss
sums within 1.4e-7 relative)."""


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny steps: torch's thread pool costs more than it gains, and far more on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _clients(sizes=SIZES, member: str = "htcnn1") -> list[ClientState]:
    data = torch.Generator().manual_seed(7)
    clients = []
    for client_id, count in enumerate(sizes):
        model = initial_client_model(member, client_id, 0, num_classes=CLASSES, feature_dim=K, in_channels=1,
                                     image_size=IMAGE)
        x = torch.randn(count, 1, IMAGE, IMAGE, generator=data)
        y = torch.randint(0, 4, (count,), generator=data)
        clients.append(ClientState(client_id, member, model, torch.optim.SGD(model.parameters(), lr=0.01),
                                   x, y, x, y, torch.device("cpu")))
    return clients


def _context(algorithm: str, options: dict, **train) -> AlgorithmContext:
    entry = get_algorithm(algorithm)
    return AlgorithmContext(num_classes=CLASSES, feature_dim=K, seed=0, options=parse_options(entry, options),
                            train=TrainConfig(batch_size=10, lr=0.01, local_epochs=2, **train))


def _knowledge(algorithm: str) -> dict:
    if algorithm == "local":
        return {}
    protos = 0.1 * torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    return {"class_ids": torch.tensor([0, 1, 3]), "protos": protos}  # class 2 has no global prototype


def _generators(clients: list[ClientState]) -> list[torch.Generator]:
    return [torch_generator(0, "batches", client.client_id, 4) for client in clients]


def _assert_same_training(one_by_one: list[ClientState], batched: list[ClientState], expected, got) -> None:
    for alone, grouped, result, batched_result in zip(one_by_one, batched, expected, got, strict=True):
        assert batched_result.samples == result.samples
        assert batched_result.loss_sum == pytest.approx(result.loss_sum, rel=1e-5, abs=1e-6)
        for (name, p), q in zip(alone.model.named_parameters(), grouped.model.parameters(), strict=True):
            torch.testing.assert_close(q, p, **PARAMETERS, msg=f"client {alone.client_id} {name}")
        assert set(batched_result.upload) == set(result.upload)
        for key, value in result.upload.items():
            torch.testing.assert_close(batched_result.upload[key], value, **PARAMETERS)


ORDERS = list(itertools.product(["shuffled", "fixed"], ["keep", "drop"]))
VARIANTS = [
    *[("local", {}, *order) for order in ORDERS],
    *[("fedproto", {}, *order) for order in ORDERS],  # client_reg=paper, proto_from=post_update
    ("fedproto", {"client_reg": "htfllib", "proto_from": "during_training"}, "shuffled", "keep"),
    ("fedproto", {"client_reg": "htfllib", "proto_from": "during_training"}, "fixed", "drop"),
    ("fedproto", {"proto_from": "during_training", "weighted": True}, "shuffled", "drop"),
    ("fedproto", {"client_reg": "htfllib", "proto_from": "pre_update"}, "fixed", "keep"),
    ("fedtgp", {"proto_from": "during_training"}, "shuffled", "keep"),
    ("protonorm", {}, "shuffled", "keep"),  # FedProto's client: client_reg=htfllib, λ = 10, post_update
    ("protonorm", {"proto_samples": "full_batches"}, "fixed", "drop"),
]


@pytest.mark.parametrize("algorithm,options,batch_order,last_batch", VARIANTS)
def test_batched_group_ends_where_one_by_one_training_ends(algorithm, options, batch_order, last_batch):
    context = _context(algorithm, options, batch_order=batch_order, last_batch=last_batch)
    algorithm_client = get_algorithm(algorithm).client(context)
    knowledge = _knowledge(algorithm)
    one_by_one, batched = _clients(), _clients()
    expected = [algorithm_client.train(client, knowledge, 4, generator)
                for client, generator in zip(one_by_one, _generators(one_by_one), strict=True)]
    got = algorithm_client.train_group(batched, knowledge, 4, _generators(batched))
    _assert_same_training(one_by_one, batched, expected, got)
    if last_batch == "drop":  # 8 samples, batch 10: nothing trained, no prototype seen while training
        assert got[2].samples == 0


def test_a_clients_result_does_not_depend_on_its_group():
    """A group is whatever one rank hosts: client 1 trained alone, with client 0, or with all."""
    context = _context("fedproto", {"proto_from": "during_training"})
    algorithm_client = get_algorithm("fedproto").client(context)
    knowledge = _knowledge("fedproto")
    results = []
    for members in ([1], [0, 1], [0, 1, 2, 3]):
        clients = [_clients()[i] for i in members]
        result = algorithm_client.train_group(clients, knowledge, 4, _generators(clients))
        position = members.index(1)
        results.append((result[position], clients[position]))
    (first, first_client), *others = results
    for result, client in others:
        _assert_same_training([first_client], [client], [first], [result])


def test_finished_clients_take_no_update():
    """A loss that ignores the padding weights (every row counts) isolates the mask: batches are
    full (sizes are multiples of 10, fixed order), so only the steps after a client's last one
    differ, and they must not move it."""
    context = _context("local", {}, batch_order="fixed")

    def loss_fn(batch: Batch) -> torch.Tensor:
        return batch.logits.pow(2).mean() + batch.features.mean()

    one_by_one, batched = _clients((20, 40, 10)), _clients((20, 40, 10))
    expected = [run_local_training(client, context, loss_fn, generator)
                for client, generator in zip(one_by_one, _generators(one_by_one), strict=True)]
    got = run_batched_training(batched, context, loss_fn, _generators(batched))
    for (loss, seen), (batched_loss, batched_seen) in zip(expected, got, strict=True):
        assert batched_seen == seen and batched_loss == pytest.approx(loss, rel=1e-5)
    for alone, grouped in zip(one_by_one, batched, strict=True):
        for p, q in zip(alone.model.parameters(), grouped.model.parameters(), strict=True):
            torch.testing.assert_close(q, p, **PARAMETERS)


def test_schedule_pads_partial_batches_and_idle_steps():
    clients = _clients((23, 8))
    schedule = group_schedule(clients, TrainConfig(batch_size=10, batch_order="fixed"), _generators(clients))
    assert schedule.steps == [3, 1] and schedule.samples == [23, 8]
    assert schedule.index.shape == (2, 3, 10)
    assert schedule.weights.sum(dim=(1, 2)).tolist() == [23.0, 8.0]
    assert schedule.index[0, 2, :3].tolist() == [20, 21, 22]  # client 0's partial batch
    assert schedule.index[1, 0, :8].tolist() == list(range(23, 31))  # client 1's rows follow client 0's
    assert set(schedule.index[1, 1:].flatten().tolist()) == {23}  # idle steps point at its first sample


def test_group_class_means_are_each_clients_class_means():
    rows, labels = torch.randn(2, 5, 3), torch.tensor([[0, 1, 1, 2, 0], [2, 2, 0, 1, 1]])
    weights = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    group = GroupClassMeans(2, 4, 3)
    group.add(rows, labels, weights)
    for g, (class_ids, means) in enumerate(group.rows()):
        alone = ClassMeans(4, 3)
        real = weights[g] > 0
        alone.add(rows[g][real], labels[g][real])
        expected_ids, expected_means = alone.rows()
        assert torch.equal(class_ids, expected_ids)
        torch.testing.assert_close(means, expected_means)


# ----------------------------------------------------------------------------- refusals


def _defined_by(client: type, name: str) -> type:
    return next(klass for klass in client.__mro__ if name in vars(klass))


def test_a_batched_path_is_declared_exactly_where_train_and_train_group_come_from_one_class():
    """The registry's ``batched_clients`` is a declaration; this holds it to the classes: FedOC
    and FedSA inherit the prototype client's train_group but train with their own loss, so
    batching them would train the parent's loss."""
    for name in algorithm_names():
        client = get_algorithm(name).client
        own = _defined_by(client, "train_group") is _defined_by(client, "train") is not ClientAlgorithm
        assert get_algorithm(name).batched_clients == own, name
    declared = {name for name in algorithm_names() if get_algorithm(name).batched_clients}
    assert declared == {"local", "fedproto", "fedtgp", "fpl", "protonorm"}


def _check(algorithm: str, group: str) -> None:
    context = AlgorithmContext(num_classes=CLASSES, feature_dim=K, seed=0, num_clients=8, model_group=group,
                               options=parse_options(get_algorithm(algorithm), {}),
                               train=TrainConfig(client_batching="vmap"))
    check_client_batching(get_algorithm(algorithm), context)


def test_start_up_check_accepts_the_batched_algorithms_on_htcnn8_and_refuses_the_rest():
    for algorithm in ("local", "fedproto", "fedtgp"):
        _check(algorithm, "HtCNN8")
    with pytest.raises(ConfigError, match=r"^train.client_batching=vmap: fedoc has no batched client path "
                                          r"\(these have: fedproto, fedtgp, fpl, local, protonorm\); "
                                          r"use train.client_batching=off$"):
        _check("fedoc", "HtCNN8")
    with pytest.raises(ConfigError, match=r"cannot batch googlenet: it has a BatchNorm2d layer .*client_batching=off$"):
        _check("fedproto", "HtFE8")


def test_models_with_batch_statistics_or_dropout_are_named():
    assert batching_obstacle(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None
    assert batching_obstacle(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))) == "a Dropout layer (1)"
    assert batching_obstacle(nn.Sequential(nn.BatchNorm1d(2, track_running_stats=False))) == "a BatchNorm1d layer (0)"
    assert batching_obstacle(nn.Sequential(nn.InstanceNorm1d(2))) is None  # per-sample statistics, no state


def test_an_optimizer_other_than_plain_sgd_is_refused_not_trained_differently():
    clients = _clients((12, 15))
    clients[1].optimizer = torch.optim.SGD(clients[1].model.parameters(), lr=0.01, momentum=0.9)
    with pytest.raises(ConfigError, match=r"client 1's optimizer is not plain SGD"):
        run_batched_training(clients, _context("local", {}), lambda batch: batch.logits.sum(), _generators(clients))
    clients[1].optimizer = torch.optim.SGD(clients[1].model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"different learning rates \[0.01, 0.1\]"):
        run_batched_training(clients, _context("local", {}), lambda batch: batch.logits.sum(), _generators(clients))


def test_default_train_group_trains_one_by_one():
    """An algorithm without a batched path still accepts train_group (ClientAlgorithm's default)."""
    model = SplitModel(nn.Flatten(), nn.Linear(4, 2), feature_dim=4)
    x, y = torch.randn(6, 1, 2, 2), torch.tensor([0, 1, 0, 1, 0, 1])
    client = ClientState(0, "flat", model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, x, y,
                         torch.device("cpu"))
    context = AlgorithmContext(num_classes=2, feature_dim=4, seed=0, train=TrainConfig(batch_size=4),
                               options=parse_options(get_algorithm("feddistill"), {}))
    algorithm_client = get_algorithm("feddistill").client(context)
    empty = {"class_ids": torch.zeros(0, dtype=torch.int64), "logits": torch.zeros(0, 2)}
    (result,) = algorithm_client.train_group([client], empty, 0, [torch_generator(0, "batches", 0, 0)])
    assert result.samples == 6


def test_option_defaults_to_off_and_keeps_the_hash():
    base = load_config(None, []).config_hash()
    assert TrainConfig().client_batching == "off"
    assert load_config(None, ["train.client_batching=off"]).config_hash() == base
    assert load_config(None, ["train.client_batching=vmap"]).config_hash() != base
    with pytest.raises(ConfigError, match=r"^config key 'train.client_batching' is 'jit'; allowed: off, vmap$"):
        load_config(None, ["train.client_batching=jit"])


def test_refusal_is_one_line_and_exit_status_2(tmp_path, cache_dir):
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path / "run"), f"data.cache_dir={cache_dir}",
                         "algorithm=fedoc", "train.client_batching=vmap"])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "fedoc has no batched client path" in lines[0], result.stderr


# ----------------------------------------------------------------------------- through the runtime

GROUPED = ("model.group=htcnn1,htcnn2", "rounds=2", "train.local_epochs=2")
"""Six clients of two architectures: groups of three in one process, of one or two on 3 ranks."""


def _close(rows: list[dict], expected: list[dict]) -> None:
    assert [r["round"] for r in rows] == [r["round"] for r in expected]
    for row, reference in zip(maths_only(rows), maths_only(expected), strict=True):
        assert set(row) == set(reference)
        for key, value in reference.items():
            if isinstance(value, float):
                assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
            else:
                assert row[key] == value, key


@pytest.fixture(scope="module")
def one_by_one(tmp_path_factory, cache_dir):
    return run_smoke("single", 1, tmp_path_factory.mktemp("off"), cache_dir, *GROUPED)


@pytest.fixture(scope="module")
def batched(tmp_path_factory, cache_dir):
    return run_smoke("single", 1, tmp_path_factory.mktemp("vmap"), cache_dir, *GROUPED, "train.client_batching=vmap")


def test_a_batched_run_gives_the_per_client_runs_metrics(one_by_one, batched):
    _close(batched, one_by_one)


@pytest.mark.launch
def test_a_batched_run_is_world_size_invariant(batched, tmp_path, cache_dir):
    rows = run_smoke("torchrun", 3, tmp_path, cache_dir, *GROUPED, "train.client_batching=vmap")
    _close(rows, batched)


@pytest.mark.integration
def test_groups_larger_than_the_resident_clients_train_in_chunks(one_by_one, tmp_path, cache_dir):
    """Groups of three with at most two clients resident: trained as a group of two and one."""
    rows = run_smoke("single", 1, tmp_path, cache_dir, *GROUPED, "train.client_batching=vmap",
                     "runtime.resident_clients=2")
    _close(rows, one_by_one)
