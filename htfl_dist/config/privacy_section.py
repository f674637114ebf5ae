"""The ``privacy`` section: differential privacy of what leaves a client (docs/privacy.md), in its
own module to keep the schema readable; ``schema`` re-exports it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from htfl_dist.config.rules import ADDED_LATER, bounded, declared


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
    secure_aggregation: bool = False
    """The server learns only the sum of the round's uploads (SecAgg+, htfl_dist/privacy/
    secure_aggregation.py): each client's contribution is clipped to ±``secagg_clip``, quantised
    to ``secagg_levels`` steps and masked with pairwise and self masks that cancel in the sum, so
    rank 0 never sees one client's rows. Only for algorithms whose server needs nothing but that
    sum (``registry.sums_only``); independent of ``enabled`` (DP), and combinable with it."""
    secagg_neighbours: int | None = bounded(None, at_least=2, optional=True, note="or null: every pair")
    """k: each client masks with its k ring neighbours (SecAgg+, even k); null: with every other
    participant (the original SecAgg)."""
    secagg_threshold: float = bounded(0.5, above=0, below=1)
    """t as a share of a client's share holders (its neighbours and itself): t = ⌊f·holders⌋ + 1,
    a strict majority at 0.5, which Bonawitz et al. need against a server that deviates."""
    secagg_clip: float = bounded(8.0, above=0)
    """Every entry of a contribution is clipped to [−c, c] before it is quantised (Flower's SecAgg+
    ``clipping_range``, 8); entries clipped are counted per round (``secagg_clipped``)."""
    secagg_levels: int = bounded(1 << 22, at_least=2, at_most=(1 << 32) // 1023 - 1)
    """Quantisation steps over [−c, c] (Flower's SecAgg+ default 2^22): at most 1023 participants a
    round keep the sum below 2^32."""
    noise: Literal["secure", "seeded"] = "secure"
    """Where every Gaussian draw of the mechanisms comes from. secure: the operating system's
    cryptographically secure source, which no other party (the server included) can reproduce;
    the runs' numbers then differ from run to run. seeded: streams keyed by (seed, client, round,
    release), reproducible bit for bit, for experiments only: anyone who knows the config's seed
    can regenerate the noise and subtract it, so such a run is not private against the server."""
    noise_split: Literal["local", "distributed"] = declared("local", identity=ADDED_LATER)
    """How the release's noise is shared out (docs/privacy.md, "Distributed DP"). local: every
    client adds the full noise to its own rows (the guarantee holds against everyone who sees one
    upload). distributed, only with ``secure_aggregation``: the server sees only sums of at least
    t contributions (the protocol's Shamir threshold, Bonawitz et al. 2017), so each client adds
    Gaussian noise of variance σ²·B²/t and any released sum carries at least σ²·B², the central
    guarantee against the server (Kairouz, Liu & Steinke 2021, with a continuous Gaussian);
    B = 2·S/``min_class_samples`` bounds every client's row sensitivity. Added later: local,
    the behaviour before it, keeps the hash."""
