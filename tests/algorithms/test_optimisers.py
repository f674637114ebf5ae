"""Client optimisers and learning-rate schedules (``train.optimizer``, ``train.lr_schedule``, ...):
the rates of each schedule by hand and against torch's schedulers stepped as HtFLlib/PFLlib step
theirs, the optimizers the runtime builds, the refusals, the config identity, and whole runs:
parked = resident, resumed = uninterrupted, 3 ranks = 1 process."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from helpers import make_client, make_context

from conftest import SMOKE, launch, maths_only, read_metrics, run_program, run_smoke
from htfl_dist.algorithms import optimizers
from htfl_dist.algorithms.optimizers import (
    begin_local_training,
    build_optimizer,
    companion_optimizer,
    round_learning_rate,
)
from htfl_dist.algorithms.training import batch_cross_entropy, run_local_training
from htfl_dist.config import TrainConfig, load_config
from htfl_dist.errors import ConfigError, HtflError
from htfl_dist.seeding import seed_global_torch, torch_generator

CPU = torch.device("cpu")


def _rates(train: TrainConfig, rounds: int) -> list[float]:
    return [round_learning_rate(train, r, rounds) for r in range(rounds)]


# --------------------------------------------------------------------------- the rates


def test_constant_is_the_configured_rate_every_round():
    assert _rates(TrainConfig(lr=0.1), 5) == [0.1] * 5


def test_exponential_by_hand():
    """lr·γ^r: 0.1, 0.05, 0.025, 0.0125 (halving is exact in binary)."""
    assert _rates(TrainConfig(lr=0.1, lr_schedule="exponential", lr_decay=0.5), 4) == [0.1, 0.05, 0.025, 0.0125]
    assert _rates(TrainConfig(lr=0.01, lr_schedule="exponential", lr_decay=0.9), 3) == pytest.approx(
        [0.01, 0.009, 0.0081], rel=1e-15)


def test_step_by_hand():
    """lr·γ^⌊r/3⌋ with γ = 0.1: three rounds at 0.1, three at 0.01, then 0.001."""
    train = TrainConfig(lr=0.1, lr_schedule="step", lr_decay=0.1, lr_step_rounds=3)
    assert _rates(train, 7) == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.001], rel=1e-15)


def test_cosine_by_hand():
    """rounds = 4: cos(0), cos(π/4), cos(π/2), cos(3π/4) → (1 + c)/2 = 1, 0.853553.., 0.5, 0.146446..
    of the span above lr_min."""
    half = 0.5 ** 0.5 / 2  # cos(π/4)/2
    assert _rates(TrainConfig(lr=0.1, lr_schedule="cosine"), 4) == pytest.approx(
        [0.1, 0.1 * (0.5 + half), 0.05, 0.1 * (0.5 - half)], rel=1e-14)
    assert _rates(TrainConfig(lr=0.1, lr_schedule="cosine", lr_min=0.02), 4) == pytest.approx(
        [0.1, 0.02 + 0.08 * (0.5 + half), 0.06, 0.02 + 0.08 * (0.5 - half)], rel=1e-14)


def _stepped(make_scheduler, lr: float, rounds: int) -> list[float]:
    """The rate each round trains at when the client's scheduler steps once at the end of its
    local training, as PFLlib's clients (and HtFLlib's before 50ae2f4) do under ``-ld True``."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = make_scheduler(optimizer)
    rates = []
    for _ in range(rounds):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # the round's local training
        scheduler.step()
    return rates


@pytest.mark.parametrize("gamma", [0.9, 0.99, 0.95])
def test_exponential_is_the_references_ld_ldg_float_for_float(gamma):
    """``-ld True -ldg γ``: ExponentialLR(γ) stepped after every round; the same floats, all 200 rounds."""
    expected = _stepped(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=gamma), 0.01, 200)
    assert _rates(TrainConfig(lr=0.01, lr_schedule="exponential", lr_decay=gamma), 200) == expected


