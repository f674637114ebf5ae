"""FedDistill maths on hand-computed examples: the three distillation losses, rows without a
global logit, the per-class logit means clients upload, the server's unweighted class mean."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.algorithms.feddistill import distillation_term
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator

C = 2


def _context(num_classes=C, **options):
    entry = get_algorithm("feddistill")
    context = AlgorithmContext(num_classes=num_classes, feature_dim=7, seed=0,
                               train=TrainConfig(batch_size=2, lr=0.0), options=parse_options(entry, options))
    return entry, context


def _table(rows: dict[int, list[float]], num_classes=C):
    table = torch.zeros(num_classes, num_classes)
    available = torch.zeros(num_classes, dtype=torch.bool)
    for c, row in rows.items():
        table[c] = torch.tensor(row)
        available[c] = True
    return table, available


def test_softmax_loss_is_cross_entropy_to_softmax_of_global_logits():
    # softmax([ln 3, 0]) = [3/4, 1/4]; log softmax([0, 0]) = [ln ½, ln ½]  ->  ℓ = ln 2
    table, available = _table({0: [math.log(3.0), 0.0]})
    z = torch.zeros(1, 2)
    value = distillation_term(z, torch.tensor([0]), table, available, "softmax", "mask")
    assert value.item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_raw_loss_uses_the_averaged_logits_as_weights():
    # −(2·ln ½ + (−1)·ln ½) = ln 2: the raw target does not sum to one
    table, available = _table({1: [2.0, -1.0]})
    value = distillation_term(torch.zeros(1, 2), torch.tensor([1]), table, available, "raw", "mask")
    assert value.item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_mse_loss_is_mean_square_over_classes():
    table, available = _table({0: [0.0, 1.0]})
    value = distillation_term(torch.tensor([[1.0, 3.0]]), torch.tensor([0]), table, available, "mse", "mask")
    assert value.item() == pytest.approx((1.0 + 4.0) / 2)


def test_rows_without_global_logit_count_in_the_batch_but_add_nothing_when_masked():
    table, available = _table({0: [math.log(3.0), 0.0]})  # class 1 has no global logit
    z = torch.zeros(2, 2)
    value = distillation_term(z, torch.tensor([0, 1]), table, available, "softmax", "mask")
    assert value.item() == pytest.approx(math.log(2.0) / 2, rel=1e-6)  # divided by B = 2


def test_self_target_rows_have_a_gradient_under_raw_only():
    table, available = _table({})  # nothing global for any class
    z = torch.tensor([[1.0, 0.0]], requires_grad=True)
    value = distillation_term(z, torch.tensor([0]), table, available, "raw", "self_target")
    # ℓ = −(1·log σ(z)_0) = log(1 + e^{−1}); ∇ = softmax(z)·Σz − z
    assert value.item() == pytest.approx(math.log(1 + math.exp(-1)), rel=1e-6)
    value.backward()
    p0 = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(z.grad, torch.tensor([[p0 - 1, 1 - p0]]))
    z.grad = None
    distillation_term(z, torch.tensor([0]), table, available, "softmax", "self_target").backward()
    torch.testing.assert_close(z.grad, torch.zeros(1, 2))  # softmax of itself: no pull
    z.grad = None
    masked = distillation_term(z, torch.tensor([0]), table, available, "raw", "mask")
    assert masked.item() == 0.0


def test_compat_selects_the_reference_values_and_knobs_override_it():
    _, context = _context(compat="htfllib")
    assert (context.options.distill_loss, context.options.missing_rows) == ("raw", "self_target")
    _, context = _context(compat="htfllib", distill_loss="mse")
    assert (context.options.distill_loss, context.options.missing_rows) == ("mse", "self_target")
    _, context = _context()
    assert (context.options.distill_loss, context.options.missing_rows) == ("softmax", "mask")


@pytest.mark.parametrize("options,match", [
    ({"distill_loss": "kl"}, "algo.distill_loss"),
    ({"reg_weight": -1}, "algo.reg_weight"),
    ({"compat": "fedml"}, "algo.compat"),
])
def test_bad_options_are_one_line_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        _context(**options)


def _linear_client(num_classes=3) -> ClientState:
    """A model whose logits are easy to write down: features = x, head = fixed Linear."""
    head = nn.Linear(2, num_classes, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[:num_classes])
    model = SplitModel(nn.Identity(), head, feature_dim=2)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0], [2.0, 2.0]])
    y = torch.tensor([0, 0, 2, 2])
    return ClientState(0, "linear", model, torch.optim.SGD(model.parameters(), lr=0.0), x, y, x, y,
                       torch.device("cpu"))


@pytest.mark.parametrize("logits_from", ["during_training", "post_update"])
def test_client_uploads_the_mean_logits_of_the_classes_it_holds(logits_from):
    entry, context = _context(num_classes=3, logits_from=logits_from)
    client = _linear_client()
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "logits": torch.empty(0, 3)}
    result = entry.client(context).train(client, empty, 0, torch_generator(0, "b"))
    assert result.upload["class_ids"].tolist() == [0, 2]  # class 1 is not held: no row
    # logits = [x0, x1, x0 + x1]; class 0: mean of [1,2,3] and [3,4,7]; class 2: [0,1,1] and [2,2,4]
    torch.testing.assert_close(result.upload["logits"], torch.tensor([[2.0, 3.0, 5.0], [1.0, 1.5, 2.5]]))
    assert entry.client(context).theory_upload_floats(client) == 3 * 2


def test_server_takes_the_unweighted_mean_per_class_and_forgets_absent_classes():
    entry, context = _context(num_classes=3)
    server = entry.server(context)
    server.update({
        5: {"class_ids": torch.tensor([0, 2]), "logits": torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 4.0]])},
        2: {"class_ids": torch.tensor([0]), "logits": torch.tensor([[3.0, 2.0, 0.0]])},
    }, 0, torch_generator(0, "s"))
    down = server.download()
    assert down["class_ids"].tolist() == [0, 2]
    torch.testing.assert_close(down["logits"], torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 4.0]]))
    server.update({1: {"class_ids": torch.tensor([1]), "logits": torch.ones(1, 3)}}, 1, torch_generator(0, "s"))
    assert server.download()["class_ids"].tolist() == [1]  # nothing remembered across rounds
    assert server.theory_download_floats() == 3 * 3
