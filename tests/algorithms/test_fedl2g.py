"""FedL2G maths on hand-computed examples, for both guides: the guidance loss, the learning-to-guide
gradient of the guiding vectors (closed forms on a one-weight model, and finite differences through
a real SGD step), the server's mean-and-step with clipping, the quiz/study split, warm-up rounds,
the options; and the two-round smoke run the conformance test shares."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import launch_smoke, make_context
from torch import nn

from conftest import SMOKE, read_metrics, run_program
from htfl_dist.algorithms import ClientState
from htfl_dist.algorithms.fedl2g import (
    clip_by_norm,
    guidance_loss,
    guide_gradient,
    quiz_indices,
)
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import SplitModel
from htfl_dist.seeding import torch_generator


def _context(num_classes=2, feature_dim=1, batch_size=1, lr=0.5, **options):
    return make_context("fedl2g", num_classes=num_classes, feature_dim=feature_dim, batch_size=batch_size, lr=lr,
                        **options)


def _scalar_model(w=1.0, a=(1.0, -1.0)) -> SplitModel:
    """f(x) = w·x (K = 1), z = a·f (C = 2): small enough to differentiate by hand."""
    extractor, head = nn.Linear(1, 1, bias=False), nn.Linear(1, len(a), bias=False)
    with torch.no_grad():
        extractor.weight.fill_(w)
        head.weight.copy_(torch.tensor(a).view(-1, 1))
    return SplitModel(extractor, head, feature_dim=1)


def _sigmoid(t: float) -> float:
    return 1.0 / (1.0 + math.exp(-t))


# --------------------------------------------------------------------------- the guidance loss


@pytest.mark.parametrize("guide", ["feature", "logit"])
def test_guidance_loss_is_the_mean_square_over_every_element(guide):
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    guides = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    value = guidance_loss(features, logits, torch.tensor([0, 1]), guides, guide)
    # feature: ((1 + 4) + (4 + 9)) / 4;  logit: ((0 + 1) + (1 + 1)) / 4
    assert value.item() == pytest.approx(18 / 4 if guide == "feature" else 3 / 4)


# --------------------------------------------------------------------------- learning to guide


def _pseudo_step_by_hand(lr):
    """Study (x = 1, y = 0) on w = 1, a = (1, −1) with g^0 equal to the guided output, so ℓ_g adds
    no gradient at θ: z = (1, −1), p = softmax(z), p1 = 1 − σ(2); ∂CE/∂w = −2·p1, ∂CE/∂a = (−p1, p1).
    θ′: w′ = 1 + 2η·p1, a′ = (1 + η·p1, −1 − η·p1). Quiz (x = 1, y = 1): z′ = a′·w′, q = softmax(z′);
    ∂CE_q/∂w′ = q0·(a′0 − a′1), ∂CE_q/∂a′ = (q0·w′, −q0·w′)."""
    p1 = 1.0 - _sigmoid(2.0)
    w1, a1 = 1.0 + 2 * lr * p1, (1.0 + lr * p1, -1.0 - lr * p1)
    q0 = _sigmoid(a1[0] * w1 - a1[1] * w1)
    return w1, q0 * (a1[0] - a1[1]), (q0 * w1, -q0 * w1)


def test_feature_guide_gradient_by_hand():
    """dG^c = −η·(∂²ℓ_g/∂g^c∂θ)ᵀ ∇_θ′CE_q = (2η/(B·K)) Σ_{b: y_b = c} x_b·∂CE_q/∂w′ (f = w·x, K = 1):
    the mixed derivative is non-zero although ℓ_g's own gradient at θ is 0; class 1 had no study
    sample, so its row is 0."""
    lr = 0.5
    _, grad_w, _ = _pseudo_step_by_hand(lr)
    guides = torch.tensor([[1.0], [0.3]])  # g^0 = f(1) = 1
    study = [(torch.tensor([[1.0]]), torch.tensor([0]))]
    quiz = [(torch.tensor([[1.0]]), torch.tensor([1]))]
    gradient = guide_gradient(_scalar_model(), guides, study, quiz, lr, "feature")
    torch.testing.assert_close(gradient, torch.tensor([[2 * lr * grad_w], [0.0]]))
    assert gradient[0, 0].item() == pytest.approx(1.938, abs=1e-3)  # η = ½: 0.91464 · 2.11920


def test_logit_guide_gradient_by_hand():
    """Guiding the logits z_j = a_j·w·x (W = C = 2): dG^0_j = (2η/(B·C))·(a_j·x·∂CE_q/∂w′ + w·x·∂CE_q/∂a′_j)."""
    lr = 0.5
    _, grad_w, grad_a = _pseudo_step_by_hand(lr)
    guides = torch.tensor([[1.0, -1.0], [5.0, 5.0]])  # g^0 = z(1) = (1, −1)
    study = [(torch.tensor([[1.0]]), torch.tensor([0]))]
    quiz = [(torch.tensor([[1.0]]), torch.tensor([1]))]
    gradient = guide_gradient(_scalar_model(), guides, study, quiz, lr, "logit")
    scale = 2 * lr / 2
    expected = torch.tensor([[scale * (1.0 * grad_w + grad_a[0]), scale * (-1.0 * grad_w + grad_a[1])], [0.0, 0.0]])
    torch.testing.assert_close(gradient, expected)


class _NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh())

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("guide", ["feature", "logit"])
def test_guide_gradient_equals_finite_differences_through_a_real_sgd_step(guide):
    """The quiz loss after one torch.optim.SGD step on the study objective, differenced in G (float64,
    two study batches, two quiz batches, BatchNorm in train mode); the model and its running
    statistics are left as they were."""
    torch.manual_seed(3)
    model = SplitModel(_NormNet(), nn.Linear(4, 3), feature_dim=4).double().train()
    before = copy.deepcopy(model.state_dict())
    width = 4 if guide == "feature" else 3
    guides = torch.randn(3, width, dtype=torch.float64)
    study = [(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])),
             (torch.randn(4, 3, dtype=torch.float64), torch.tensor([1, 1, 0, 0]))]
    quiz = [(torch.randn(3, 3, dtype=torch.float64), torch.tensor([0, 1, 2])),
            (torch.randn(3, 3, dtype=torch.float64), torch.tensor([2, 1, 0]))]
    lr = 0.3

    def quiz_loss_after_step(table):
        copy_ = copy.deepcopy(model)
        optimizer = torch.optim.SGD(copy_.parameters(), lr=lr)
        loss = 0
        for x, y in study:
            features, logits = copy_.forward_with_features(x)
            guided = features if guide == "feature" else logits
            loss = loss + F.cross_entropy(logits, y) + ((guided - table[y]) ** 2).mean()
        optimizer.zero_grad()
        (loss / len(study)).backward()
        optimizer.step()
        with torch.no_grad():  # still in train mode: BatchNorm normalises with the quiz batch's statistics
            return sum(F.cross_entropy(copy_(x), y) for x, y in quiz).item() / len(quiz)

    numeric = torch.zeros_like(guides)
    step = 1e-6
    for c in range(3):
        for j in range(width):
            up, down = guides.clone(), guides.clone()
            up[c, j] += step
            down[c, j] -= step
            numeric[c, j] = (quiz_loss_after_step(up) - quiz_loss_after_step(down)) / (2 * step)
    gradient = guide_gradient(model, guides, study, quiz, lr, guide)
    torch.testing.assert_close(gradient, numeric, rtol=1e-5, atol=1e-8)
    assert torch.count_nonzero(gradient[2]) == 0  # class 2 was in no study batch
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


# --------------------------------------------------------------------------- server


def test_server_steps_the_guides_by_the_mean_gradient_per_class():
    entry, context = _context(num_classes=3, feature_dim=2, server_lr=0.5)
    server = entry.server(context)
    server.guides = torch.tensor([[1.0, 1.0], [0.0, 0.0], [7.0, -7.0]])
    uploads = {1: {"class_ids": torch.tensor([0]), "grads": torch.tensor([[2.0, 0.0]])},
               0: {"class_ids": torch.tensor([1, 0]), "grads": torch.tensor([[1.0, 1.0], [4.0, 2.0]])}}
    diagnostics = server.update(uploads, 0, torch_generator(0, "server", 0))
    # class 0: mean([4, 2], [2, 0]) = [3, 1]; class 1: [1, 1]; class 2: nobody -> 0 (it stays)
    torch.testing.assert_close(server.download()["guides"], torch.tensor([[-0.5, 0.5], [-0.5, -0.5], [7.0, -7.0]]))
    assert diagnostics["guide_classes"] == 2.0
    torch.testing.assert_close(server.download()["class_ids"], torch.arange(3))


def test_server_clips_the_whole_gradient_table():
    entry, context = _context(num_classes=2, feature_dim=2, server_lr=1.0, clip_grad_norm=1.0)
    server = entry.server(context)
    server.guides = torch.zeros(2, 2)
    uploads = {0: {"class_ids": torch.tensor([0, 1]), "grads": torch.tensor([[3.0, 0.0], [0.0, 4.0]])}}
    server.update(uploads, 0, torch_generator(0, "server", 0))
    # ‖ḡ‖ = 5 over the whole table: scaled by 1/5
    torch.testing.assert_close(server.guides, torch.tensor([[-0.6, 0.0], [0.0, -0.8]]), atol=1e-6, rtol=1e-6)
    small = torch.tensor([[0.3, 0.4]])
    assert torch.equal(clip_by_norm(small, 1.0), small)  # norm 0.5 <= 1: unchanged
    assert torch.equal(clip_by_norm(small * 100, 0.0), small * 100)  # 0: no clipping


def test_server_rejects_bad_rows():
    entry, context = _context(num_classes=2, feature_dim=2)
    server = entry.server(context)
    before = server.guides.clone()
    assert torch.equal(server.guides, before)
    with pytest.raises(ProtocolError, match="twice"):
        server.validate_upload(3, {"class_ids": torch.tensor([1, 1]), "grads": torch.zeros(2, 2)})
    with pytest.raises(ProtocolError, match="outside"):
        server.validate_upload(3, {"class_ids": torch.tensor([2]), "grads": torch.zeros(1, 2)})


def test_initial_guides_are_standard_normal_from_the_run_seed():
    entry, context = _context(num_classes=4, feature_dim=3)
    first, again = entry.server(context).guides, entry.server(context).guides
    assert torch.equal(first, again) and first.shape == (4, 3)
    _, logit_context = _context(num_classes=4, feature_dim=3, guide="logit")
    assert entry.server(logit_context).guides.shape == (4, 4)
    assert [field.trailing_shape for field in entry.server.download_fields(logit_context)] == [(), (4,)]


# --------------------------------------------------------------------------- client


def _client(samples=8, num_classes=2, w=1.0, client_id=0) -> ClientState:
    model = _scalar_model(w, (1.0, -1.0, 0.5)[:num_classes])
    x = torch.arange(samples, dtype=torch.float32).view(-1, 1) / samples
    y = torch.arange(samples) % num_classes
    return ClientState(client_id=client_id, architecture="scalar", model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                       train_x=x, train_y=y, test_x=x, test_y=y, device=torch.device("cpu"))


def test_quiz_set_is_fixed_per_client_and_held_out_of_training():
    assert torch.equal(quiz_indices(10, 3, "first", 0, 5), torch.tensor([0, 1, 2]))
    drawn = quiz_indices(50, 4, "random", 0, 5)
    assert torch.equal(drawn, quiz_indices(50, 4, "random", 0, 5)) and drawn.tolist() == sorted(drawn.tolist())
    assert not torch.equal(drawn, quiz_indices(50, 4, "random", 0, 6))  # another client, another subset
    assert drawn.unique().numel() == 4
    entry, context = _context(batch_size=2, quiz_batches=2, quiz_from="first")
    study, quiz_x, quiz_y = entry.client(context).split(_client())
    torch.testing.assert_close(quiz_x.flatten(), torch.tensor([0.0, 1.0, 2.0, 3.0]) / 8)
    torch.testing.assert_close(study.train_x.flatten(), torch.tensor([4.0, 5.0, 6.0, 7.0]) / 8)
    assert torch.equal(quiz_y, torch.tensor([0, 1, 0, 1]))


def test_warm_up_rounds_only_learn_the_guides():
    entry, context = _context(batch_size=2, warm_up_rounds=1)
    algorithm, client = entry.client(context), _client()
    weights = [p.detach().clone() for p in client.model.parameters()]
    knowledge = entry.server(context).download()
    warm = algorithm.train(client, knowledge, 0, torch_generator(0, "b", 0, 0))
    assert (warm.samples, warm.loss_sum) == (0, 0.0)
    assert all(torch.equal(p, q) for p, q in zip(client.model.parameters(), weights, strict=True))
    assert warm.upload["grads"].abs().sum() > 0
    trained = algorithm.train(client, knowledge, 1, torch_generator(0, "b", 0, 1))
    assert trained.samples == 6  # 8 samples less a quiz set of 1 batch of 2
    assert not all(torch.equal(p, q) for p, q in zip(client.model.parameters(), weights, strict=True))


def test_clip_grad_norm_bounds_each_local_step():
    """One local step (a quiz set of 6, a study set of 2 = one batch): the model moves by
    lr·clip_grad_norm when its gradient is larger than clip_grad_norm, and by more without clipping."""
    def step_norm(**options):
        entry, context = _context(batch_size=6, **options)
        client = _client(samples=8)
        before = torch.cat([p.detach().flatten() for p in client.model.parameters()])
        entry.client(context).train(client, entry.server(context).download(), 0, torch_generator(0, "b", 0, 0))
        return float((torch.cat([p.detach().flatten() for p in client.model.parameters()]) - before).norm())

    assert step_norm(clip_grad_norm=1e-3) == pytest.approx(0.5 * 1e-3, rel=1e-3)
    assert step_norm() > 1e-2


def test_upload_holds_the_classes_of_the_study_batches_and_counts_them():
    entry, context = _context(num_classes=3, batch_size=1, study_batches=1)
    algorithm = entry.client(context)
    client = _client(samples=6, num_classes=3)
    result = algorithm.train(client, entry.server(context).download(), 0, torch_generator(0, "b", 0, 0))
    assert result.upload["class_ids"].numel() == 1  # one study batch of one sample: one class
    assert result.upload["grads"].shape == (1, 1)
    assert algorithm.theory_upload_floats(client) == 1
    entry, context = _context(num_classes=3, batch_size=2, study_batches=2, guide="logit")
    algorithm = entry.client(context)
    result = algorithm.train(_client(samples=9, num_classes=3), entry.server(context).download(), 0,
                             torch_generator(0, "b", 0, 0))
    rows = result.upload["class_ids"].numel()
    assert rows >= 2 and result.upload["grads"].shape == (rows, 3)
    assert algorithm.theory_upload_floats(_client(samples=9, num_classes=3)) == 3 * rows


def test_a_client_without_room_for_its_quiz_set_is_a_config_error():
    entry, context = _context(batch_size=4, quiz_batches=2)
    with pytest.raises(ConfigError, match=r"algo\.quiz_batches"):
        entry.client(context).init_client(_client(samples=8))
    entry.client(context).init_client(_client(samples=9))


# --------------------------------------------------------------------------- options


def test_compat_selects_the_reference_values_and_knobs_override_it():
    _, context = _context()
    options = context.options
    assert (options.guide, options.server_lr, options.quiz_from, options.warm_up_rounds, options.clip_grad_norm) == \
        ("feature", 100.0, "random", 0, 0.0)
    _, context = _context(compat="reference", guide="logit")
    options = context.options
    assert (options.server_lr, options.quiz_from, options.warm_up_rounds, options.clip_grad_norm) == \
        (0.1, "first", 50, 100.0)
    _, context = _context(compat="reference", warm_up_rounds=0, server_lr=2.0)
    options = context.options
    assert (options.warm_up_rounds, options.server_lr, options.clip_grad_norm) == (0, 2.0, 100.0)


@pytest.mark.parametrize("options,match", [
    ({"guide": "proto"}, "algo.guide"),
    ({"server_lr": 0}, "algo.server_lr"),
    ({"quiz_batches": 0}, "algo.quiz_batches"),
    ({"study_batches": 0}, "algo.study_batches"),
    ({"warm_up_rounds": -1}, "algo.warm_up_rounds"),
    ({"clip_grad_norm": -1}, "algo.clip_grad_norm"),
    ({"quiz_from": "last"}, "algo.quiz_from"),
])
def test_bad_options_are_one_line_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        _context(**options)


# --------------------------------------------------------------------------- a real run


@pytest.mark.integration
def test_two_rounds_learn_and_send_the_papers_count(single_run):
    """The conformance test's one-process run (shared): learning, bytes within 5 % of W·m_i."""
    rows = launch_smoke(single_run, "fedl2g")
    assert all(row["guide_classes"] >= 1 for row in rows)


