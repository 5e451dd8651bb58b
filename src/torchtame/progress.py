"""A tiny progress protocol: the CLI shows rich bars, the Python API stays silent by default."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Task(Protocol):
    def advance(self, n: int = 1, **fields: Any) -> None: ...


class Progress(Protocol):
    def task(self, description: str, total: int | None = None) -> Any: ...

    def status(self, message: str) -> None: ...


class _NullTask:
    def advance(self, n: int = 1, **fields: Any) -> None:
        return None


class NullProgress:
    """Shows nothing."""

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[_NullTask]:
        yield _NullTask()

    def status(self, message: str) -> None:
        return None
