"""Algorithms register themselves on import; importing this package loads all of them."""
from htfl_dist.algorithms import fedproto, fedtgp, local  # noqa: F401  (registration side effects)
from htfl_dist.algorithms.base import (  # noqa: F401
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
    algorithm_names,
    get_algorithm,
    parse_options,
    spelled_out_options,
)
