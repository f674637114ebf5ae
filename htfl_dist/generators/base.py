"""The frozen-generator interface FedKTL's server uses, and the server-side image adapter.

A generator maps *valid latents* (its own prior, or its mapping network applied to fresh noise)
to images in [−1, 1]. FedKTL needs only three things from it: the latent width H,
fresh valid latents for the MMD target, and a deterministic synthesis of the C latent centroids.
Everything else (F, the MMD, the centroids, the clients' h′) depends on the generator through
those, so a StyleGAN, a TorchScript export or the built-in DCGAN plug in without touching the
algorithm.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from htfl_dist.config.generator_section import GeneratorConfig
from htfl_dist.errors import ConfigError

__all__ = ["GeneratorConfig"]  # the config section, re-exported where the generators are

PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
"""Every client dataset is normalised as PFLlib does: ToTensor, then (x − 0.5) / 0.5 per channel."""
LUMA = (0.299, 0.587, 0.114)
"""ITU-R BT.601 weights: an RGB image becomes the greyscale one a Fashion-MNIST client expects."""


class LatentGenerator:
    """A frozen generator: ``latent_dim`` H, images ``image_channels``×``image_resolution``²,
    wrapping one frozen module ``module`` (a torch ``nn.Module`` or a TorchScript module)."""

    latent_dim: int
    image_channels: int
    image_resolution: int
    module: torch.nn.Module

    def sample_latents(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` fresh valid latents [count, H] on the generator's device (no gradient)."""
        raise NotImplementedError

    def synthesize(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [n, channels, R, R] in [−1, 1]; deterministic (no per-call noise)."""
        raise NotImplementedError

    def to(self, device: torch.device) -> LatentGenerator:
        self.module.to(device)
        return self

    @property
    def device(self) -> torch.device:
        """Where the module's weights are (the CPU for a module without any)."""
        for tensor in (*self.module.parameters(), *self.module.buffers()):
            return tensor.device
        return torch.device("cpu")

    def provenance(self) -> dict[str, Any]:
        """Where the weights came from (written into summary.json)."""
        raise NotImplementedError


def check_generator_output(name: str, images: torch.Tensor, count: int, channels: int, resolution: int) -> None:
    """One line when a user's generator returns something FedKTL cannot use."""
    expected = (count, channels, resolution, resolution)
    if tuple(images.shape) != expected:
        raise ConfigError(f"generator {name!r} returned images of shape {tuple(images.shape)}, "
                          f"expected {expected}")
    if not bool(torch.isfinite(images).all()):
        raise ConfigError(f"generator {name!r} returned non-finite pixels")


def to_client_images(images: torch.Tensor, resolution: int, channels: int) -> torch.Tensor:
    """Server-side: generated images in [−1, 1] → the clients' inputs.

    [−1, 1] → [0, 1] (clamped) → resize the shorter side to ``resolution`` (bilinear, with
    antialiasing when shrinking) → centre crop to a square → ``channels`` (RGB → luma for
    greyscale clients, grey → repeated for RGB clients) → (x − 0.5) / 0.5, the clients'
    normalisation."""
    if images.dim() != 4:
        raise ValueError(f"images must be [n, c, h, w], got {tuple(images.shape)}")
    pixels = ((images.float() + 1) / 2).clamp(0, 1)
    height, width = pixels.shape[-2:]
    if min(height, width) != resolution:
        scale = resolution / min(height, width)
        size = (max(resolution, round(height * scale)), max(resolution, round(width * scale)))
        pixels = F.interpolate(pixels, size=size, mode="bilinear", align_corners=False,
                               antialias=scale < 1).clamp(0, 1)
    top = (pixels.shape[-2] - resolution) // 2
    left = (pixels.shape[-1] - resolution) // 2
    pixels = pixels[..., top : top + resolution, left : left + resolution]
    pixels = _match_channels(pixels, channels)
    return (pixels - PIXEL_MEAN) / PIXEL_STD


def _match_channels(pixels: torch.Tensor, channels: int) -> torch.Tensor:
    have = pixels.shape[1]
    if have == channels:
        return pixels
    if have == 3 and channels == 1:
        weights = torch.tensor(LUMA, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        return (pixels * weights).sum(dim=1, keepdim=True)
    if have == 1:
        return pixels.expand(-1, channels, -1, -1).contiguous()
    raise ConfigError(f"cannot turn {have}-channel generated images into {channels}-channel client images")
