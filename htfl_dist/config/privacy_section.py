"""The ``privacy`` section: differential privacy of what leaves a client (docs/privacy.md), in its
own module to keep the schema readable; ``schema`` re-exports it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from htfl_dist.config.rules import bounded


@dataclass
class PrivacyConfig:
    """Record-level (ε, δ) differential privacy of each client's training samples against everyone
    who sees its uploads (docs/privacy.md): DP-SGD local training (Opacus) and Gaussian noise on
    the released class rows, one accountant per client. Off by default; while off the section is
    not part of the experiment (it changes nothing)."""

    enabled: bool = False
    target_epsilon: float = bounded(4.0, above=0, note="the budget each client may spend")
    """ε each client may spend over the run; the one noise multiplier of every mechanism is
    calibrated up front so that ``planned_rounds`` full rounds spend at most this."""
    delta: float = bounded(1e-5, above=0, below=1)
    """δ of the guarantee (well below 1 / the samples a client holds)."""
    planned_rounds: int | None = bounded(None, at_least=1, optional=True, note="or null: rounds")
    """Rounds the noise is calibrated for (null: ``rounds`` of the run's first start; the
    multiplier is then kept in the checkpoints, so extending ``rounds`` on resume does not
    re-calibrate: clients stop uploading when their budget is spent)."""
    feature_clip: float = bounded(1.0, above=0, note="S")
    """S: every sample's row (feature or logit vector) is scaled to L2 norm at most S before the
    class mean is taken."""
    max_grad_norm: float = bounded(1.0, above=0, note="C")
    """C: DP-SGD's per-sample gradient clipping norm."""
    min_class_samples: int = bounded(10, at_least=1)
    """A class with fewer training samples than this is not uploaded (its mean would be mostly
    noise: the noise's scale is 2·S·σ / n_c)."""
    accountant: Literal["rdp", "prv"] = "rdp"
    """Opacus's accountant composing every release: rdp (Rényi DP, an upper bound) or prv
    (privacy random variables, a tighter numerical estimate)."""
    noise: Literal["secure", "seeded"] = "secure"
    """Where every Gaussian draw of the mechanisms comes from. secure: the operating system's
    cryptographically secure source, which no other party (the server included) can reproduce;
    the runs' numbers then differ from run to run. seeded: streams keyed by (seed, client, round,
    release), reproducible bit for bit, for experiments only: anyone who knows the config's seed
    can regenerate the noise and subtract it, so such a run is not private against the server."""
