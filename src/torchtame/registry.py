"""One small registry type shared by model sources, data sources, passes and metrics.

Third parties register through the ``torchtame.plugins`` entry point group: each entry point
names a module (or callable) that registers its items when imported or called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from .errors import RecipeError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Entry(Generic[F]):
    """A registered item: its name, the function that does the work and its options schema."""

    name: str
    fn: F
    options: type[BaseModel]
    summary: str


class Registry(Generic[F]):
    """Name -> (function, pydantic options model). ``version`` changes on each registration."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Entry[F]] = {}
        self.version = 0

    def register(self, name: str, options: type[BaseModel]) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
            self._items[name] = Entry(name=name, fn=fn, options=options, summary=summary)
            self.version += 1
            return fn

        return decorator

    def get(self, name: str) -> Entry[F]:
        load_plugins()
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise RecipeError(f"unknown {self.kind} {name!r}", hint=f"use one of: {known}") from None

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._items)

    def entries(self) -> list[Entry[F]]:
        return [self._items[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._items


_plugins_loaded = False


def load_plugins() -> None:
    """Import every ``torchtame.plugins`` entry point once, so plugins can register items."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group="torchtame.plugins"):
        obj = ep.load()
        if callable(obj):
            obj()
