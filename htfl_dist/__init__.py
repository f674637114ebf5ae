"""htfl_dist: a distributed engine for prototype-based heterogeneous federated learning."""

__version__ = "0.1.0"