def test_step_and_cosine_are_torchs_schedulers():
    step = _stepped(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.3), 0.05, 50)
    assert _rates(TrainConfig(lr=0.05, lr_schedule="step", lr_decay=0.3, lr_step_rounds=7), 50) == step
    cosine = _stepped(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50, eta_min=0.001), 0.05, 50)
    assert _rates(TrainConfig(lr=0.05, lr_schedule="cosine", lr_min=0.001), 50) == pytest.approx(cosine, rel=1e-12)


def test_the_rate_of_a_round_does_not_depend_on_earlier_calls():
    train = TrainConfig(lr=0.1, lr_schedule="exponential", lr_decay=0.9)
    late = round_learning_rate(train, 17, 20)
    _rates(train, 20)
    assert round_learning_rate(train, 17, 20) == late == _rates(train, 20)[17]


# --------------------------------------------------------------------------- the optimizers


def _parameters():
    return [torch.nn.Parameter(torch.ones(2, 2))]


def test_the_default_builds_what_the_runtime_built_before():
    """At the defaults the builder's SGD is ``torch.optim.SGD(params, lr)``, state dict included,
    so checkpoints written before the option existed load into it unchanged."""
    params = _parameters()
    built = build_optimizer(params, TrainConfig(lr=0.03))
    assert type(built) is torch.optim.SGD
    assert built.state_dict() == torch.optim.SGD(params, lr=0.03).state_dict()


@pytest.mark.parametrize(("train", "kind", "expected"), [
    (TrainConfig(lr=0.02, momentum=0.9, weight_decay=5e-4), torch.optim.SGD,
     {"lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4, "dampening": 0, "nesterov": False}),
    (TrainConfig(lr=1e-3, optimizer="adam", weight_decay=1e-4), torch.optim.Adam,
     {"lr": 1e-3, "weight_decay": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8}),
    (TrainConfig(lr=1e-3, optimizer="adamw", weight_decay=0.05), torch.optim.AdamW,
     {"lr": 1e-3, "weight_decay": 0.05, "betas": (0.9, 0.999)}),
])
def test_each_optimizer_is_built_with_its_options(train, kind, expected):
    built = build_optimizer(_parameters(), train)
    assert type(built) is kind
    group = built.param_groups[0]
    assert {key: group[key] for key in expected} == expected


def test_momentum_is_used_in_the_clients_steps_by_hand():
    """Two SGD steps on L = Σ p (gradient 1 everywhere) with momentum 0.9 and lr 0.1: the buffer is
    1, then 0.9·1 + 1 = 1.9, so p = 1 − 0.1 − 0.19 = 0.71 (0.8 without momentum)."""
    for momentum, expected in ((0.9, 0.71), (0.0, 0.8)):
        params = _parameters()
        optimizer = build_optimizer(params, TrainConfig(lr=0.1, momentum=momentum))
        for _ in range(2):
            optimizer.zero_grad()
            params[0].sum().backward()
            optimizer.step()
        assert params[0].detach() == pytest.approx(torch.full((2, 2), expected), abs=1e-7)


def test_adamw_decays_decoupled_and_adam_in_the_gradient_by_hand():
    """One step from p = 1 with gradient g = 1: Adam's first step is lr·sign(g) (m̂/√v̂ = 1), so
    Adam with wd 0.5 sees g + wd·p = 1.5 and still steps lr: p = 1 − 0.1 = 0.9; AdamW first
    shrinks p by lr·wd (p·(1 − 0.05)) and then steps lr: 0.95 − 0.1 = 0.85."""
    for optimizer_name, expected in (("adam", 0.9), ("adamw", 0.85)):
        params = _parameters()
        optimizer = build_optimizer(params, TrainConfig(lr=0.1, optimizer=optimizer_name, weight_decay=0.5))
        params[0].sum().backward()
        optimizer.step()
        assert params[0].detach() == pytest.approx(torch.full((2, 2), expected), abs=1e-6)


def _client(train: TrainConfig, algorithm="local"):
    entry, context = make_context(algorithm, num_classes=3, feature_dim=8, batch_size=4)
    context = dataclasses.replace(context, train=train)
    client = make_client(context, samples=9)
    client.optimizer = build_optimizer(client.model.parameters(), train)
    return entry, context, client


@pytest.mark.parametrize(("train", "state_key"), [
    (TrainConfig(batch_size=4, lr=0.05, momentum=0.9), "momentum_buffer"),
    (TrainConfig(batch_size=4, lr=1e-3, optimizer="adam"), "exp_avg"),
    (TrainConfig(batch_size=4, lr=1e-3, optimizer="adamw", weight_decay=0.01), "exp_avg_sq"),
])
def test_local_training_steps_the_clients_optimizer_and_keeps_its_state(train, state_key):
    _, context, client = _client(train)
    begin_local_training([client], train, 0, 10)
    run_local_training(client, context, batch_cross_entropy, torch_generator(0, "batches", 0, 0))
    state = client.optimizer.state_dict()["state"]
    assert len(state) == len(list(client.model.parameters()))
    assert all(state_key in entry for entry in state.values())


def test_the_runtime_builds_every_clients_optimizer_from_the_config(tmp_path, cache_dir):
    from htfl_dist.runtime.session import RunContext, Session
    from htfl_dist.runtime.transport import LocalTransport

    config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", "train.optimizer=adamw", "train.weight_decay=0.02",
                                 "train.lr=0.003"])
    session = Session(RunContext(config, LocalTransport(), CPU, tmp_path))
    for client_id in range(config.num_clients):
        client = session.clients.peek(client_id)
        assert type(client.optimizer) is torch.optim.AdamW
        assert [(g["lr"], g["weight_decay"]) for g in client.optimizer.param_groups] == [(0.003, 0.02)]
        assert [id(p) for p in client.optimizer.param_groups[0]["params"]] == [
            id(p) for p in client.model.parameters()]
    session.clients.close()


