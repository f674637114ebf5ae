"""The plugin API: everything a plugin (an algorithm, a model, a dataset, a generator, and its
tests) may use, in one module. This is the stable surface: a name listed in ``__all__`` keeps its
meaning across releases, and docs/plugins.md and examples/htfl_example_plugin/ import from here
only. Anything else in ``htfl_dist`` may change without notice.

What is here, grouped as ``__all__`` lists it:

- registration: ``register_algorithm`` (with ``ConformanceHints``), ``register_architecture``
  (``InputNeed``, ``SQUARE_IMAGES``), ``register_model_group``, ``register_head``,
  ``register_dataset`` (``DatasetSource``, ``DatasetArrays``), ``register_generator``
  (``LatentGenerator``, ``GeneratorConfig``), ``bounded`` for an options field's range,
  ``declared`` with ``Identity`` / ``ADDED_LATER`` for an option added after runs existed (or
  renamed) that must keep their hash, and ``Compat`` / ``compat_option`` for the paper | reference preset;
- the algorithm bases: ``ServerAlgorithm``, ``ClientAlgorithm``, ``AlgorithmContext``,
  ``ClientState``, ``TrainResult``;
- the model-part block (FedAvg over a part of the model): ``PartSharingClient``,
  ``PartAveragingServer``, ``PartServer``, ``ModelPart`` and the parts ``HEAD``,
  ``FEATURE_EXTRACTOR``, ``WHOLE_MODEL``, ``SHARED_MODEL``, the options type ``Average``;
- the class-row helpers the prototype methods use (``ClassMeans``, ``GroupClassMeans``,
  ``class_means``, ``ClassMeanServer``, ``check_class_rows``, ...);
- training: ``run_local_training``, ``run_batched_training``, ``Batch``, ``batch_cross_entropy``,
  ``weighted_mean``, ``gradient_clipper``, ``train_on_pairs``, the parameter rows
  (``average_rows``, ``parameter_row``, ...) and ``torch_generator`` for a stream of one's own;
- payloads: ``Field``, ``Payload``, ``PayloadSpec``;
- models: ``SplitModel``, ``linear_head``, ``plain_cnn``, ``InputSpec``, and ``build_model`` /
  ``members_in_use`` to read a registration back in a test;
- data: ``load_dataset`` to read a registered dataset back, ``replaced_atomically`` to write a
  file whole or not at all;
- errors: ``ConfigError``, ``DataError``, ``ProtocolError`` (one line each, exit status 2);
- the conformance kit (``htfl_dist.testing``): ``conformance_cases``, ``ConformanceCase``,
  ``ConformanceError``, ``play_one_round``, ``PlayedRound``, ``play_run``, ``launch_run``,
  ``launch_env``, ``SMALL_RUN``, ``CHECKS``. These load the runtime, so they are imported on
  first use: ``import htfl_dist.api`` loads what ``htfl_dist.algorithms`` loads and no more.

What is NOT here: the runtime (``htfl_dist.runtime``: the round loop, ``Federation`` and its
attributes, transports, the wire format, checkpoints, start-up), the config's internals and
resolution, privacy (an algorithm never imports it: ``client.private`` is the hook), metrics,
the study runner and the command line. A plugin reaches those only through the program's command
lines and the kit. Nothing inside ``htfl_dist`` imports this module (tests/runtime/test_layering.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from htfl_dist.algorithms.batches import Batch
from htfl_dist.algorithms.blocks.model_part import (
    FEATURE_EXTRACTOR,
    HEAD,
    WHOLE_MODEL,
    Average,
    ModelPart,
    PartAveragingServer,
    PartServer,
    PartSharingClient,
)
from htfl_dist.algorithms.class_rows import (
    ClassMeans,
    ClassMeanServer,
    GroupClassMeans,
    batch_class_means,
    check_class_counts,
    check_class_rows,
    class_means,
    class_prototypes,
    class_row_fields,
    dense_class_table,
    dense_prototypes,
    euclidean_distances,
)
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.parameters import (
    average_rows,
    load_parameter_row,
    parameter_count,
    parameter_field,
    parameter_row,
)
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.shared_model import SHARED_MODEL
from htfl_dist.algorithms.training import (
    batch_cross_entropy,
    gradient_clipper,
    run_batched_training,
    run_local_training,
    train_on_pairs,
    weighted_mean,
)
from htfl_dist.atomic import replaced_atomically
from htfl_dist.config.rules import ADDED_LATER, Identity, bounded, declared
from htfl_dist.data.datasets import load_dataset
from htfl_dist.data.sources.registry import DatasetArrays, DatasetSource, register_dataset
from htfl_dist.errors import ConfigError, DataError, ProtocolError
from htfl_dist.generators.base import GeneratorConfig, LatentGenerator
from htfl_dist.generators.registry import register_generator
from htfl_dist.models.base import SplitModel, linear_head
from htfl_dist.models.cnn import plain_cnn
from htfl_dist.models.heads import register_head
from htfl_dist.models.inputs import InputSpec
from htfl_dist.models.registry import (
    SQUARE_IMAGES,
    InputNeed,
    build_model,
    members_in_use,
    register_architecture,
    register_model_group,
)
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.seeding import torch_generator

if TYPE_CHECKING:
    from htfl_dist.testing import (
        CHECKS,
        SMALL_RUN,
        ConformanceCase,
        ConformanceError,
        PlayedRound,
        conformance_cases,
        launch_env,
        launch_run,
        play_one_round,
        play_run,
    )

KIT = ("CHECKS", "SMALL_RUN", "ConformanceCase", "ConformanceError", "PlayedRound", "conformance_cases",
       "launch_env", "launch_run", "play_one_round", "play_run")
"""The conformance kit's names, imported from ``htfl_dist.testing`` on first use."""

