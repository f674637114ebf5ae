"""The ``generator`` config section (FedKTL's pre-trained generator on rank 0), a leaf like the
rest of the schema: the generators themselves (``htfl_dist.generators``) import it, never the
other way round."""
from __future__ import annotations

from dataclasses import dataclass

from htfl_dist.config.rules import bounded


@dataclass
class GeneratorConfig:
    """The pre-trained generator on rank 0 (FedKTL only; other algorithms ignore this section)."""

    name: str = "dcgan_faces"
    """dcgan_faces: the built-in DCGAN (pip package gan-face-generate 1.1.1, DigiFace1M faces,
    z ∈ R^100 → 3×64×64); stylegan_pickle: a StyleGAN-XL / StyleGAN3 network pickle (``G_ema``;
    the StyleGAN code on PYTHONPATH); torchscript: a TorchScript file with ``mapping`` and
    ``synthesis``; random_dcgan: the DCGAN architecture with untrained weights (an ablation)."""
    path: str | None = None
    """stylegan_pickle / torchscript: the file to load."""
    sha256: str | None = None
    """Expected sha256 of ``path`` (checked before loading when set)."""
    trust_pickle: bool = False
    """stylegan_pickle: a pickle runs code when loaded; set true only for a file you trust."""
    latent_dim: int = 0
    """stylegan_pickle / torchscript: H, the latent width (declared so that client ranks know the
    download's width without loading the file; rank 0 checks it against the file)."""
    truncation: float = bounded(1.0, above=0, at_most=1)
    """stylegan_pickle: truncation ψ of the mapping network (the reference code uses 1, none)."""
