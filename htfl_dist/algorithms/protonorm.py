"""ProtoNorm (Lee, Shin and Choi, arXiv 2507.04310, 2025): prototype alignment and upscaling
(docs/algorithms.md, "ProtoNorm").

Clients are FedProto's with HtFLlib's regulariser: they upload P_i^c, the mean of f_i(x) over
their samples of class c, for the classes they hold, train CE + λ·MSE(f(x), P̂^y) and classify by
the nearest global prototype. The server averages the uploads per class (FedProto's unweighted
mean P̄^c, classes nobody uploaded absent), then

- Prototype Alignment (PA): puts the m present means on the unit sphere, u^c = P̄^c / ‖P̄^c‖, and
  spreads them apart there by a momentum iteration under pairwise repulsion (the reference code's
  Thomson solver, :func:`align_on_sphere`):

      F_i = Σ_{j≠i} (u_i − u_j) / (‖u_i − u_j‖² + ε)            ε = 1e-10
      v ← μ·v + η_t·F,   u ← (u + v) / ‖u + v‖                   η_t = η·0.95^⌈t/10⌉

  for at most T iterations, stopping once the mean force norm, rounded to 4 decimals, has stayed
  the same for ``thomson_patience`` iterations in a row after iteration ``thomson_early_stop``;
- Prototype Upscaling (PU): P̂^c = s·u^c, which is what goes down (s = 80).

The paper's own equations could not be read here (only its abstract and introduction were
available); every default is the reference code's (regulationLee/ProtoNorm e816cef, its
README's command ``-pa -pu -csf 80``), the prototypes included: taken from the model the round
started from, over the full batches (issue 47). FedProto's definition (after training, every
sample) is an option; what the code does differently from what the abstract says is listed in
docs/algorithms.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.class_rows import global_prototype_diagnostics
from htfl_dist.algorithms.fedproto import (
    ClientRegulariser,
    FedProtoClient,
    FedProtoOptions,
    FedProtoServer,
    ProtoSamples,
    PrototypeSource,
)
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.config import bounded
from htfl_dist.payload import Payload

REPULSION_EPS = 1e-10
"""ε in the repulsion's denominator (the reference code's)."""
LR_DECAY, LR_DECAY_EVERY = 0.95, 10
"""η is multiplied by 0.95 after iterations 0, 10, 20, ... (the reference code's schedule)."""
FORCE_DECIMALS = 4
"""The early stop compares the mean force norm rounded to this many decimals (the reference's)."""


@dataclass
class ProtoNormOptions(FedProtoOptions):
    client_reg: ClientRegulariser = "htfllib"
    """htfllib: λ·MSE(f(x), P̂^y) per sample over B·K (the reference code's loss); paper: FedProto's
    λ·mean_c ‖P_i^c − P̂^c‖₂ on the batch's class means."""
    proto_from: PrototypeSource = "pre_update"
    """When the uploaded means are taken: pre_update, the reference code's (regulationLee/ProtoNorm
    @e816cef ``clientprotonorm.py:collect_protos`` reads the client's model file before the trained
    model is saved, so it averages the model the round started from); post_update, FedProto's
    definition of a prototype (the class mean after local training), a departure for those who want
    the uploads to describe the trained model; during_training, the features of the batches
    trained on (needs proto_samples=all)."""
    alignment: bool = True
    """Prototype Alignment: spread the normalised means on the unit sphere (False: normalise only,
    the "PU without PA" ablation)."""
    scale_factor: float = bounded(80.0, above=0)
    """s, Prototype Upscaling: P̂^c = s·u^c (the reference's ``-csf``, 80 in its README; 1 turns
    upscaling off, its run without ``-pu``)."""
    thomson_iterations: int = bounded(500, at_least=1)
    """T, the most iterations of the alignment."""
    thomson_lr: float = bounded(0.1, above=0)
    """η, the alignment's initial step size."""
    thomson_momentum: float = bounded(0.9, at_least=0, below=1)
    """μ."""
    thomson_early_stop: int | None = bounded(10, at_least=0, optional=True)
    """The iteration from which the mean force norm is watched for a stall (None: always T iterations)."""
    thomson_patience: int = bounded(10, at_least=1)
    """How many iterations in a row the rounded mean force norm must repeat to stop."""
    proto_samples: ProtoSamples = "full_batches"
    """Which training samples the uploaded means cover: full_batches, the samples of the full
    batches in stored order (the reference code's: ``collect_protos`` reads its
    ``DataLoader(shuffle=False, drop_last=True)``; a client without one full batch uploads
    nothing); or all of them, FedProto's definition (a departure: no sample left out), the one
    value that goes with proto_from=during_training."""



def repulsion_forces(units: torch.Tensor) -> torch.Tensor:
    """F_i = Σ_{j≠i} (u_i − u_j) / (‖u_i − u_j‖² + ε) for rows u [m, K]; returns [m, K].

    The force of a logarithmic potential (−Σ log ‖u_i − u_j‖), as the reference code computes it."""
    diff = units.unsqueeze(1) - units.unsqueeze(0)  # diff[i, j] = u_i − u_j
    magnitudes = 1.0 / ((diff * diff).sum(dim=-1) + REPULSION_EPS)
    magnitudes.fill_diagonal_(0)
    return (magnitudes.unsqueeze(-1) * diff).sum(dim=1)


def mean_force_level(forces: torch.Tensor) -> float:
    """(1/m) Σ_i ‖F_i‖, rounded to ``FORCE_DECIMALS`` decimals as the reference code prints it."""
    return float(f"{forces.norm(dim=1).mean().item():.{FORCE_DECIMALS}f}")


class ForceStall:
    """The alignment's early stop: from iteration ``start`` on, each step's rounded mean force
    norm is compared with the previous step's; ``patience`` equal ones in a row stop the loop
    (after that step), and a different one starts the count again. ``start`` None: never."""

    def __init__(self, start: int | None, patience: int) -> None:
        self.start, self.patience = start, patience
        self.watched: float | None = None
        self.repeats = 0

    def stop(self, t: int, level: float) -> bool:
        """Whether iteration ``t``, whose forces had rounded mean norm ``level``, is the last."""
        if self.start is None or t < self.start:
            return False
        if t > self.start and level == self.watched:
            self.repeats += 1
        else:
            self.repeats = 0
        self.watched = level
        return self.repeats == self.patience


@torch.no_grad()
def align_on_sphere(protos: torch.Tensor, iterations: int, lr: float, momentum: float,
                    early_stop: int | None, patience: int) -> tuple[torch.Tensor, int]:
    """Prototype Alignment: u = P̄/‖P̄‖, then at most ``iterations`` steps of
    v ← μ·v + η_t·F(u), u ← (u + v)/‖u + v‖, with η_0 = ``lr`` multiplied by 0.95 after iterations
    0, 10, 20, ... and the early stop of :class:`ForceStall` (``early_stop``, ``patience``) on the
    forces of each step. Returns (unit rows [m, K], iterations run)."""
    units = F.normalize(protos, dim=1)
    velocity = torch.zeros_like(units)
    step, stall = lr, ForceStall(early_stop, patience)
    for t in range(iterations):
        forces = repulsion_forces(units)
        velocity = momentum * velocity + step * forces
        units = F.normalize(units + velocity, dim=1)
        if t % LR_DECAY_EVERY == 0:
            step *= LR_DECAY
        if early_stop is not None and stall.stop(t, mean_force_level(forces)):
            return units, t + 1
    return units, iterations


class ProtoNormClient(FedProtoClient):
    """FedProto's client (regulariser, upload, nearest-prototype inference); with
    ``proto_samples=full_batches`` the uploaded means, taken before or after training as
    ``proto_from`` says, cover the full batches only."""

    capturable_step = False  # a loss of its own, not checked for host syncs


class ProtoNormServer(FedProtoServer):
    """P̂^c = s·u^c, u the per-class means spread on the unit sphere (or only normalised)."""

    def diagnostics(self, uploads: dict[int, Payload], previous: Payload) -> dict[str, Any]:
        return {}  # the mean's; update() reports them for the aligned, upscaled table instead

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        previous = self.download()
        metrics = super().update(uploads, round_index, generator)
        options = self.options
        if options.alignment and self.rows.shape[0] > 0:
            units, iterations = align_on_sphere(
                self.rows, options.thomson_iterations, options.thomson_lr, options.thomson_momentum,
                options.thomson_early_stop, options.thomson_patience)
        else:
            units, iterations = F.normalize(self.rows, dim=1), 0
        self.rows = options.scale_factor * units
        metrics["thomson_iterations"] = iterations
        if units.shape[0] > 1:
            cosines = units @ units.t()
            cosines.fill_diagonal_(-1.0)
            metrics["proto_max_cos"] = float(cosines.max())
        return {**metrics, **global_prototype_diagnostics(uploads, self.context.num_classes, self.download(),
                                                          previous)}


register_algorithm("protonorm", server=ProtoNormServer, client=ProtoNormClient, options=ProtoNormOptions,
                   summary="FedProto's mean prototypes spread on the unit sphere, then upscaled (Lee et al. 2025)",
                   # FedProto's messages through FedProto's code (class_row_fields up and down); the
                   # alignment runs on rank 0 alone, on the uploads in client-id order
                   conformance=ConformanceHints(ranks_covered_by="fedproto"))
