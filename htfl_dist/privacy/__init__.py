"""Differential privacy of what leaves a client (docs/privacy.md).

``accounting``: the noise calibration and each client's ledger (an Opacus accountant, kept in
``ClientState.modules[LEDGER_KEY]`` so the runtime checkpoints it with the client);
``release``: clipped, noised class means; ``dpsgd``: local training with per-sample clipping and
noise; ``trainer``: the client's private trainer (``ClientState.private``), through which the
algorithms' helpers reach the mechanisms without importing them; ``startup``: what the runtime
calls (refusals, the plan, each client's ledger and trainer, the reported ε).

This module imports nothing, so the runtime and the reports can name what it holds without
importing the mechanisms or torch.
"""

LEDGER_KEY = "privacy"
"""The name of a client's privacy ledger among its ``ClientState.modules``."""

WITHHELD_IN_PRIVATE_RUNS = {
    "train_loss": "a private client's training loss and sample count are computed from its training records "
                  "without noise, so they stay on the client (privacy.enabled; docs/privacy.md)",
}
"""The metrics columns a private run records as absent (null), and why: summary.json's privacy
block and the reports say it."""


def withheld_reason(config: dict, metric: str) -> str | None:
    """Why a run (its config.yaml as a dict) does not record ``metric``; None if it does."""
    private = bool((config.get("privacy") or {}).get("enabled"))
    return WITHHELD_IN_PRIVATE_RUNS.get(metric) if private else None
