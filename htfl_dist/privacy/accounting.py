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

from htfl_dist.errors import ConfigError, PrivacyPlanError
from htfl_dist.privacy.distributed import client_noise_multiplier, sensitivity_bound
from htfl_dist.privacy.noise import NoiseMode, NoiseSource, noise_source
from htfl_dist.privacy.release_log import Recorded, ReleaseLog

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
    ``target_epsilon`` at ``delta`` (within Opacus's search tolerance of 0.01 below the target).
    A target no σ reaches (an accountant's ε has a floor at δ however large the noise) is one line
    naming the smallest reachable ε."""
    try:
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:
        raise ConfigError("privacy.enabled needs Opacus: pip install -e .[privacy]") from None
    floor = epsilon_spent(((largest_searched_sigma(), 1.0, mechanisms),), delta, accountant)
    unreachable = ConfigError(
        f"privacy.target_epsilon={target_epsilon:g} cannot be reached: {mechanisms} Gaussian mechanisms at "
        f"privacy.delta={delta:g} spend at least ε={floor:.4g} with the {accountant} accountant however much noise "
        f"is added; the smallest reachable ε for this run's plan is {floor:.4g} (raise privacy.target_epsilon above "
        f"it, or raise privacy.delta{', or use privacy.accountant=prv' if accountant == 'rdp' else ''})")
    if target_epsilon < floor:
        raise unreachable
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # as in _epsilon
        warnings.simplefilter("ignore", UserWarning)
        try:
            return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=1.0,
                                              steps=mechanisms, accountant=accountant))
        except ValueError:  # "The privacy budget is too low": the floor above should have said it first
            raise unreachable from None


SEARCH_START_SIGMA = 10.0
"""Opacus's ``get_noise_multiplier`` doubles σ from here (20, 40, ...) until the target is met,
and gives up once σ passes its ``MAX_SIGMA``."""


def largest_searched_sigma() -> float:
    """The largest σ Opacus's search tries and returns: the last doubling of
    :data:`SEARCH_START_SIGMA` not beyond ``MAX_SIGMA`` (655,360 for its 1e6). The search tries
    the next doubling too, but refuses it whatever ε it gives, so the reachable floor is the ε
    at this σ, a little above the ε at ``MAX_SIGMA`` itself: a target between the two was let
    through and then ended in Opacus's ValueError."""
    from opacus.accountants.utils import MAX_SIGMA

    sigma = 2 * SEARCH_START_SIGMA
    while 2 * sigma <= MAX_SIGMA:
        sigma *= 2
    return float(sigma)


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
    noise: NoiseMode = "secure"
    run_directory: str | None = None
    """Where each client's release file goes (``release_log``): the run directory; None (a plan
    built outside a run, as the unit tests do) keeps no record, so a replayed round is not
    recognised."""
    noise_split: Literal["local", "distributed"] = "local"
    """``privacy.noise_split``: local, each release carries the full noise; distributed (under
    secure aggregation), each carries its share σ/√t of the multiplier at the public sensitivity
    bound, and only sums of at least ``contributors`` releases leave the protocol (distributed.py)."""
    contributors: int = 1
    """t: the fewest contributions in any released sum (1: local, the release itself)."""
    planned_rounds: int = 0
    """Rounds σ was calibrated for (for summary.json's ε against a coalition; 0: not given)."""

    def mechanisms_per_round(self) -> dict[str, int]:
        """The plan of one round of a participant: each mechanism it may run once, and how many
        Gaussian mechanisms that is (DP-SGD: one per local epoch; the release of class rows: one)."""
        return {"sgd": self.local_epochs, "release": 1}

    def round_cost(self, noise_multiplier: float) -> History:
        """What one round of a participant spends: E epochs of DP-SGD and one release."""
        return tuple((noise_multiplier, 1.0, count) for count in self.mechanisms_per_round().values())

    def release_noise(self, noise_multiplier: float | None = None) -> tuple[float, float | None]:
        """The release's noise at σ (``noise_multiplier``, the ledger's kept one; default the
        plan's): (multiplier, sensitivity). Local: σ and None (each class row's own 2·S/n_c,
        release.py); distributed: σ/√t and the bound B = 2·S/m shared by every client."""
        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if self.noise_split == "local":
            return sigma, None
        return client_noise_multiplier(sigma, self.contributors), sensitivity_bound(self.feature_clip,
                                                                                   self.min_class_samples)

    def filler_std(self) -> float:
        """The std of the noise each contribution's unreleased class rows get under the
        distributed split (``distributed.fill_unreleased``): a release's own, σ/√t · B; 0 when local."""
        multiplier, bound = self.release_noise()
        return 0.0 if bound is None else multiplier * bound

    def guarantees(self) -> dict[str, Any]:
        """Which guarantee holds against whom (docs/privacy.md, "Distributed DP"), for summary.json.
        The ledger charges σ for every release: under the distributed split that ε holds against
        the server and anyone who sees only released sums (each of ≥ t contributions). A coalition
        of the server with other clients subtracts their noise: with h honest contributors left in
        a sum the release's multiplier is σ·√(h/t), at worst σ/√t (h = 1: the server with every
        other contributor, or a class only one contributor holds). That worst case's ε over the
        plan (DP-SGD stays local at σ) is given when the plan's rounds are known."""
        if self.noise_split == "local":
            return {"against_everyone": "epsilon_max: each release carries the full noise (local DP)"}
        multiplier, bound = self.release_noise()
        worst: dict[str, Any] = {}
        if self.planned_rounds:
            history = merged(((self.noise_multiplier, 1.0, self.planned_rounds * self.local_epochs),),
                             ((multiplier, 1.0, self.planned_rounds),))
            worst = {"epsilon_against_server_with_all_other_contributors_at_most":
                     epsilon_spent(history, self.delta, self.accountant)}
        return {"against_server": "epsilon_max: every released sum has at least t contributions, whose noise "
                                  "together has std >= sigma * B (central DP)",
                "against_server_with_colluding_clients": "the honest contributors' noise only: sigma * "
                                                         "sqrt(h / t) with h honest contributors in a sum, at "
                                                         "worst sigma / sqrt(t)",
                "contributors_at_least": self.contributors, "sensitivity_bound": bound,
                "client_noise_multiplier": multiplier, "client_noise_std": multiplier * (bound or 0.0),
                "sum_noise_std_at_least": self.noise_multiplier * (bound or 0.0), **worst}

    def describe(self) -> dict[str, Any]:
        """For summary.json: the calibrated multiplier and what it was calibrated for."""
        return {"noise_split": self.noise_split, "guarantees": self.guarantees(),
                "noise_multiplier": self.noise_multiplier, "target_epsilon": self.target_epsilon,
                "delta": self.delta, "feature_clip": self.feature_clip, "max_grad_norm": self.max_grad_norm,
                "min_class_samples": self.min_class_samples, "accountant": self.accountant,
                "sgd_noise_std": 2.0 * self.noise_multiplier * self.max_grad_norm, "noise": self.noise,
                "private_against_server": self.noise == "secure"}


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


MECHANISM_NAMES = {"sgd": "DP-SGD local training", "release": "release of class rows"}
"""What each planned mechanism is, for the lines that name one."""


class PrivacyLedger(nn.Module):
    """One client's accountant and the state of its budget, kept in ``ClientState.modules``: the
    runtime checkpoints a client's modules (``state_dict``, here the extra state), parks them
    with it and restores them on resume, so a resumed run continues the client's ε exactly.

    The runtime calls ``begin_round`` before the client trains; the mechanisms (``dpsgd``, the
    release in ``trainer.PrivateTrainer``) ask ``active``, then ``open_mechanism`` for what they run, which
    checks it against the plan and hands out its noise. A client whose next round would take it
    past the target stops for good: it neither trains nor uploads again."""

    def __init__(self, plan: PrivacyPlan, client_id: int) -> None:
        super().__init__()
        self.plan, self.client_id = plan, client_id
        self.noise_multiplier = plan.noise_multiplier
        self.history: History = ()
        self.stopped_round = -1  # the 0-based round from which the client uploads nothing; -1: never
        self.round_index: int | None = None
        self.opened_in = dict.fromkeys(MECHANISM_NAMES, -1)
        """Mechanism → the 0-based round it last ran in (-1: never). Part of the checkpointed
        state, so a client parked and restored within a round cannot run a mechanism twice."""
        self.log = ReleaseLog(plan.run_directory, client_id) if plan.run_directory is not None else None
        self.replay: Recorded | None = None
        """The current round's release as it left the client before (a resumed run replaying a
        round after its checkpoint), re-sent instead of a new one; None: the round is new."""

    @property
    def active(self) -> bool:
        """Whether the client trains and releases in the current round."""
        return self.round_index is not None and self.stopped_round < 0

    def epsilon(self) -> float:
        return epsilon_spent(self.history, self.plan.delta, self.plan.accountant)

    @property
    def replaying(self) -> bool:
        """Whether this round's release left the client before (and is re-sent, no noise drawn)."""
        return self.active and self.replay is not None

    def begin_round(self, round_index: int) -> None:
        """Start the client's round: stop it (one line on stderr) if the round would overspend.
        A round whose release left the client before (a resumed run replays it) is a replay: its
        release is re-sent and its DP-SGD not run again (``trainer``). A release file there but
        unreadable left with values now lost: that round is charged on top, and this one is new."""
        self.round_index = round_index
        self.replay = None
        if self.stopped_round >= 0:
            return
        recorded = self.log.recorded(round_index) if self.log is not None else None
        if recorded is not None and recorded.rows is None:
            self.history = merged(self.history, self.plan.round_cost(self.noise_multiplier))
            print(f"htfl_dist: privacy: client {self.client_id}: the release of round {round_index + 1} left the "
                  f"client before this resume but its record {self.log.path(round_index) if self.log else ''} "
                  f"cannot be read; that round is charged (ε={self.epsilon():.3f}) and played again with new noise",
                  file=sys.stderr, flush=True)
        elif recorded is not None:
            self.replay = recorded
        after = epsilon_spent(merged(self.history, self.plan.round_cost(self.noise_multiplier)),
                              self.plan.delta, self.plan.accountant)
        if after > self.plan.target_epsilon:
            self.stopped_round = round_index
            print(f"htfl_dist: privacy: client {self.client_id} has spent ε={self.epsilon():.3f} of "
                  f"privacy.target_epsilon={self.plan.target_epsilon:g} (round {round_index + 1} would take it to "
                  f"{after:.3f}); it neither trains nor uploads from round {round_index + 1} on",
                  file=sys.stderr, flush=True)

    def open_mechanism(self, mechanism: str) -> NoiseSource:
        """Record this round's ``mechanism`` ('sgd': the local epochs of DP-SGD; 'release': one
        release of class rows) and return the source of its noise, keyed by this release alone.
        Anything the plan does not hold is refused before any noise is drawn, with one line naming
        the client, the round and the mechanism: a mechanism outside a round or of a stopped
        client, an unknown one, a second one of a kind in a round (its noise would be charged as
        independent of the first's), or one past the budget."""
        planned = self.plan.mechanisms_per_round()
        where = (f"client {self.client_id}, round {self.round_index + 1}" if self.round_index is not None
                 else f"client {self.client_id}, outside a round")
        what = MECHANISM_NAMES.get(mechanism, repr(mechanism))
        if mechanism not in planned:
            raise PrivacyPlanError(f"privacy: {where}: {what} is not a mechanism of the privacy plan "
                                   f"({', '.join(MECHANISM_NAMES[name] for name in planned)}); refused")
        if self.round_index is None or not self.active:  # (active implies a round)
            raise PrivacyPlanError(f"privacy: {where}: {what} while the client "
                                   f"{'has stopped' if self.stopped_round >= 0 else 'is outside a round'}; refused")
        if self.opened_in[mechanism] == self.round_index:
            raise PrivacyPlanError(f"privacy: {where}: a second {what} in one round is not in the privacy plan "
                                   f"(one per round); refused")
        history = merged(self.history, ((self.noise_multiplier, 1.0, planned[mechanism]),))
        spent = epsilon_spent(history, self.plan.delta, self.plan.accountant)
        if spent > self.plan.target_epsilon:
            raise PrivacyPlanError(f"privacy: {where}: {what} would take ε to {spent:.3f}, past "
                                   f"privacy.target_epsilon={self.plan.target_epsilon:g}; refused")
        release = sum(count for _, _, count in self.history)
        self.history = history
        self.opened_in[mechanism] = self.round_index
        return noise_source(self.plan.noise, self.plan.seed, mechanism, self.client_id, self.round_index, release)

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"history": torch.tensor(self.history, dtype=torch.float64).reshape(-1, 3),
                "noise_multiplier": torch.tensor(self.noise_multiplier, dtype=torch.float64),
                "stopped_round": torch.tensor(self.stopped_round, dtype=torch.int64),
                "opened_in": torch.tensor([self.opened_in[name] for name in MECHANISM_NAMES], dtype=torch.int64)}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.history = tuple((float(s), float(q), int(n)) for s, q, n in state["history"].tolist())
        self.noise_multiplier = float(state["noise_multiplier"])
        self.stopped_round = int(state["stopped_round"])
        opened = state["opened_in"].tolist() if "opened_in" in state else [-1] * len(MECHANISM_NAMES)
        self.opened_in = dict(zip(MECHANISM_NAMES, opened, strict=True))
