"""Frozen pre-trained generators for FedKTL's server: the interface (``base``), the registry
(``registry``) and the generators, which register themselves on import."""
from htfl_dist.generators import dcgan, files  # noqa: F401  (registration side effects)
from htfl_dist.generators.base import GeneratorConfig, LatentGenerator, to_client_images
from htfl_dist.generators.registry import (
    build_generator,
    check_generator_config,
    generator_latent_dim,
    generator_names,
    register_generator,
)

__all__ = [
    "GeneratorConfig",
    "LatentGenerator",
    "build_generator",
    "check_generator_config",
    "generator_latent_dim",
    "generator_names",
    "register_generator",
    "to_client_images",
]
