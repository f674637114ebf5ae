"""Data layer: dataset sources, partitioners, per-client splits and the HDF5 partition cache.

The runtime uses ``prepare_partition`` once (any rank; concurrent calls are safe), then each
rank calls ``load_client_split`` for its own logical clients only.

Where things are: ``datasets`` and ``sources/`` read datasets; ``partition`` holds the legacy
partition rules and the checks both rule sets share, ``partition_pfllib`` PFLlib's rules;
``pfllib`` reads a directory PFLlib wrote; ``prepare`` turns a config into a partition cache and
``cache`` is that file (layout, atomic write, readers).
"""
from .cache import (
    FORMAT_VERSION,
    ClientSplit,
    PartitionInfo,
    load_client_split,
    load_client_splits,
    read_partition_info,
)
from .datasets import DatasetArrays, load_dataset, parse_idx
from .partition import (
    partition_dirichlet,
    partition_pathological,
    split_train_test,
    subsample_indices,
    train_count,
)
from .pfllib import read_pfllib_config, read_pfllib_file
from .prepare import prepare_partition

__all__ = [
    "FORMAT_VERSION",
    "ClientSplit",
    "DatasetArrays",
    "PartitionInfo",
    "load_client_split",
    "load_client_splits",
    "load_dataset",
    "parse_idx",
    "partition_dirichlet",
    "partition_pathological",
    "prepare_partition",
    "read_partition_info",
    "read_pfllib_config",
    "read_pfllib_file",
    "split_train_test",
    "subsample_indices",
    "train_count",
]