def test_the_round_loop_sets_the_rounds_rate_over_whatever_was_restored():
    train = TrainConfig(batch_size=4, lr=0.1, lr_schedule="exponential", lr_decay=0.5)
    _, _, client = _client(train)
    client.optimizer.param_groups[0]["lr"] = 123.0  # a checkpoint's or a parked record's last rate
    begin_local_training([client], train, 3, 10)
    assert [group["lr"] for group in client.optimizer.param_groups] == [0.0125]


def test_a_schedule_without_the_rounds_rate_refuses_to_train():
    """The guard against a round loop that never sets the rate: training at train.lr would be a
    silent constant schedule."""
    train = TrainConfig(batch_size=4, lr=0.1, lr_schedule="cosine")
    _, context, client = _client(train)
    with pytest.raises(HtflError, match="was not given this round's learning rate"):
        run_local_training(client, context, batch_cross_entropy, torch_generator(0, "batches", 0, 0))


@pytest.mark.parametrize(("algorithm", "options", "companions"), [
    ("fml", {}, 1),  # G
    ("fedmrl", {"rep_dim": 8}, 2),  # G and the projector
    ("fedkd", {}, 1),  # W_h (the mentee keeps plain SGD at mentee_lr)
])
def test_modules_trained_beside_the_model_get_the_clients_optimizer_at_the_rounds_rate(
        algorithm, options, companions, monkeypatch):
    train = TrainConfig(batch_size=4, lr=0.02, optimizer="adam", lr_schedule="exponential", lr_decay=0.5)
    entry, context = make_context(algorithm, num_classes=3, feature_dim=16, batch_size=4, **options)
    context = dataclasses.replace(context, train=train)
    algorithm_client = entry.client(context)
    client = make_client(context, samples=9)
    client.optimizer = build_optimizer(client.model.parameters(), train)
    seed_global_torch(0, "algorithm-init", 0)
    algorithm_client.init_client(client)
    knowledge = {name: tensor.clone() for name, tensor in entry.server(context).download().items()}
    built = []

    def spy(parameters, train_config, lr=None):
        optimizer = build_optimizer(parameters, train_config, lr)
        built.append(optimizer)
        return optimizer

    monkeypatch.setattr(optimizers, "build_optimizer", spy)
    begin_local_training([client], train, 2, 10)
    seed_global_torch(0, "train", 0, 2)
    algorithm_client.train(client, knowledge, 2, torch_generator(0, "batches", 0, 2))
    assert len(built) == companions
    assert all(type(o) is torch.optim.Adam and o.param_groups[0]["lr"] == 0.005 for o in built)
    assert all(o.state for o in built)  # they stepped
    assert type(companion_optimizer(client, _parameters(), train)) is torch.optim.Adam


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(("overrides", "needle"), [
    (["train.optimizer=adam", "train.momentum=0.9"], "'train.momentum' applies to train.optimizer=sgd"),
    (["train.lr_decay=0.9"], "'train.lr_decay' applies to train.lr_schedule=exponential or step, not constant"),
    (["train.lr_schedule=cosine", "train.lr_decay=0.9"], "'train.lr_decay' applies"),
    (["train.lr_schedule=exponential", "train.lr_min=0.001"], "'train.lr_min' applies to train.lr_schedule=cosine"),
    (["train.lr_schedule=exponential", "train.lr_step_rounds=5"], "'train.lr_step_rounds' applies"),
    (["train.lr_schedule=step"], "train.lr_schedule=step needs train.lr_step_rounds"),
    (["train.lr_schedule=cosine", "train.lr_min=0.01"], "'train.lr_min' must be below train.lr"),
    (["train.client_batching=vmap", "train.momentum=0.5"], "train.client_batching=vmap steps plain SGD"),
    (["train.client_batching=vmap", "train.optimizer=adamw"], "train.client_batching=vmap steps plain SGD"),
    (["train.momentum=1"], "'train.momentum' must be in [0, 1)"),
    (["train.lr_decay=0"], "'train.lr_decay' must be in (0, 1]"),
    (["train.optimizer=rmsprop"], "train.optimizer"),
])
def test_options_a_schedule_or_optimizer_does_not_read_are_refused_in_one_line(overrides, needle):
    with pytest.raises(ConfigError, match=None) as caught:
        load_config(SMOKE, overrides)
    assert needle in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_accepted_combinations_load():
    for overrides in (["train.lr_schedule=exponential", "train.lr_decay=0.9"],
                      ["train.lr_schedule=step", "train.lr_step_rounds=10", "train.lr_decay=0.1"],
                      ["train.lr_schedule=cosine", "train.lr_min=0.001", "train.momentum=0.9"],
                      ["train.optimizer=adamw", "train.weight_decay=0.01"],
                      ["train.client_batching=vmap", "train.lr_schedule=exponential"]):
        load_config(SMOKE, overrides)


