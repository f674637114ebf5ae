"""The noise calibration and each client's privacy ledger.

Opacus does the accounting (why Opacus: its RDP and PRV accountants, and its per-sample clipping
and noise in ``DPOptimizer``, are maintained, audited and what DP-SGD results are usually
reported with; we write neither an accountant nor a clipping optimizer of our own).

Every mechanism a client runs is a Gaussian mechanism of the same noise multiplier σ with
sampling rate 1 (docs/privacy.md: no amplification by subsampling is claimed): one per local
epoch of DP-SGD and one per release of class rows. A run of R rounds with E local epochs is
therefore R·(E + 1) such mechanisms, and σ is the smallest multiplier (Opacus's binary search)
whose composition stays within the target ε at δ.
"""
from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from htfl_dist.errors import ConfigError
from htfl_dist.seeding import derive_seed

AccountantName = Literal["rdp", "prv"]
History = tuple[tuple[float, float, int], ...]
"""Opacus's accountant history: (noise multiplier, sampling rate, steps) entries."""


def epsilon_spent(history: History, delta: float, accountant: AccountantName) -> float:
    """ε at ``delta`` of the composition of ``history`` (0 for an empty one)."""
    if not history:
        return 0.0
    return _epsilon(tuple(history), float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(history: History, delta: float, accountant: AccountantName) -> float:
    from opacus.accountants import create_accountant  # the optional extra: imported where used

    counter = create_accountant(mechanism=accountant)
    counter.history = [tuple(entry) for entry in history]
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        # the PRV of a Gaussian without subsampling (rate 1) takes log(1 − q) = log 0 on its way;
        # RDP warns when its best order is the largest of its grid (few mechanisms, large ε): the
        # bound is then looser than it could be, never too small
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)
        return float(counter.get_epsilon(delta=delta))


def calibrate_noise(target_epsilon: float, delta: float, mechanisms: int, accountant: AccountantName) -> float:
    """σ such that ``mechanisms`` Gaussian mechanisms of multiplier σ (rate 1) compose to at most
    ``target_epsilon`` at ``delta`` (within Opacus's search tolerance of 0.01 below the target)."""
    try:
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:
        raise ConfigError("privacy.enabled needs Opacus: pip install -e .[privacy]") from None
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # as in _epsilon
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=1.0,
                                          steps=mechanisms, accountant=accountant))


@dataclass(frozen=True)
class PrivacyPlan:
    """The mechanisms' parameters, the same on every rank (computed from the config alone)."""

    noise_multiplier: float
    target_epsilon: float
    delta: float
    feature_clip: float
    max_grad_norm: float
    min_class_samples: int
    accountant: AccountantName
    local_epochs: int
    seed: int

    def round_cost(self, noise_multiplier: float) -> History:
        """What one round of a participant spends: E epochs of DP-SGD and one release."""
        return ((noise_multiplier, 1.0, self.local_epochs), (noise_multiplier, 1.0, 1))

    def describe(self) -> dict[str, Any]:
        """For summary.json: the calibrated multiplier and what it was calibrated for."""
        return {"noise_multiplier": self.noise_multiplier, "target_epsilon": self.target_epsilon,
                "delta": self.delta, "feature_clip": self.feature_clip, "max_grad_norm": self.max_grad_norm,
                "min_class_samples": self.min_class_samples, "accountant": self.accountant,
                "sgd_noise_std": 2.0 * self.noise_multiplier * self.max_grad_norm}


def merged(history: History, extra: History) -> History:
    """``history`` followed by ``extra``, consecutive entries of one (σ, rate) summed into one (as
    Opacus's RDP accountant keeps them), so equal spending has one spelling (and one cache key)."""
    entries = [list(entry) for entry in history]
    for sigma, rate, steps in extra:
        if entries and entries[-1][0] == sigma and entries[-1][1] == rate:
            entries[-1][2] += steps
        else:
            entries.append([sigma, rate, steps])
    return tuple((float(s), float(q), int(n)) for s, q, n in entries)


class PrivacyLedger(nn.Module):
    """One client's accountant and the state of its budget, kept in ``ClientState.modules``: the
    runtime checkpoints a client's modules (``state_dict``, here the extra state), parks them
    with it and restores them on resume, so a resumed run continues the client's ε exactly.

    The runtime calls ``begin_round`` before the client trains; the mechanisms (``dpsgd``,
    ``class_rows.class_means``) ask ``active`` and ``charge`` what they run. A client whose next
    round would take it past the target stops for good: it neither trains nor uploads again."""

    def __init__(self, plan: PrivacyPlan, client_id: int) -> None:
        super().__init__()
        self.plan, self.client_id = plan, client_id
        self.noise_multiplier = plan.noise_multiplier
        self.history: History = ()
        self.stopped_round = -1  # the 0-based round from which the client uploads nothing; -1: never
        self.round_index: int | None = None

    @property
    def active(self) -> bool:
        """Whether the client trains and releases in the current round."""
        return self.round_index is not None and self.stopped_round < 0

    def epsilon(self) -> float:
        return epsilon_spent(self.history, self.plan.delta, self.plan.accountant)

    def begin_round(self, round_index: int) -> None:
        """Start the client's round: stop it (one line on stderr) if the round would overspend."""
        self.round_index = round_index
        if self.stopped_round >= 0:
            return
        after = epsilon_spent(merged(self.history, self.plan.round_cost(self.noise_multiplier)),
                              self.plan.delta, self.plan.accountant)
        if after > self.plan.target_epsilon:
            self.stopped_round = round_index
            print(f"htfl_dist: privacy: client {self.client_id} has spent ε={self.epsilon():.3f} of "
                  f"privacy.target_epsilon={self.plan.target_epsilon:g} (round {round_index + 1} would take it to "
                  f"{after:.3f}); it neither trains nor uploads from round {round_index + 1} on",
                  file=sys.stderr, flush=True)

    def charge(self, mechanisms: int) -> None:
        """Record ``mechanisms`` Gaussian mechanisms of the ledger's multiplier; refuses (an
        error, never a silent overspend) one that takes the client past its target."""
        history = merged(self.history, ((self.noise_multiplier, 1.0, mechanisms),))
        spent = epsilon_spent(history, self.plan.delta, self.plan.accountant)
        if not self.active or spent > self.plan.target_epsilon:
            raise RuntimeError(f"client {self.client_id}: a release past its privacy budget "
                               f"(ε would be {spent:.3f} > {self.plan.target_epsilon:g}); the round's cost "
                               f"was not planned for by begin_round")
        self.history = history

    def generator(self, purpose: str, device: torch.device | str = "cpu") -> torch.Generator:
        """The noise stream of ``purpose`` for this client in the current round: keyed by
        (seed, purpose, client, round) only, so it does not depend on the rank that hosts it."""
        if self.round_index is None:
            raise RuntimeError(f"client {self.client_id}: a privacy mechanism ran outside a round")
        generator = torch.Generator(device=device)
        generator.manual_seed(derive_seed(self.plan.seed, "privacy", purpose, self.client_id, self.round_index))
        return generator

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"history": torch.tensor(self.history, dtype=torch.float64).reshape(-1, 3),
                "noise_multiplier": torch.tensor(self.noise_multiplier, dtype=torch.float64),
                "stopped_round": torch.tensor(self.stopped_round, dtype=torch.int64)}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.history = tuple((float(s), float(q), int(n)) for s, q, n in state["history"].tolist())
        self.noise_multiplier = float(state["noise_multiplier"])
        self.stopped_round = int(state["stopped_round"])
