"""Dataset sources, one module per source, each registering its datasets on import.

The import order below is the registration order, which is the order the allowed names are
listed in (``fmnist, cifar10, cifar100, tinyimagenet, flowers102, digit5, domainnet``). A new dataset is one new
module here plus one line below (see docs/datasets.md).
"""
# Each module registers its datasets on import, in this order: keep it.
# isort: off
from . import fmnist  # noqa: F401
from . import cifar  # noqa: F401
from . import tinyimagenet  # noqa: F401
from . import flowers102  # noqa: F401
from . import digit5  # noqa: F401
from . import domainnet  # noqa: F401
# isort: on

from .registry import (
    DatasetArrays,
    DatasetSource,
    check_arrays,
    dataset_names,
    dataset_options,
    dataset_source,
    register_dataset,
    spelled_out_dataset_options,
    stat_fingerprint,
)

__all__ = [
    "DatasetArrays",
    "DatasetSource",
    "check_arrays",
    "dataset_names",
    "dataset_options",
    "dataset_source",
    "register_dataset",
    "spelled_out_dataset_options",
    "stat_fingerprint",
]
