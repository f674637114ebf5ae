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
        """DP-SGD of the round; in a replayed round (its release left before, ``ledger.replaying``)
        the pass is charged as it was then and not run again: the model stays as checkpointed, so
        the client's later releases carry no second, fresh DP-SGD noise of this round."""
        if self.ledger.replaying:
            self.ledger.open_mechanism("sgd")
            return 0.0, 0
        return train_privately(client, context, loss_fn, generator, self.ledger, on_batch=on_batch,
                               public_loss=public_loss, public_optimizers=public_optimizers,
                               before_step=before_step)

    def clip_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows clipped to ``privacy.feature_clip`` (S), the norm the release's sensitivity 2S/n_c assumes."""
        return clip_rows(rows, self.ledger.plan.feature_clip)

    def release_class_means(self, sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The private release of the client's class means (``sums`` of rows already clipped to S,
        ``counts`` per class): nothing once the ledger has stopped the client; else the ledger is
        charged one mechanism and the noised means of the classes with enough samples leave,
        recorded in the client's release file first (``release_log``). A replayed round re-sends
        the recorded release, charged as it was then, and draws no noise."""
        ledger = self.ledger
        if not ledger.active:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, sums.shape[1])
        noise = ledger.open_mechanism("release")
        replay = ledger.replay
        if replay is not None and replay.class_ids is not None and replay.rows is not None:
            return replay.class_ids, replay.rows
        plan = ledger.plan
        multiplier, sensitivity = plan.release_noise(ledger.noise_multiplier)
        released = noisy_class_means(sums, counts, clip=plan.feature_clip, noise_multiplier=multiplier,
                                     min_count=plan.min_class_samples, noise=noise, sensitivity=sensitivity)
        if ledger.log is not None and ledger.round_index is not None:
            ledger.log.record(ledger.round_index, *released)  # durable before the upload leaves
        return released
