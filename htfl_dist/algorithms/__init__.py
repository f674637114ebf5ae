"""Algorithms: maths only. The interface (``interface``), the registry (``registry``), the shared
maths (``class_rows``, ``training``, ``parameters``, ``losses``) and one module per algorithm,
which registers itself on import; importing this package loads all of them."""
from htfl_dist.algorithms import (  # noqa: F401  (registration side effects)
    feddistill,
    fedgen,
    fedgh,
    fedhkd,
    fedkd,
    fedktl,
    fedl2g,
    fedmrl,
    fednh,
    fedoc,
    fedorgp,
    fedpac,
    fedpcl,
    fedproto,
    fedsa,
    fedtgp,
    fml,
    fpl,
    lgfedavg,
    local,
    protonorm,
)
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.registry import (
    AlgorithmEntry,
    ConformanceHints,
    algorithm_names,
    get_algorithm,
    is_algorithm,
    parse_options,
    register_algorithm,
    spelled_out_options,
)

__all__ = [
    "AlgorithmContext",
    "AlgorithmEntry",
    "ClientAlgorithm",
    "ClientState",
    "ConformanceHints",
    "ServerAlgorithm",
    "TrainResult",
    "algorithm_names",
    "get_algorithm",
    "is_algorithm",
    "parse_options",
    "register_algorithm",
    "spelled_out_options",
]
