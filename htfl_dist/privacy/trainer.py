"""A private client's trainer: what ``startup.attach_ledger`` installs on ``ClientState.private``
beside the ledger, so the algorithms' shared helpers train and release through the client
(``algorithms.interface.PrivateTraining``) and never import this package.

Importing it imports Opacus (``dpsgd``), which only a private run needs."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from htfl_dist.algorithms.batches import Batch
from htfl_dist.algorithms.interface import AlgorithmContext, ClientState, PrivateTraining
from htfl_dist.privacy.accounting import PrivacyLedger
from htfl_dist.privacy.dpsgd import train_privately
from htfl_dist.privacy.release import clip_rows, noisy_class_means


class PrivateTrainer(PrivateTraining):
    """DP-SGD, clipping and the release of class means, each spending from one client's ledger.

    It keeps the ledger object itself, not a copy: the runtime restores a checkpointed or parked
    state into that object (``client.modules[LEDGER_KEY]``) in place."""

    def __init__(self, ledger: PrivacyLedger) -> None:
        self.ledger = ledger

    def train(self, client: ClientState, context: AlgorithmContext, loss_fn: Callable[[Batch], torch.Tensor],
              generator: torch.Generator, *, on_batch: Callable[[Batch], None] | None = None,
              public_loss: Callable[[], torch.Tensor] | None = None,
              public_optimizers: Sequence[torch.optim.Optimizer] = (),
              before_step: Callable[[], None] | None = None) -> tuple[float, int]:
        return train_privately(client, context, loss_fn, generator, self.ledger, on_batch=on_batch,
                               public_loss=public_loss, public_optimizers=public_optimizers,
                               before_step=before_step)

    def clip_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows clipped to ``privacy.feature_clip`` (S), the norm the release's sensitivity 2S/n_c assumes."""
        return clip_rows(rows, self.ledger.plan.feature_clip)

    def release_class_means(self, sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The private release of the client's class means (``sums`` of rows already clipped to S,
        ``counts`` per class): nothing once the ledger has stopped the client; else the ledger is
        charged one mechanism and the noised means of the classes with enough samples leave."""
        ledger = self.ledger
        if not ledger.active:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, sums.shape[1])
        noise = ledger.open_mechanism("release")
        plan = ledger.plan
        return noisy_class_means(sums, counts, clip=plan.feature_clip, noise_multiplier=ledger.noise_multiplier,
                                 min_count=plan.min_class_samples, noise=noise)
