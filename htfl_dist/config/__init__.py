"""Typed run configuration: YAML file + dotted ``key=value`` overrides, validated once.

The lowest layer of the package: it imports nothing of it but ``errors``, and no torch. Its parts,
each importable alone:

- ``rules``: ``bounded`` ranges, ``check_bounds`` and ``unknown_name``, the one wording of every
  value check (the registries and the algorithms' options use them too);
- ``schema``: the sections as dataclasses, every field with its type, default and rule
  (``Literal`` choices, ``bounded`` ranges); ``generator_section``: FedKTL's generator section;
  ``participation_section``: drop-out, slow clients and deadlines on a simulated clock;
- ``loading``: files, overrides, the bounded YAML loader, coercion to the schema's types and
  ``validate`` (the bounds and the cross-field checks), every mistake one ConfigError line;
- ``identity``: the experiment part of a config, its hash, and what a resumed run may change
  (plumbing, and keys added after old run directories were written).

Names a registry holds (the algorithm and its options, the dataset, the model group, the
generator) are resolved one layer up, by ``htfl_dist.resolution``. The names below are the
package's public interface.
"""
from htfl_dist.config.identity import (
    declare_algorithm_options,
    experiment_differences,
    experiment_hash,
    experiment_view,
    section_view,
    spelled_out_partition_rules,
)
from htfl_dist.config.loading import (
    FLOAT32_MAX,
    INT64_MAX,
    MAX_EXPANDED_NODES,
    YAML_SWITCH,
    RefusedYaml,
    build_section,
    config_from_dict,
    load_config,
    load_yaml,
    parse_overrides,
    validate,
)
from htfl_dist.config.participation_section import ParticipationConfig
from htfl_dist.config.rules import PLUGIN_HINT, unknown_name
from htfl_dist.config.schema import (
    DEFAULT_FMNIST_ROOT,
    HEARTBEAT_FLOOR_S,
    Bound,
    Config,
    DataConfig,
    ModelConfig,
    OutputConfig,
    PrivacyConfig,
    RuntimeConfig,
    TrainConfig,
    bounded,
    check_bounds,
    default_cache_dir,
    partition_cache_dir,
)

__all__ = [
    "DEFAULT_FMNIST_ROOT",
    "FLOAT32_MAX",
    "HEARTBEAT_FLOOR_S",
    "INT64_MAX",
    "MAX_EXPANDED_NODES",
    "PLUGIN_HINT",
    "YAML_SWITCH",
    "Bound",
    "Config",
    "DataConfig",
    "ModelConfig",
    "OutputConfig",
    "ParticipationConfig",
    "PrivacyConfig",
    "RefusedYaml",
    "RuntimeConfig",
    "TrainConfig",
    "bounded",
    "build_section",
    "check_bounds",
    "config_from_dict",
    "declare_algorithm_options",
    "default_cache_dir",
    "experiment_differences",
    "experiment_hash",
    "experiment_view",
    "load_config",
    "load_yaml",
    "parse_overrides",
    "partition_cache_dir",
    "section_view",
    "spelled_out_partition_rules",
    "unknown_name",
    "validate",
]