def test_defaults_keep_the_hash_and_each_option_changes_it():
    base = load_config(SMOKE).config_hash()
    assert load_config(SMOKE, ["train.optimizer=sgd", "train.momentum=0", "train.weight_decay=0",
                               "train.lr_schedule=constant", "train.lr_decay=0.99", "train.lr_step_rounds=0",
                               "train.lr_min=0"]).config_hash() == base
    changed = [["train.optimizer=adam"], ["train.momentum=0.9"], ["train.weight_decay=0.001"],
               ["train.lr_schedule=exponential"], ["train.lr_schedule=exponential", "train.lr_decay=0.9"],
               ["train.lr_schedule=step", "train.lr_step_rounds=2"], ["train.lr_schedule=cosine"],
               ["train.lr_schedule=cosine", "train.lr_min=0.001"]]
    hashes = {load_config(SMOKE, overrides).config_hash() for overrides in changed}
    assert base not in hashes and len(hashes) == len(changed)


def test_cosine_makes_the_run_length_part_of_the_experiment():
    """Its rates depend on ``rounds``: a cosine run cannot be extended on resume; the others can."""
    def hashes(*extra):
        return {load_config(SMOKE, [f"rounds={rounds}", *extra]).config_hash() for rounds in (3, 4)}

    assert len(hashes("train.lr_schedule=cosine")) == 2
    assert len(hashes("train.lr_schedule=exponential")) == 1
    assert len(hashes()) == 1


