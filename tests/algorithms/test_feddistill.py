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
    _, context = _context(compat="reference")
    assert (context.options.distill_loss, context.options.missing_rows) == ("raw", "self_target")
    _, context = _context(compat="reference", distill_loss="mse")
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


# --------------------------------------------------------------------------- edges found by a mutmut pass


def _lse(*values: float) -> float:
    return math.log(sum(math.exp(v) for v in values))


def test_reg_weight_bound_is_inclusive_and_its_message_exact():
    for weight in (0.0, 0.5):  # λ = 0 (CE only) and 0 < λ < 1 are valid
        assert _context(reg_weight=weight)[1].options.reg_weight == weight
    with pytest.raises(ConfigError) as info:
        _context(reg_weight=-0.5)
    assert str(info.value) == "config key 'algo.reg_weight' must be >= 0, got -0.5"


def test_upload_fields_declare_class_ids_and_c_wide_logit_rows():
    from htfl_dist.payload import Field

    entry, context = _context(num_classes=3)
    assert entry.client.upload_fields(context) == (
        Field("class_ids", torch.int64, (), max_rows=3), Field("logits", torch.float32, (3,), max_rows=3))


def test_mse_averages_over_classes_per_row_before_the_batch_mean():
    # row 0 (class 0, target [0, 1]): ((1−0)² + (3−1)²)/2 = 2.5; row 1 (class 1): no target, masked;
    # (2.5 + 0)/B with B = 2 -> 1.25 (a mean over all 4 entries would give 5/4/2 = 0.625)
    table, available = _table({0: [0.0, 1.0]})
    logits = torch.tensor([[1.0, 3.0], [5.0, -5.0]])
    value = distillation_term(logits, torch.tensor([0, 1]), table, available, "mse", "mask")
    assert value.item() == pytest.approx(1.25)


def test_client_loss_adds_lambda_times_the_masked_softmax_distillation_term():
    """lr 0, so loss_sum is Σ over the 4 samples of CE + λ·ℓ (each batch's mean × its size).

    logits z = [x0, x1, x0 + x1]: class 0 rows [1, 2, 3], [3, 4, 7]; class 2 rows [0, 1, 1], [2, 2, 4].
    Only class 0 has a global logit, ḡ^0 = [ln 2, 0, 0], softmax = [½, ¼, ¼], so for its rows
    ℓ = −Σ_k w_k (z_k − lse z) = lse z − (½z_0 + ¼z_1 + ¼z_2); class 2's rows are masked (add 0)."""
    entry, context = _context(num_classes=3, reg_weight=2.0)
    client = _linear_client()
    knowledge = {"class_ids": torch.tensor([0]), "logits": torch.tensor([[math.log(2.0), 0.0, 0.0]])}
    generator = torch_generator(0, "b")
    before = generator.get_state().clone()
    result = entry.client(context).train(client, knowledge, 1, generator)
    ce = (_lse(1, 2, 3) - 1) + (_lse(3, 4, 7) - 3) + (_lse(0, 1, 1) - 1) + (_lse(2, 2, 4) - 4)
    distill = (_lse(1, 2, 3) - 1.75) + (_lse(3, 4, 7) - 4.25)
    assert result.samples == 4
    assert result.loss_sum == pytest.approx(ce + 2.0 * distill, rel=1e-6)
    assert not torch.equal(generator.get_state(), before)  # batches drawn from the round's stream


def test_round_zero_is_ce_only_even_where_missing_rows_would_self_target():
    """compat reference (raw, self_target): with a global table, rows without a target would add
    −Σ z·log softmax(z) ≠ 0; in round 0 (nothing downloaded) the loss is CE alone."""
    entry, context = _context(num_classes=3, compat="reference")
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "logits": torch.empty(0, 3)}
    result = entry.client(context).train(_linear_client(), empty, 0, torch_generator(0, "b"))
    ce = (_lse(1, 2, 3) - 1) + (_lse(3, 4, 7) - 3) + (_lse(0, 1, 1) - 1) + (_lse(2, 2, 4) - 4)
    assert result.loss_sum == pytest.approx(ce, rel=1e-6)


@pytest.mark.parametrize("logits_from", ["during_training", "post_update"])
def test_logits_during_training_are_taken_before_the_step(logits_from):
    """lr > 0 and one batch of all 4 samples (one step): during_training uploads the logits the
    batch had before its step (the initial model's means, by hand as above); post_update uploads
    the trained model's class means, which moved."""
    entry = get_algorithm("feddistill")
    context = AlgorithmContext(num_classes=3, feature_dim=2, seed=0, train=TrainConfig(batch_size=4, lr=0.5),
                               options=parse_options(entry, {"logits_from": logits_from}))
    client = _linear_client()
    client.optimizer = torch.optim.SGD(client.model.parameters(), lr=0.5)
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "logits": torch.empty(0, 3)}
    result = entry.client(context).train(client, empty, 0, torch_generator(0, "b"))
    initial = torch.tensor([[2.0, 3.0, 5.0], [1.0, 1.5, 2.5]])
    with torch.no_grad():
        trained = client.model(client.train_x)
    trained_means = torch.stack([trained[:2].mean(dim=0), trained[2:].mean(dim=0)])
    assert not torch.allclose(trained_means, initial)
    expected = initial if logits_from == "during_training" else trained_means
    torch.testing.assert_close(result.upload["logits"], expected)
