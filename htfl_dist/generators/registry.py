"""The one registry of generators: ``generator.name`` → how to learn H cheaply, how to load.

Client ranks need only H (the width of the latents they download); only rank 0 loads weights.
A name is only ever looked up here, so an unknown one is a one-line ConfigError listing the
allowed names.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from htfl_dist.errors import ConfigError
from htfl_dist.generators.base import GeneratorConfig, LatentGenerator
from htfl_dist.registry import Registry, name_key


@dataclass(frozen=True)
class GeneratorEntry:
    name: str
    build: Callable[[GeneratorConfig, int], LatentGenerator]
    """(config, run seed) → a loaded, frozen generator on the CPU (rank 0 only)."""
    latent_dim: Callable[[GeneratorConfig], int]
    """H without loading anything (every rank)."""
    summary: str
    needs_path: bool = False


_REGISTRY: Registry[GeneratorEntry] = Registry("generator", "generator.name", order=name_key, plumbing=(__name__,))


def register_generator(name: str, *, build: Callable[[GeneratorConfig, int], LatentGenerator],
                       latent_dim: Callable[[GeneratorConfig], int], summary: str,
                       needs_path: bool = False) -> None:
    """Register a generator under ``name`` (the one name rule of ``htfl_dist.registry``)."""
    _REGISTRY.add(name, GeneratorEntry(name, build, latent_dim, summary, needs_path))


def generator_names() -> list[str]:
    return _REGISTRY.names()


def get_generator(name: str) -> GeneratorEntry:
    return _REGISTRY.get(name)


def check_generator_config(config: GeneratorConfig) -> None:
    """Everything about ``generator.*`` that can be checked without loading the weights."""
    entry = get_generator(config.name)
    if entry.needs_path:
        if not config.path:
            raise ConfigError(f"generator.name={config.name} needs generator.path=FILE")
        if config.latent_dim < 1:
            raise ConfigError(f"generator.name={config.name} needs generator.latent_dim=H (the file's latent "
                              f"width, so client ranks know it without loading the file)")
    if config.sha256 is not None and len(config.sha256) != 64:
        raise ConfigError(f"config key 'generator.sha256' must be 64 hex digits, got {config.sha256!r}")


def generator_latent_dim(config: GeneratorConfig) -> int:
    check_generator_config(config)
    return get_generator(config.name).latent_dim(config)


def build_generator(config: GeneratorConfig, seed: int) -> LatentGenerator:
    """Load the configured generator (rank 0), frozen, on the CPU; its H must be the declared one."""
    check_generator_config(config)
    entry = get_generator(config.name)
    generator = entry.build(config, seed)
    declared = entry.latent_dim(config)
    if generator.latent_dim != declared:
        raise ConfigError(f"generator {config.name!r} has latents of width {generator.latent_dim}, but "
                          f"generator.latent_dim={declared}; set generator.latent_dim={generator.latent_dim}")
    return generator


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checked_file(path: str | Path, expected_sha256: str | None, what: str) -> tuple[Path, str]:
    """(path, its sha256) after checking it exists and, when ``expected_sha256`` is given, matches."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{what}: {str(file)!r} is not a file")
    actual = file_sha256(file)
    if expected_sha256 is not None and actual != expected_sha256.lower():
        raise ConfigError(f"{what}: {str(file)!r} has sha256 {actual}, expected {expected_sha256.lower()}; "
                          f"the file changed or is not the one the config names")
    return file, actual


def frozen(module: torch.nn.Module) -> torch.nn.Module:
    """Eval mode and no gradients: a generator is never trained here."""
    module.eval()
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module
