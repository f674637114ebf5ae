"""Differential privacy of what leaves a client (docs/privacy.md).

``accounting``: the noise calibration and each client's ledger (an Opacus accountant, kept in
``ClientState.modules[LEDGER_KEY]`` so the runtime checkpoints it with the client);
``release``: clipped, noised class means; ``dpsgd``: local training with per-sample clipping and
noise; ``startup``: what the runtime calls (refusals, the plan, the reported ε).

This module imports nothing, so the training loop and the class-row helpers can name the key
without an import cycle (the mechanisms import them).
"""

LEDGER_KEY = "privacy"
"""The name of a client's privacy ledger among its ``ClientState.modules``."""
