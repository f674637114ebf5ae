"""What the runtime calls: the refusals at start-up, the plan, each client's ledger and private
trainer, and the ε reported in metrics.jsonl and summary.json."""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from htfl_dist.config import Config
from htfl_dist.errors import ConfigError
from htfl_dist.models import InputSpec, build_model, members_in_use
from htfl_dist.models.registry import input_need, split_architecture
from htfl_dist.privacy import LEDGER_KEY, WITHHELD_IN_PRIVATE_RUNS
from htfl_dist.privacy.accounting import PrivacyLedger, PrivacyPlan, calibrate_noise
from htfl_dist.privacy.distributed import check_clip_range, guaranteed_contributors
from htfl_dist.privacy.noise import require_cryptography

DURING_TRAINING = "during_training"
"""An option value (FedProto/FedTGP ``proto_from``, FedDistill ``logits_from``) that takes the
uploaded rows from the training batches: every epoch adds each sample again, under a model that
changes in between, which the release's sensitivity does not cover."""


SEEDED_NOISE_WARNING = ("htfl_dist: warning: privacy.noise=seeded: every noise draw is a function of the config's "
                        "seed, so whoever holds config.yaml (the server included) can regenerate and remove it; "
                        "this run is NOT private against the server (for reproducible experiments only)")

def privacy_plan(config: Config, run_dir: Path | None = None) -> PrivacyPlan | None:
    """The calibrated mechanisms of a run (None with ``privacy.enabled`` false): one σ for every
    mechanism, such that ``planned_rounds`` rounds of E DP-SGD epochs and one release spend at
    most ``target_epsilon``. ``run_dir``: where the clients record their releases, so that a
    resumed run re-sends a replayed round's (``release_log``); the runtime passes its ``--out``."""
    privacy = config.privacy
    if not privacy.enabled:
        return None
    rounds = privacy.planned_rounds or config.rounds
    epochs = config.train.local_epochs
    sigma = calibrate_noise(privacy.target_epsilon, privacy.delta, rounds * (epochs + 1), privacy.accountant)
    contributors = 1
    if privacy.noise_split == "distributed":
        contributors = guaranteed_contributors(config.num_clients, config.join_ratio, privacy.secagg_neighbours,
                                               privacy.secagg_threshold)
    plan = PrivacyPlan(noise_multiplier=sigma, target_epsilon=privacy.target_epsilon, delta=privacy.delta,
                       feature_clip=privacy.feature_clip, max_grad_norm=privacy.max_grad_norm,
                       min_class_samples=privacy.min_class_samples, accountant=privacy.accountant,
                       local_epochs=epochs, seed=config.seed, noise=privacy.noise,
                       run_directory=None if run_dir is None else str(run_dir), noise_split=privacy.noise_split,
                       contributors=contributors, planned_rounds=rounds)
    if privacy.noise_split == "distributed":
        multiplier, bound = plan.release_noise()
        check_clip_range(privacy.feature_clip, multiplier * (bound or 0.0), privacy.secagg_clip)
    return plan


def check_private_config(config: Config) -> None:
    """Every refusal of a private run that the config alone decides, each one line: what the
    secret noise needs installed, unseen clients, the algorithm and its options
    (:func:`check_private_run`), and a model group with a layer DP-SGD cannot pass. The start's
    ``check_start`` calls it on every rank (and ``--check`` in one process) before any data
    loads, so nothing is read or prepared for a run that cannot be private."""
    if config.privacy.noise_split == "distributed" and not config.privacy.secure_aggregation:
        raise ConfigError("privacy.noise_split=distributed needs privacy.secure_aggregation=true: without it the "
                          "server sees each client's release, which would carry only its share of the noise")
    if not config.privacy.enabled:
        if config.privacy.noise_split == "distributed":
            raise ConfigError("privacy.noise_split=distributed splits the noise of differential privacy, which is "
                              "off; set privacy.enabled=true (or leave noise_split at local)")
        return
    if config.privacy.noise == "secure":
        require_cryptography("privacy.noise=secure draws its noise", "ChaCha20")
    if config.eval.new_clients:
        raise ConfigError(f"privacy.enabled: eval.new_clients={config.eval.new_clients}: the unseen clients would "
                          f"train and report their accuracy without privacy (they hold no ledger); set "
                          f"eval.new_clients=0 in a private run (docs/privacy.md)")
    from htfl_dist.algorithms import AlgorithmContext, get_algorithm, parse_options

    entry = get_algorithm(config.algorithm)
    options = parse_options(entry, config.algo)
    if entry.private_release:  # (an algorithm registered without it is refused below, whatever it uploads)
        # which fields the algorithm uploads depends on its options, not on the data: a stand-in context
        context = AlgorithmContext(num_classes=2, feature_dim=config.model.feature_dim, seed=config.seed,
                                   train=config.train, options=options, num_clients=config.num_clients,
                                   model_group=config.model.group, model_init=config.model.init,
                                   model_options=config.model.options)
        uploads = [item.name for item in entry.client.upload_fields(context)]
    else:
        uploads = []
    check_private_run(config, entry, options, uploads)
    for member in members_in_use(config.model.group, config.num_clients):
        obstacle = batch_statistics_layer(_stand_in_model(member, config.model.feature_dim,
                                                                 config.model.options))
        if obstacle is not None:
            raise ConfigError(_batch_statistics_refusal(f"model group {config.model.group!r}: member {member}",
                                                        obstacle))


