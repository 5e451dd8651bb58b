"""Exception types that users see. Each message says what was wrong, where, and what to do."""

from __future__ import annotations


def first_line(error: BaseException | str | None, limit: int = 200) -> str:
    """The first non-empty line of an error message (the exception's type name if it has none)."""
    text = str(error or "").strip()
    line = text.splitlines()[0] if text else ""
    if not line and isinstance(error, BaseException):
        line = type(error).__name__
    return line[:limit]


class TorchtameError(Exception):
    """Base of every error torchtame raises on purpose. The CLI prints it without a traceback."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  fix: {hint}")


class RecipeError(TorchtameError):
    """The recipe is malformed: bad YAML, unknown keys, wrong types or values (exit code 2)."""

    exit_code = 2


class DeviceError(TorchtameError):
    """A requested device is not available on this machine (exit code 2, raised before any work)."""

    exit_code = 2


class ModelLoadError(TorchtameError):
    """A model source could not produce a model."""


class DataError(TorchtameError):
    """A data source could not produce usable data."""


class PassError(TorchtameError):
    """An optimization pass failed; the pipeline records it and goes on with the other steps."""


class RunError(TorchtameError):
    """A run failed as a whole (for example its output directory cannot be written)."""
