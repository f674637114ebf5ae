"""The built-in generator: a DCGAN trained on DigiFace1M synthetic faces (offline, 14 MB).

The weights ship in the PyPI wheel ``gan-face-generate`` 1.1.1 (MIT) as
``gan_face_generate/weights.tar``; we only read that file (``importlib.resources``, sha256
pinned, ``torch.load(weights_only=True)``) into our own module. Faces are disjoint from every
client dataset, and FedKTL's Table 6 shows face-trained generators transfer about as well as
ImageNet ones. Valid latents are the DCGAN prior N(0, I_100).

``random_dcgan`` is the same architecture with untrained weights (the DCGAN paper's N(0, 0.02)
initialisation, seeded from the run seed): the issue's "is it the pre-training?" ablation.
"""
from __future__ import annotations

import importlib.metadata
import importlib.resources
import itertools
from typing import Any

import torch
from torch import nn

from htfl_dist.errors import ConfigError
from htfl_dist.generators.base import GeneratorConfig, LatentGenerator, check_generator_output
from htfl_dist.generators.registry import checked_file, frozen, register_generator
from htfl_dist.seeding import derive_seed

PACKAGE = "gan-face-generate"
PACKAGE_VERSION = "1.1.1"
WEIGHTS_RESOURCE = ("gan_face_generate", "weights.tar")
WEIGHTS_SHA256 = "0c3b90b138cfc4e8a73310b9fd5ce2a8f1f3a542a037de277412307fcd28771f"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} (launch/setup_env.sh installs it)"
LATENT_DIM = 100
RESOLUTION = 64
CHANNELS = 3
WIDTH = 64
CALIBRATION_SAMPLES = 512


class DCGANGenerator(nn.Module):
    """Radford et al.'s generator: z [n, 100, 1, 1] → 4² → 8² → 16² → 32² → 64², transposed
    4×4 convolutions (100→512→256→128→64→3) with BatchNorm and ReLU, Tanh at the end. The layer
    indices match the checkpoint's ``main.N`` keys."""

    def __init__(self, latent_dim: int = LATENT_DIM, width: int = WIDTH, channels: int = CHANNELS) -> None:
        super().__init__()
        widths = [width * 8, width * 4, width * 2, width]
        layers: list[nn.Module] = [nn.ConvTranspose2d(latent_dim, widths[0], 4, 1, 0, bias=False),
                                   nn.BatchNorm2d(widths[0]), nn.ReLU(True)]
        for wide, narrow in itertools.pairwise(widths):
            layers += [nn.ConvTranspose2d(wide, narrow, 4, 2, 1, bias=False), nn.BatchNorm2d(narrow), nn.ReLU(True)]
        layers += [nn.ConvTranspose2d(widths[-1], channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.main(latents.view(latents.shape[0], -1, 1, 1))


class PriorLatentGenerator(LatentGenerator):
    """A generator whose valid latents are its N(0, I) prior (DCGAN and other VAE/GAN decoders)."""

    def __init__(self, name: str, module: nn.Module, latent_dim: int, channels: int, resolution: int,
                 provenance: dict[str, Any]) -> None:
        self.name = name
        self.module = frozen(module)
        self.latent_dim, self.image_channels, self.image_resolution = latent_dim, channels, resolution
        self._provenance = provenance

    def sample_latents(self, count: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(count, self.latent_dim, generator=generator).to(self.device)

    @torch.no_grad()
    def synthesize(self, latents: torch.Tensor) -> torch.Tensor:
        images = self.module(latents.to(self.device, torch.float32))
        check_generator_output(self.name, images, latents.shape[0], self.image_channels, self.image_resolution)
        return images

    def provenance(self) -> dict[str, Any]:
        return dict(self._provenance)


def packaged_weights() -> tuple[str, str]:
    """(path, version) of the installed wheel's weights.tar; one line saying how to install it."""
    try:
        resource = importlib.resources.files(WEIGHTS_RESOURCE[0]) / WEIGHTS_RESOURCE[1]
        version = importlib.metadata.version(PACKAGE)
    except (ModuleNotFoundError, importlib.metadata.PackageNotFoundError):
        raise ConfigError(f"generator.name=dcgan_faces needs the package {PACKAGE} {PACKAGE_VERSION}: "
                          f"{INSTALL_HINT}") from None
    return str(resource), version


def load_dcgan_weights(path: str, expected_sha256: str = WEIGHTS_SHA256) -> tuple[DCGANGenerator, str]:
    """Our DCGAN with the checkpoint's ``netG_state_dict`` (tensors only: ``weights_only=True``)."""
    file, digest = checked_file(path, expected_sha256, "generator dcgan_faces weights")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
        state = checkpoint["netG_state_dict"]
    except Exception as exc:  # any unreadable file is the same user-facing problem
        raise ConfigError(f"generator dcgan_faces: cannot read {str(file)!r} ({type(exc).__name__}); "
                          f"reinstall with {INSTALL_HINT}") from None
    module = DCGANGenerator()
    module.load_state_dict(state, strict=True)
    return module, digest


def build_dcgan_faces(config: GeneratorConfig, seed: int) -> LatentGenerator:
    path, version = packaged_weights()
    module, digest = load_dcgan_weights(path)
    return PriorLatentGenerator("dcgan_faces", module, LATENT_DIM, CHANNELS, RESOLUTION, {
        "name": "dcgan_faces", "package": PACKAGE, "version": version,
        "file": "/".join(WEIGHTS_RESOURCE), "sha256": digest,
        "parameters": sum(p.numel() for p in module.parameters()),
        "training_data": "DigiFace1M synthetic faces", "latent_prior": "N(0, I_100)",
    })


@torch.no_grad()
def build_random_dcgan(config: GeneratorConfig, seed: int) -> LatentGenerator:
    """Untrained DCGAN: conv weights N(0, 0.02), BN γ N(1, 0.02), β 0 (DCGAN paper), drawn from
    (seed, "random-dcgan"); BatchNorm statistics set from 512 prior samples so that eval-mode
    synthesis is neither saturated nor flat."""
    stream = torch.Generator().manual_seed(derive_seed(seed, "random-dcgan"))
    module = DCGANGenerator()
    for layer in module.modules():
        if isinstance(layer, nn.ConvTranspose2d):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=stream) * 0.02)
        elif isinstance(layer, nn.BatchNorm2d):
            layer.weight.copy_(1 + torch.randn(layer.weight.shape, generator=stream) * 0.02)
            layer.bias.zero_()
            layer.momentum = None  # cumulative average over the calibration batch
    module.train()
    module(torch.randn(CALIBRATION_SAMPLES, LATENT_DIM, generator=stream))
    return PriorLatentGenerator("random_dcgan", module, LATENT_DIM, CHANNELS, RESOLUTION, {
        "name": "random_dcgan", "weights": "untrained (DCGAN init N(0, 0.02))",
        "seed_stream": "(seed, 'random-dcgan')", "parameters": sum(p.numel() for p in module.parameters()),
        "latent_prior": "N(0, I_100)",
    })


register_generator("dcgan_faces", build=build_dcgan_faces, latent_dim=lambda config: LATENT_DIM,
                   summary=f"DCGAN on DigiFace1M faces, z in R^100 -> 3x64x64 ({PACKAGE} {PACKAGE_VERSION})")
register_generator("random_dcgan", build=build_random_dcgan, latent_dim=lambda config: LATENT_DIM,
                   summary="the DCGAN architecture with untrained weights (ablation)")