@pytest.mark.integration
def test_logit_guide_resumes_from_a_checkpoint_exactly(tmp_path, cache_dir):
    """The logit guide with HtFLlib's options and one warm-up round, 3 rounds checkpointed every
    round; round 1's checkpoint (G after one server step, the clients' untouched models) resumed
    in a new run gives rounds 2-3 exactly: nothing a client needs lives outside its checkpoint."""
    overrides = ["algorithm=fedl2g", "algo.guide=logit", "algo.compat=reference", "algo.warm_up_rounds=1", "rounds=3"]

    def args(out, *more):
        return ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}", *overrides, *more]

    result = run_program(args(tmp_path / "full", "checkpoint_every=1", "checkpoint_keep=3"))
    assert result.returncode == 0, result.stderr
    full = read_metrics(tmp_path / "full")
    assert full[0]["train_loss"] == 0.0 and full[1]["train_loss"] > 0  # round 1 only learned G
    source = tmp_path / "full" / "checkpoints" / "round_00001"
    result = run_program([*args(tmp_path / "resumed"), "--resume", str(source)])
    assert result.returncode == 0, result.stderr
    resumed = read_metrics(tmp_path / "resumed")
    for key in ("test_acc", "train_loss", "guide_step_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key


@pytest.mark.parametrize("guide", ["feature", "logit"])
def test_htfllib_init_draws_the_guides_as_htfllib_does(guide):
    """HtFLlib's clientL2G reseeds torch after building its model, so the server's nn.Embedding(C,
    W) made after the last client is the first draw after ``torch.manual_seed``; the global RNG is
    left as it was."""
    import dataclasses

    from htfl_dist.algorithms import get_algorithm

    _, context = _context(num_classes=3, feature_dim=4, guide=guide)
    context = dataclasses.replace(context, seed=7, model_init="htfllib")
    width = 4 if guide == "feature" else 3
    torch.manual_seed(7)
    theirs = nn.Embedding(3, width).weight.detach().clone()
    before = torch.get_rng_state()
    server = get_algorithm("fedl2g").server(context)
    assert torch.equal(server.download()["guides"], theirs)
    assert torch.equal(torch.get_rng_state(), before)
    per_client = get_algorithm("fedl2g").server(dataclasses.replace(context, model_init="per_client"))
    assert not torch.equal(per_client.download()["guides"], theirs)