def _stand_in_model(member: str, feature_dim: int, options: Mapping[str, Any]) -> nn.Module:
    """``member`` built on the meta device (no memory, no weights drawn) for inputs of the kind it
    takes: which layers a model has does not depend on the data's sizes, which are not read yet."""
    need = input_need(split_architecture(member)[0])
    if need.kind == "text":
        inputs = InputSpec("text", (16,), vocab_size=64)
    elif need.kind == "tabular":
        inputs = InputSpec("tabular", (16,))
    elif need.channels is not None:  # sensor windows, C x 1 x W
        inputs = InputSpec("image", (need.channels, 1, 128))
    else:
        inputs = InputSpec.image(3, 32)
    with torch.device("meta"):
        return build_model(member, num_classes=2, feature_dim=feature_dim, inputs=inputs, options=options)


def _batch_statistics_refusal(whose: str, obstacle: str) -> str:
    return (f"privacy.enabled: {whose} has {obstacle}, through which DP-SGD has no per-sample gradient (Opacus's "
            f"ModuleValidator.fix would swap in GroupNorm, another architecture); use a model group without "
            f"BatchNorm, e.g. HtCNN8")


def check_private_run(config: Config, entry: Any, options: Any, upload_names: list[str]) -> None:
    """Refuse, with one line, a run whose uploads ``privacy.*`` cannot cover: an algorithm that
    uploads anything but class rows from ``class_rows.class_means`` (model parameters, a
    generator's images, gradients: registered without ``private_release``), rows taken during
    training, class counts on the wire, and batched client training."""
    if not config.privacy.enabled:
        return
    name = config.algorithm
    if not entry.private_release:
        raise ConfigError(f"privacy.enabled: algorithm {name!r} uploads what privacy.* does not noise (model "
                          f"parameters or rows not built as clipped class means); it covers the class-row "
                          f"algorithms: {', '.join(private_algorithms())}")
    if dataclasses.is_dataclass(options):
        for item in dataclasses.fields(options):
            if getattr(options, item.name) == DURING_TRAINING:
                raise ConfigError(f"privacy.enabled: algo.{item.name}={DURING_TRAINING} averages rows over the "
                                  f"training batches, which the release's sensitivity does not cover; "
                                  f"use algo.{item.name}=post_update")
    if "counts" in upload_names:
        raise ConfigError(f"privacy.enabled: {name} with these options uploads class counts, which the "
                          f"guarantee does not cover (docs/privacy.md); turn the weighted mean off")
    if config.train.client_batching != "off":
        raise ConfigError("privacy.enabled: train.client_batching=vmap has no DP-SGD path; "
                          "use train.client_batching=off")
    if config.train.compile != "off":
        raise ConfigError(f"privacy.enabled: train.compile={config.train.compile} has no DP-SGD path (Opacus "
                          f"steps the eager model); use train.compile=off")


def private_algorithms() -> list[str]:
    from htfl_dist.algorithms.registry import algorithm_names, get_algorithm

    return [name for name in algorithm_names() if get_algorithm(name).private_release]


def batch_statistics_layer(model: nn.Module) -> str | None:
    """A layer whose training output depends on the whole batch (BatchNorm, or a norm keeping
    running statistics): per-sample gradients, and so DP-SGD, are undefined through it."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and (
                isinstance(module, nn.modules.batchnorm._BatchNorm) or module.track_running_stats):
            return f"a {type(module).__name__} layer ({name})"
    return None


def attach_ledger(client: Any, plan: PrivacyPlan) -> None:
    """Give a freshly built client its ledger (before any checkpoint is restored into it) and the
    private trainer that spends it (``client.private``): the algorithms' helpers train and release
    through that, so a client is private exactly when it has been given a ledger."""
    obstacle = batch_statistics_layer(client.model)
    if obstacle is not None:
        raise ConfigError(_batch_statistics_refusal(f"client {client.client_id}'s model {client.architecture}",
                                                    obstacle))
    from htfl_dist.privacy.trainer import PrivateTrainer  # imports Opacus, which only a private run needs

    ledger = PrivacyLedger(plan, client.client_id)
    client.modules[LEDGER_KEY] = ledger
    client.private = PrivateTrainer(ledger)


def begin_round(clients: list[Any], round_index: int) -> None:
    """Before the clients train in round ``round_index``: each ledger decides whether its client
    can afford the round."""
    for client in clients:
        ledger = client.modules.get(LEDGER_KEY)
        if ledger is not None:
            ledger.begin_round(round_index)


def client_epsilon(client: Any) -> float | None:
    """The ε a client has spent so far (None without privacy)."""
    ledger = client.modules.get(LEDGER_KEY)
    return None if ledger is None else ledger.epsilon()


def epsilon_columns(epsilons: list[float]) -> dict[str, float]:
    """The metrics row's ε columns over the reported clients: the largest and the median."""
    if not epsilons:
        return {}
    return {"epsilon_max": max(epsilons), "epsilon_median": float(statistics.median(epsilons))}


def privacy_summary(rows: list[dict[str, Any]], plan: PrivacyPlan | None) -> dict[str, Any]:
    """summary.json's privacy block: the mechanisms' parameters and the last reported ε."""
    if plan is None:
        return {}
    last: dict[str, Any] = next((row for row in reversed(rows) if "epsilon_max" in row), {})
    return {"privacy": {**plan.describe(), "epsilon_max": last.get("epsilon_max"),
                        "epsilon_median": last.get("epsilon_median"), "withheld": dict(WITHHELD_IN_PRIVATE_RUNS)}}
