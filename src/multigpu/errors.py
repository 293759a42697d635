"""The one exception type that the CLI turns into a one-line ``error: ...`` message."""

__all__ = ["UsageError"]


class UsageError(ValueError):
    """A request the application cannot carry out; the message says how to fix it."""
