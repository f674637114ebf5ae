"""User-facing errors.

Anything a user can fix (a config key, a path, a world size) raises ``HtflError``;
``htfl_dist.main`` prints its message as one line and exits non-zero, with no traceback.
Programming errors stay ordinary exceptions so their tracebacks reach the developer.
"""


class HtflError(Exception):
    """A mistake in the user's input: the message says what is wrong and how to fix it."""


class ConfigError(HtflError):
    """A config key has a value that is not allowed."""


class DataError(HtflError):
    """A dataset path, file or partition request cannot be satisfied."""


class ProtocolError(HtflError):
    """A payload crossing ranks is malformed (wrong shape, dtype, or not finite)."""
