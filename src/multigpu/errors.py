"""The exceptions that end the CLI with one line: ``error: ...`` for a bad request, or a finished run."""

__all__ = ["RunFinished", "UsageError", "check_at_least"]


class UsageError(ValueError):
    """A request the application cannot carry out; the message says how to fix it."""


class RunFinished(Exception):
    """A resumed run that has already reached its end: the CLI says so and exits with status 0."""


def check_at_least(option: str, value: float, minimum: float, below: float | None = None) -> None:
    """Refuse ``value`` for ``--option`` unless ``minimum <= value`` (and ``value < below``, when given)."""
    if value < minimum or (below is not None and value >= below):
        allowed = f"in [{minimum}, {below})" if below is not None else f"at least {minimum}"
        raise UsageError(f"{option} must be {allowed}, not {value}.")
