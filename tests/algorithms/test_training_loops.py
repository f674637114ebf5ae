"""The loops and class-row helpers every algorithm shares (htfl_dist.algorithms.training,
htfl_dist.algorithms.class_rows), checked batch by batch against what they must do. Written from
the survivors of a mutmut pass over algorithms/: each test names what a broken line would change."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from htfl_dist.algorithms import AlgorithmContext, ClientState
from htfl_dist.algorithms.class_rows import (
    ClassMeans,
    ClassMeanServer,
    check_class_rows,
    class_row_fields,
    dense_class_table,
    euclidean_distances,
)
from htfl_dist.algorithms.training import Batch, run_local_training, train_on_pairs
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ProtocolError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

# ----------------------------------------------------------------------------- train_on_pairs


def _pairs(count: int):
    """Row i = (i, i), label i, one extra tensor = 10·i: a batch is aligned iff they agree."""
    rows = torch.arange(count, dtype=torch.float32).repeat(2, 1).t().contiguous()
    return rows, torch.arange(count), torch.arange(count) * 10


def _recording_loss(weight: nn.Parameter, calls: list):
    def loss_fn(rows, labels, extra=None):
        calls.append((rows.clone(), labels.clone(), None if extra is None else extra.clone()))
        return (weight * rows).sum() / rows.shape[0]
    return loss_fn


def test_train_on_pairs_visits_every_pair_once_per_epoch_in_the_generators_order():
    """7 pairs, batches of 3, 2 epochs: batches of 3, 3, 1 per epoch (the last may be smaller),
    rows, labels and per-pair tensors shuffled together, by the epochs' permutations drawn in
    turn from the generator; the returned value is the last epoch's mean loss per pair."""
    rows, labels, extra = _pairs(7)
    weight = nn.Parameter(torch.zeros(2))
    calls: list = []
    loss = train_on_pairs(rows, labels, _recording_loss(weight, calls), torch.optim.SGD([weight], lr=0.0),
                          epochs=2, batch_size=3, generator=torch_generator(5, "pairs"), per_pair=(extra,))
    expected_generator = torch_generator(5, "pairs")
    orders = [torch.randperm(7, generator=expected_generator) for _ in range(2)]
    assert [c[1].shape[0] for c in calls] == [3, 3, 1, 3, 3, 1]
    for epoch, order in enumerate(orders):
        seen = torch.cat([c[1] for c in calls[3 * epoch: 3 * epoch + 3]])
        assert seen.tolist() == order.tolist()
    for batch_rows, batch_labels, batch_extra in calls:
        assert torch.equal(batch_rows[:, 0].long(), batch_labels) and torch.equal(batch_extra, batch_labels * 10)
    assert loss == 0.0  # weight 0, lr 0
    weight.data.fill_(1.0)  # now a batch's loss is 2·(mean label), so the epoch mean is 2·mean(0..6) = 6
    calls.clear()
    loss = train_on_pairs(rows, labels, _recording_loss(weight, calls), torch.optim.SGD([weight], lr=0.0),
                          epochs=3, batch_size=3, generator=torch_generator(6, "pairs"))
    assert loss == pytest.approx(6.0) and len(calls) == 9


def test_train_on_pairs_reports_the_last_epoch_not_the_first():
    """lr 1 on loss w·mean(row): w falls by mean(row) per step, so later epochs have lower loss;
    the value returned is the mean over the last epoch's pairs (batch losses weighted by size)."""
    rows, labels, _ = _pairs(4)
    weight = nn.Parameter(torch.zeros(2))
    steps: list = []

    def loss_fn(batch_rows, batch_labels):
        value = (weight * batch_rows).sum() / batch_rows.shape[0]
        steps.append((float(value.detach()), batch_rows.shape[0]))
        return value

    loss = train_on_pairs(rows, labels, loss_fn, torch.optim.SGD([weight], lr=1.0), epochs=2, batch_size=3,
                          generator=torch_generator(0, "pairs"))
    assert len(steps) == 4
    last_epoch = steps[2:]
    assert loss == pytest.approx(sum(v * n for v, n in last_epoch) / 4)
    assert loss != pytest.approx(sum(v * n for v, n in steps[:2]) / 4)


