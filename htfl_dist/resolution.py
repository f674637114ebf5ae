"""The one resolution step: a loaded config (the schema's types and ranges; no torch, no registry)
becomes one every registry agrees with.

It sits above the registries and below everything that runs a config (the program, the study,
the in-process driver), so none of those imports the command-line module. The order is fixed:

1. the built-in registrations (the algorithms, models, dataset sources and generators packages
   register theirs on import), registered the way a plugin registers its own;
2. the installed plugins: every entry point of the group ``htfl_dist.plugins``, so a
   pip-installed package registers itself without a flag;
3. the modules named by ``--import MODULE`` (any CLI) and by the config's ``plugins`` key;
4. every registry-named key (``algorithm``, ``data.dataset``, ``model.group``,
   ``generator.name``) checked against its registry under the one name rule of
   ``htfl_dist.registry`` (any case finds a name) and refused the same way
   (``config.rules.unknown_name``), and the options of the algorithm, the dataset and the model
   group's architectures (``algo``, ``data.options``, ``model.options``) checked and spelled out. The
   values are kept as written: the config hash is of what the user wrote.

A plugin that cannot be imported, or whose registrations clash with what is registered, is one
line naming it (exit status 2).
"""
from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable, Sequence
from typing import Any

from htfl_dist.config import Config, load_config
from htfl_dist.errors import ConfigError, clipped

ENTRY_POINT_GROUP = "htfl_dist.plugins"
"""The entry-point group a plugin package declares (``[project.entry-points."htfl_dist.plugins"]``)."""

BUILT_IN_PACKAGES = ("htfl_dist.algorithms", "htfl_dist.models", "htfl_dist.data.sources", "htfl_dist.generators")
"""The packages whose import registers the built-in names."""

_loaded: dict[str, str] = {}
"""Plugin module → where it was named (an entry point, --import, the config's plugins key)."""


def _import(module: str, origin: str) -> None:
    if module in _loaded:
        return
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise ConfigError(f"plugin {clipped(module)} ({origin}) cannot be imported: no module named "
                              f"{exc.name!r}; install its package or put it on PYTHONPATH") from None
        raise ConfigError(f"plugin {clipped(module)} ({origin}) failed to import: {type(exc).__name__}: "
                          f"{clipped(str(exc))}") from None
    except ConfigError:
        raise
    except Exception as exc:  # a plugin's own import-time failure, a name registered twice
        raise ConfigError(f"plugin {clipped(module)} ({origin}) failed to import: {type(exc).__name__}: "
                          f"{clipped(str(exc))}") from None
    _loaded[module] = origin


def installed_plugins() -> list[tuple[str, str]]:
    """(module, package) of every entry point in the ``htfl_dist.plugins`` group, sorted."""
    found = []
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        package = point.dist.name if point.dist is not None else "an installed package"
        found.append((point.value.split(":", 1)[0], f"entry point {point.name} of {package}"))
    return sorted(found)


def load_plugins(modules: Iterable[str] = ()) -> dict[str, str]:
    """Import the built-in registrations, the installed plugins, then ``modules``, each once;
    returns every plugin module loaded so far and where it was named."""
    for package in BUILT_IN_PACKAGES:
        importlib.import_module(package)
    for module, origin in installed_plugins():
        _import(module, origin)
    for module in modules:
        _import(module, "--import or plugins")
    return dict(_loaded)


def plugin_versions() -> dict[str, str]:
    """For summary.json: each loaded plugin module with its distribution's version where it has
    one (a plain module on PYTHONPATH has none)."""
    distributions = importlib.metadata.packages_distributions()
    versions = {}
    for module in sorted(_loaded):
        names = distributions.get(module.split(".", 1)[0], [])
        versions[module] = importlib.metadata.version(names[0]) if names else "not installed as a package"
    return versions


def check_registered_names(config: Config) -> None:
    """Every registry-named key against its registry, in the config's order of sections."""
    from htfl_dist.algorithms import get_algorithm
    from htfl_dist.data.sources import dataset_source
    from htfl_dist.generators.registry import get_generator
    from htfl_dist.models import resolve_group

    get_algorithm(config.algorithm)
    dataset_source(config.data.dataset)
    resolve_group(config.model.group)
    get_generator(config.generator.name)


def resolve(config: Config, imports: Sequence[str] = ()) -> Config:
    """``config`` resolved in place (and returned): plugins loaded, every registry-named key
    checked, ``algo``, ``data.options`` and ``model.options`` validated and spelled out (config.yaml shows the values
    used, and writing a default explicitly does not make a different experiment)."""
    from htfl_dist.algorithms import spelled_out_options
    from htfl_dist.data.sources import spelled_out_dataset_options
    from htfl_dist.models import spelled_out_model_options

    loaded = load_plugins([*imports, *config.plugins])
    try:
        check_registered_names(config)
    except ConfigError as exc:
        if not loaded:
            raise
        # a plugin that was imported but registered nothing of that name: say which were loaded
        raise ConfigError(f"{exc}; plugins loaded: {', '.join(loaded)}") from None
    config.algo = spelled_out_options(config.algorithm, config.algo)
    config.data.options = spelled_out_dataset_options(config.data.dataset, config.data.options)
    config.model.options = spelled_out_model_options(config.model.group, config.model.options)
    return config


def resolved_config(config_file: str | None, overrides: Sequence[str], imports: Sequence[str] = ()) -> Config:
    """The config exactly as a run uses and hashes it: the file, the overrides, resolved. Tools
    that predict a run's config hash use this too."""
    return resolve(load_config(config_file, list(overrides)), imports)


def algorithm_options(config: Config) -> Any:
    """``config.algo`` as the algorithm's options dataclass, every default and ``compat`` choice
    resolved (after ``resolve``: the names are registered)."""
    from htfl_dist.algorithms import get_algorithm, parse_options

    return parse_options(get_algorithm(config.algorithm), config.algo)
