"""Client optimisers and their learning-rate schedules: the one place a client's optimizer is built.

``build_optimizer`` makes what ``train.optimizer``, ``train.momentum`` and ``train.weight_decay``
name (the runtime's client factory builds every client's own optimizer with it, once, and the
client keeps it across rounds: its state is in the client's checkpoint record and parks with
it). ``round_learning_rate`` is the client learning rate of a round, a function of the config and
the round alone, so neither a resume nor the world size can change it: nothing is read from
scheduler objects. ``begin_local_training`` sets it on every participant's optimizer before the
participants train (the round loop calls it), and ``companion_optimizer`` builds the optimizer of
another module a client trains beside its model in a round at that rate.

Which optimizers come from here, and which stay the algorithm's own:

- every client's model (``ClientState.optimizer``), for every algorithm;
- the modules trained with the client's learning rate beside it, as HtFLlib builds them with
  the client's optimizer and ``learning_rate``: FML's shared model G, FedMRL's small model and
  projector, FedKTL's auxiliary projection, FedKD's W_h (unless ``algo.wh_lr`` gives it its own
  rate). These are built afresh each round (as the reference does), so their momentum or Adam
  moments start from zero every round;
- left to the algorithm: FedKD's mentee (``algo.mentee_lr``: plain SGD at its own rate, as
  HtFLlib's ``mentee_learning_rate``), the servers' optimizers (FedTGP, FedGH, FedGen, FedKTL,
  with their ``algo.server_lr``), FedL2G's look-ahead step θ − lr·∇ (plain SGD at ``train.lr``,
  part of its hypergradient) and the step time measured for placement.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from htfl_dist.algorithms.interface import ClientState
from htfl_dist.config import TrainConfig
from htfl_dist.errors import HtflError

ROUND_ATTRIBUTE = "htfl_round"
"""Set on a client's optimizer by ``begin_local_training``: the round whose rate it holds."""


def build_optimizer(parameters: Iterable[torch.nn.Parameter], train: TrainConfig,
                    lr: float | None = None) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``parameters`` with ``train``'s momentum and weight decay, at ``lr``
    (default ``train.lr``). At the defaults this is ``torch.optim.SGD(parameters, lr=lr)``, state
    dict included."""
    rate = train.lr if lr is None else lr
    if train.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=rate, momentum=train.momentum, weight_decay=train.weight_decay)
    if train.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=rate, weight_decay=train.weight_decay)
    if train.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=rate, weight_decay=train.weight_decay)
    raise ValueError(f"unknown train.optimizer {train.optimizer!r}")  # the schema's Literal refuses it first


def round_learning_rate(train: TrainConfig, round_index: int, rounds: int) -> float:
    """The client learning rate of round ``round_index`` (0-based) of a ``rounds``-round run.

    constant: ``lr``. exponential: ``lr``·γ^r, multiplied out one round at a time as torch's
    ``ExponentialLR`` does when stepped once per round (HtFLlib's and PFLlib's ``-ld``: the
    scheduler steps after each local training, so round r trains at lr·γ^r when every client
    takes part), so the rates are those floats exactly. step: ``lr``·γ^⌊r / lr_step_rounds⌋, as
    ``StepLR``. cosine: ``lr_min`` + (``lr`` − ``lr_min``)·(1 + cos(π·r / rounds))/2, the closed
    form of ``CosineAnnealingLR(T_max=rounds, eta_min=lr_min)`` (equal to it within rounding)."""
    if round_index < 0:
        raise ValueError(f"round index {round_index} < 0")
    schedule, lr = train.lr_schedule, train.lr
    if schedule == "constant":
        return lr
    if schedule == "exponential":
        return _decayed(lr, train.lr_decay, round_index)
    if schedule == "step":
        return _decayed(lr, train.lr_decay, round_index // train.lr_step_rounds)
    if schedule == "cosine":  # written so that round 0 is lr and round `rounds` lr_min, exactly
        cosine = math.cos(math.pi * round_index / rounds)
        return lr * (1 + cosine) / 2 + train.lr_min * (1 - cosine) / 2
    raise ValueError(f"unknown train.lr_schedule {schedule!r}")  # the schema's Literal refuses it first


def _decayed(lr: float, gamma: float, steps: int) -> float:
    for _ in range(steps):  # one product per step, as the stepped scheduler forms it
        lr *= gamma
    return lr


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """``lr`` on every parameter group of ``optimizer``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def begin_local_training(clients: Sequence[ClientState], train: TrainConfig, round_index: int, rounds: int) -> None:
    """Before ``clients`` train in round ``round_index``: each client's optimizer gets the round's
    learning rate (whatever rate a checkpoint or a parked record left in it)."""
    lr = round_learning_rate(train, round_index, rounds)
    for client in clients:
        set_learning_rate(client.optimizer, lr)
        setattr(client.optimizer, ROUND_ATTRIBUTE, round_index)


def check_round_learning_rate(client: ClientState, train: TrainConfig) -> None:
    """Under a learning-rate schedule, refuse to train a client whose optimizer was never given a
    round's rate (``begin_local_training`` not called), rather than train at ``train.lr``."""
    if train.lr_schedule != "constant" and getattr(client.optimizer, ROUND_ATTRIBUTE, None) is None:
        raise HtflError(f"train.lr_schedule={train.lr_schedule}: client {client.client_id}'s optimizer was not "
                        f"given this round's learning rate (the round loop calls "
                        f"algorithms.optimizers.begin_local_training before clients train)")


def current_learning_rate(client: ClientState) -> float:
    """The rate the client's own optimizer trains at now (this round's, once the round began)."""
    return float(client.optimizer.param_groups[0]["lr"])


def companion_optimizer(client: ClientState, parameters: Iterable[torch.nn.Parameter],
                        train: TrainConfig) -> torch.optim.Optimizer:
    """A fresh optimizer for a module ``client`` trains beside its model this round, built as the
    client's own (``train.optimizer``, momentum, weight decay) at the client's current rate."""
    return build_optimizer(parameters, train, lr=current_learning_rate(client))