def test_train_on_pairs_leaves_out_a_single_pair_batch_only_when_asked():
    """7 pairs in batches of 3 end with a batch of one: kept by default, skipped with skip_single
    (a BatchNorm layer cannot train on it); the reported mean still divides by all pairs."""
    rows, labels, _ = _pairs(7)
    weight = nn.Parameter(torch.ones(2))
    for skip, sizes in ((False, [3, 3, 1]), (True, [3, 3])):
        calls: list = []
        loss = train_on_pairs(rows, labels, _recording_loss(weight, calls), torch.optim.SGD([weight], lr=0.0),
                              epochs=1, batch_size=3, generator=torch_generator(0, "pairs"), skip_single=skip)
        assert [c[1].shape[0] for c in calls] == sizes
        kept = torch.cat([c[1] for c in calls]).float()
        batch_means = [2 * c[1].float().mean() * c[1].shape[0] for c in calls]
        assert loss == pytest.approx(float(sum(batch_means)) / 7), kept
    calls = []
    train_on_pairs(rows[:6], labels[:6], _recording_loss(weight, calls), torch.optim.SGD([weight], lr=0.0),
                   epochs=1, batch_size=3, generator=torch_generator(0, "pairs"), skip_single=True)
    assert [c[1].shape[0] for c in calls] == [3, 3]  # no batch of one: nothing left out


def test_train_on_pairs_clips_between_backward_and_step():
    rows, labels, _ = _pairs(3)
    weight = nn.Parameter(torch.zeros(2))
    seen: list = []
    train_on_pairs(rows, labels, lambda r, y: (weight * r).sum(), torch.optim.SGD([weight], lr=1.0), epochs=1,
                   batch_size=3, generator=torch_generator(0, "p"),
                   before_step=lambda: seen.append(weight.grad.clone()))
    assert len(seen) == 1 and torch.equal(seen[0], torch.tensor([3.0, 3.0]))  # Σ rows, before the step


# -------------------------------------------------------------------------- run_local_training


