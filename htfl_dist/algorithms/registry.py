"""The one registry of algorithms: name → (server, client, options, what it shares)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from htfl_dist.algorithms.interface import ClientAlgorithm, ServerAlgorithm
from htfl_dist.config import build_section, check_bounds
from htfl_dist.errors import ConfigError


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str
    server: type[ServerAlgorithm]
    client: type[ClientAlgorithm]
    options: type
    summary: str
    shares_parameters: bool = False
    """True only where the method's paper shares model parameters (a head, a shared model, a
    generator); every other algorithm sends class knowledge only, and the conformance test holds
    it to that."""
    uses_generator: bool = False
    """True for FedKTL: rank 0 loads ``generator.*`` and passes it to the server as
    ``server(context, generator=...)``; every rank learns its latent width (``context.latent_dim``)."""
    private_release: bool = False
    """True where everything a client uploads is class rows from ``class_rows.class_means`` and
    every gradient its local training takes from the client's samples goes through DP-SGD
    (``training.run_local_training``, or ``privacy.dpsgd.train_privately`` with a public term
    computed from downloads only, FedKTL's): ``privacy.*`` then noises the rows and clips and
    noises those gradients (docs/privacy.md). Any other algorithm is refused at start-up when
    privacy is on."""
    batched_clients: bool = False
    """True where the client's ``train_group`` is a batched path of its ``train`` (the same loss,
    equal results within float tolerance, whoever shares the group): ``train.client_batching=vmap``
    is accepted only then. A subclass that changes ``train`` but inherits a batched
    ``train_group`` would batch the parent's loss, so the declaration is per registered client."""
    evaluation_installs_knowledge: bool = False
    """True where the client's ``prepare_evaluation`` changes the client (installs a downloaded
    head or shared model): the runtime then hands it a client it keeps, rather than a read-only
    look at a parked one."""


_REGISTRY: dict[str, AlgorithmEntry] = {}


def register_algorithm(name: str, *, server: type[ServerAlgorithm], client: type[ClientAlgorithm],
                       options: type, summary: str, shares_parameters: bool = False,
                       uses_generator: bool = False, private_release: bool = False, batched_clients: bool = False,
                       evaluation_installs_knowledge: bool = False) -> None:
    """Register an algorithm under ``name``, with what it declares it can do (AlgorithmEntry's
    flags); the runtime reads the declarations and never inspects the classes."""
    if name in _REGISTRY:
        raise ValueError(f"algorithm {name!r} registered twice")
    _REGISTRY[name] = AlgorithmEntry(name, server, client, options, summary, shares_parameters, uses_generator,
                                     private_release, batched_clients, evaluation_installs_knowledge)


def algorithm_names() -> list[str]:
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> AlgorithmEntry:
    key = name.lower()
    if key not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r}; allowed: {', '.join(algorithm_names())}")
    return _REGISTRY[key]


def parse_options(entry: AlgorithmEntry, raw: dict[str, Any]) -> Any:
    """Validate ``algo.*`` against the algorithm's options dataclass: names and types, the
    ranges its fields declare with ``config.bounded``, then its own ``validate`` (choices that
    depend on each other, ``compat`` resolving the knobs left unset)."""
    options = build_section(entry.options, raw, "algo.")
    check_bounds(options, "algo.")
    check = getattr(options, "validate", None)
    if check is not None:
        check()
    return options


def spelled_out_options(algorithm: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``algo.*`` validated and with every option written out: the form a config is stored and
    compared in, so writing a default explicitly is not a different experiment."""
    return dataclasses.asdict(parse_options(get_algorithm(algorithm), raw))