__all__ = [  # grouped in the module docstring
    "ADDED_LATER",
    "CHECKS",
    "FEATURE_EXTRACTOR",
    "HEAD",
    "SHARED_MODEL",
    "SMALL_RUN",
    "SQUARE_IMAGES",
    "WHOLE_MODEL",
    "AlgorithmContext",
    "Average",
    "Batch",
    "ClassMeanServer",
    "ClassMeans",
    "ClientAlgorithm",
    "ClientState",
    "Compat",
    "ConfigError",
    "ConformanceCase",
    "ConformanceError",
    "ConformanceHints",
    "DataError",
    "DatasetArrays",
    "DatasetSource",
    "Field",
    "GeneratorConfig",
    "GroupClassMeans",
    "Identity",
    "InputNeed",
    "InputSpec",
    "LatentGenerator",
    "ModelPart",
    "PartAveragingServer",
    "PartServer",
    "PartSharingClient",
    "Payload",
    "PayloadSpec",
    "PlayedRound",
    "ProtocolError",
    "ServerAlgorithm",
    "SplitModel",
    "TrainResult",
    "average_rows",
    "batch_class_means",
    "batch_cross_entropy",
    "bounded",
    "build_model",
    "check_class_counts",
    "check_class_rows",
    "class_means",
    "class_prototypes",
    "class_row_fields",
    "compat_option",
    "conformance_cases",
    "declared",
    "dense_class_table",
    "dense_prototypes",
    "euclidean_distances",
    "gradient_clipper",
    "launch_env",
    "launch_run",
    "linear_head",
    "load_dataset",
    "load_parameter_row",
    "members_in_use",
    "parameter_count",
    "parameter_field",
    "parameter_row",
    "plain_cnn",
    "play_one_round",
    "play_run",
    "register_algorithm",
    "register_architecture",
    "register_dataset",
    "register_generator",
    "register_head",
    "register_model_group",
    "replaced_atomically",
    "run_batched_training",
    "run_local_training",
    "torch_generator",
    "train_on_pairs",
    "weighted_mean",
]

if not TYPE_CHECKING:
    def __getattr__(name: str) -> Any:
        """The kit's names, imported when first read (PEP 562): the kit loads the runtime."""
        if name in KIT:
            import htfl_dist.testing

            value = getattr(htfl_dist.testing, name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(KIT))