# --------------------------------------------------------------------------- whole runs

MOMENTUM_COSINE = ("train.momentum=0.9", "train.lr_schedule=cosine", "train.lr_min=0.001", "train.lr=0.02")


@pytest.mark.integration
def test_momentum_cosine_parked_equals_resident_and_the_schedule_is_applied(tmp_path, cache_dir):
    """8 clients, half of them per round, at most 2 resident: parked clients come back with their
    momentum buffers, so the metrics are those of an all-resident run; a constant rate (or no
    momentum) gives other numbers, so both are in use."""
    common = ("num_clients=8", "join_ratio=0.5", "rounds=3")
    expected = run_smoke("single", 1, tmp_path / "resident", cache_dir, *common, *MOMENTUM_COSINE)
    parked = run_smoke("single", 1, tmp_path / "parked", cache_dir, *common, *MOMENTUM_COSINE,
                       "runtime.resident_clients=2", f"runtime.client_scratch_dir={tmp_path / 'scratch'}")
    assert maths_only(parked) == maths_only(expected)
    constant = run_smoke("single", 1, tmp_path / "constant", cache_dir, *common, "train.momentum=0.9", "train.lr=0.02")
    plain = run_smoke("single", 1, tmp_path / "plain", cache_dir, *common, *MOMENTUM_COSINE[1:])
    losses = [[row["train_loss"] for row in rows] for rows in (expected, constant, plain)]
    assert losses[1][0] == losses[0][0]  # round 0 trains at lr either way
    assert losses[1][1:] != losses[0][1:]
    assert losses[2][1:] != losses[0][1:]


@pytest.mark.integration
def test_a_momentum_run_resumed_from_a_checkpoint_is_the_uninterrupted_run(tmp_path, cache_dir):
    """Round 2's checkpoint resumed into a new run directory gives round 3 bit for bit: the
    optimizer state (momentum buffers, Adam's moments) is in the checkpoint."""
    for name, extra in (("momentum", MOMENTUM_COSINE), ("adam", ("train.optimizer=adam", "train.lr=0.001"))):
        whole = tmp_path / f"{name}-whole"
        args = ["--config", str(SMOKE), f"data.cache_dir={cache_dir}", "checkpoint_every=1", "checkpoint_keep=3",
                *extra]
        result = run_program(["--out", str(whole), *args])
        assert result.returncode == 0, result.stderr
        resumed = tmp_path / f"{name}-resumed"
        result = run_program(["--out", str(resumed), *args, "--resume",
                              str(whole / "checkpoints" / "round_00002")])
        assert result.returncode == 0, result.stderr
        assert maths_only(read_metrics(resumed)) == maths_only(read_metrics(whole)), name
        shutil.rmtree(whole)


@pytest.mark.launch
def test_momentum_cosine_on_three_ranks_equals_one_process(tmp_path, cache_dir):
    common = ("num_clients=8", "join_ratio=0.5", "rounds=3", *MOMENTUM_COSINE)
    expected = run_smoke("single", 1, tmp_path / "single", cache_dir, *common)
    result = launch("torchrun", 3, ["--config", str(SMOKE), "--out", str(tmp_path / "ranks"),
                                    f"data.cache_dir={cache_dir}", *common])
    assert result.returncode == 0, result.stdout + result.stderr
    assert maths_only(read_metrics(tmp_path / "ranks")) == maths_only(expected)