class _Recorder(nn.Module):
    """features = w·x (w starts at 1), logits = features padded to C = 2 columns."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.w * x


def _client(count: int, lr: float = 0.0) -> ClientState:
    head = nn.Linear(1, 2, bias=False)
    nn.init.zeros_(head.weight)
    model = SplitModel(_Recorder(), head, feature_dim=1)
    x = torch.arange(count, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(count) % 2
    return ClientState(3, "rec", model, torch.optim.SGD(model.feature_extractor.parameters(), lr=lr),
                       x, y, x, y, torch.device("cpu"))


def _context(batch_size: int, epochs: int = 1) -> AlgorithmContext:
    return AlgorithmContext(num_classes=2, feature_dim=1, seed=0,
                            train=TrainConfig(batch_size=batch_size, local_epochs=epochs), options=None)


def test_local_training_batches_follow_the_generator_and_skip_only_a_trailing_single_sample():
    """11 samples in batches of 10: one batch of 10 in the generator's order, then a trailing
    batch of one that is skipped (BatchNorm cannot train on it); the loss sum counts the 10."""
    client = _client(11)
    batches: list[Batch] = []
    loss_sum, seen = run_local_training(client, _context(10), lambda b: b.features.sum() * 0 + 1.0,
                                        torch_generator(2, "local"), on_batch=batches.append)
    order = torch.randperm(11, generator=torch_generator(2, "local"))
    assert seen == 10 and loss_sum == pytest.approx(10.0)
    assert [b.labels.shape[0] for b in batches] == [10]
    assert batches[0].x.flatten().long().tolist() == order[:10].tolist()
    # what on_batch sees: this batch's inputs, labels and detached outputs
    torch.testing.assert_close(batches[0].features, batches[0].x)
    assert batches[0].logits.shape == (10, 2) and not batches[0].logits.requires_grad
    assert torch.equal(batches[0].labels, client.train_y[order[:10]])


def test_local_training_keeps_a_lone_first_batch_and_a_batch_of_one_from_batch_size_one():
    """A client of one sample still trains (start 0); with batch size 1 only the trailing batch
    of one is skipped, as for any size."""
    _, seen = run_local_training(_client(1), _context(10), lambda b: b.features.sum(), torch_generator(0, "l"))
    assert seen == 1
    _, seen = run_local_training(_client(2), _context(1), lambda b: b.features.sum(), torch_generator(0, "l"))
    assert seen == 1
    _, seen = run_local_training(_client(3), _context(2, epochs=2), lambda b: b.features.sum(),
                                 torch_generator(0, "l"))
    assert seen == 4  # each epoch: a batch of 2, then the trailing single sample skipped


def test_local_training_hands_the_batch_inputs_to_the_loss_and_steps_every_optimizer_given():
    client = _client(4, lr=0.0)
    extra = nn.Parameter(torch.zeros(()))
    extra_optimizer = torch.optim.SGD([extra], lr=1.0)
    inputs: list = []

    def loss_fn(batch: Batch) -> torch.Tensor:
        inputs.append(batch.x.clone())
        return batch.features.sum() + extra * batch.x.sum()

    run_local_training(client, _context(4), loss_fn, torch_generator(0, "l"), optimizers=[extra_optimizer])
    assert len(inputs) == 1 and sorted(inputs[0].flatten().tolist()) == [0.0, 1.0, 2.0, 3.0]
    assert float(extra.detach()) == pytest.approx(-6.0)  # the given optimizer stepped: −lr · Σx
    assert float(client.model.feature_extractor.w.detach()) == 1.0  # the client's own was not asked to


# ------------------------------------------------------------------------------- class rows


def test_class_row_fields_bound_both_fields_by_the_class_count():
    ids, rows = class_row_fields("protos", 8, 5)
    assert (ids.name, ids.dtype, ids.max_rows) == ("class_ids", torch.int64, 5)
    assert (rows.name, rows.dtype, rows.trailing_shape, rows.max_rows) == ("protos", torch.float32, (8,), 5)


def test_dense_class_table_defaults_to_the_cpu():
    table, available = dense_class_table({"class_ids": torch.tensor([2]), "rows": torch.tensor([[1.0, 2.0]])},
                                         "rows", 3)
    assert table.device.type == "cpu" and available.tolist() == [False, False, True]
    assert table.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 2.0]]


def test_check_class_rows_names_the_client_and_the_mismatch():
    with pytest.raises(ProtocolError, match=r"^client 4 sent 2 class ids for 1 rows$"):
        check_class_rows(4, torch.tensor([0, 1]), torch.ones(1, 3), 5)
    with pytest.raises(ProtocolError, match=r"client 4 .*outside"):
        check_class_rows(4, torch.tensor([5]), torch.ones(1, 3), 5)  # ids are 0..C-1: C itself is out
    check_class_rows(4, torch.tensor([4]), torch.ones(1, 3), 5)


def test_euclidean_distances_stay_exact_far_from_the_origin():
    """cdist's matrix-product shortcut (used above 25 rows) computes ‖a‖² + ‖b‖² − 2a·b, which
    loses unit distances between points near 10⁴ in float32; the direct form keeps them."""
    a = torch.full((30, 1), 10_000.0) + torch.arange(30, dtype=torch.float32).unsqueeze(1)
    b = torch.full((30, 1), 10_000.0)
    distances = euclidean_distances(a, b)
    torch.testing.assert_close(distances[:, 0], torch.arange(30, dtype=torch.float32))


class _RowServer(ClassMeanServer):
    key = "rows"

    @classmethod
    def row_width(cls, context: AlgorithmContext) -> int:
        return 1


def _row_server() -> _RowServer:
    return _RowServer(AlgorithmContext(num_classes=3, feature_dim=1, seed=0, train=TrainConfig(), options=None))


def test_class_mean_server_starts_empty_and_averages_in_double_precision():
    """Before any upload it downloads nothing. Then 10⁸ + 1 and −10⁸ for class 1 from two
    clients, and 2 from a third: float32 sums would lose the 1 (mean 2/3), float64 gives 1."""
    server = _row_server()
    download = server.download()
    assert download["class_ids"].numel() == 0 and download["rows"].shape == (0, 1)
    uploads = {0: {"class_ids": torch.tensor([1]), "rows": torch.tensor([[1e8]])},
               1: {"class_ids": torch.tensor([1]), "rows": torch.tensor([[1.0]])},
               2: {"class_ids": torch.tensor([1]), "rows": torch.tensor([[-1e8]])}}
    diagnostics = server.update(uploads, round_index=0, generator=torch_generator(0, "s"))
    assert diagnostics["global_classes"] == 1.0
    assert server.download()["class_ids"].tolist() == [1]
    assert server.download()["rows"].tolist() == [[pytest.approx(1.0 / 3.0)]]


def test_class_mean_server_names_the_client_of_a_bad_upload():
    server = _row_server()
    with pytest.raises(ProtocolError, match=r"^client 7 "):
        server.validate_upload(7, {"class_ids": torch.tensor([0, 1]), "rows": torch.ones(1, 1)})


def test_class_means_weighted_and_unweighted():
    means = ClassMeans(3, 1)
    means.add(torch.tensor([[1.0], [3.0], [5.0]]), torch.tensor([0, 0, 2]))
    means.add(torch.tensor([[7.0]]), torch.tensor([0]))
    assert means.present().tolist() == [True, False, True]
    assert means.dense().flatten().tolist() == [pytest.approx(11.0 / 3.0), 0.0, 5.0]
    weighted = ClassMeans(2, 1)
    weighted.add(torch.tensor([[1.0], [4.0]]), torch.tensor([1, 1]), torch.tensor([3.0, 1.0]))
    ids, rows = weighted.rows()
    assert ids.tolist() == [1] and rows.tolist() == [[pytest.approx(7.0 / 4.0)]]
