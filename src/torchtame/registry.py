"""One small registry type shared by model sources, data sources, passes and metrics.

The registries themselves live here too, so a pass or source module registers itself with a
downward import. Third parties register through the ``torchtame.plugins`` entry point group:
each entry point names a module (or callable) that registers its items when imported or called.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from .errors import RecipeError, TorchtameError
from .options import NoOptions

F = TypeVar("F", bound=Callable[..., Any])


Trait = Literal["trains", "same_architecture", "quantizes", "prunes", "exports"]
"""What a pass is, declared where it registers (``register_pass(..., traits={...})``):

- ``trains``: it runs a training loop (gets a GPU on Ray, where the run has one);
- ``same_architecture``: it changes weights only, so a speed difference to its parent is noise;
- ``quantizes``, ``prunes``, ``exports``: what it does to its parent (health hints follow it)."""
TRAITS: tuple[str, ...] = ("trains", "same_architecture", "quantizes", "prunes", "exports")

Hint = str | Callable[[dict[str, Any]], str]
"""A health finding's next step for a pass: a sentence, or a function of the variant's results
entry (its options, mode and dtype choose the sentence). Keys: ``slower``, ``fidelity``."""


@dataclass(frozen=True)
class Entry(Generic[F]):
    """A registered item: its name, the function that does the work, its options schema and, for
    passes, what the pass is (``traits``) and what to try when its variant gets a finding (``hints``)."""

    name: str
    fn: F
    options: type[BaseModel]
    summary: str
    traits: frozenset[str] = frozenset()
    hints: tuple[tuple[str, Hint], ...] = ()

    def has(self, trait: str) -> bool:
        return trait in self.traits

    def hint(self, kind: str, entry: dict[str, Any]) -> str | None:
        """The pass's next step for a finding of ``kind`` on ``entry`` (None: it has none)."""
        found = dict(self.hints).get(kind)
        return found(entry) if callable(found) else found


class Registry(Generic[F]):
    """Name -> (function, pydantic options model). ``version`` changes on each registration."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Entry[F]] = {}
        self.version = 0

    def register(
        self,
        name: str,
        options: type[BaseModel] = NoOptions,
        *,
        replace: bool = False,
        traits: set[str] | frozenset[str] = frozenset(),
        hints: dict[str, Hint] | None = None,
    ) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; a taken name is an error unless ``replace``."""
        if name in self._items and not replace:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {self._items[name].fn.__module__}); "
                "pass replace=True to replace it"
            )
        unknown = set(traits) - set(TRAITS)
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown traits {sorted(unknown)}; known: {TRAITS}")
        unknown = set(hints or {}) - {"slower", "fidelity"}
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r}: unknown hint kinds {sorted(unknown)}; use: slower, fidelity"
            )

        def decorator(fn: F) -> F:
            summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
            self._items[name] = Entry(
                name=name,
                fn=fn,
                options=options,
                summary=summary,
                traits=frozenset(traits),
                hints=tuple((hints or {}).items()),
            )
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

    def find(self, name: str | None) -> Entry[F] | None:
        """The entry of ``name`` if it is registered (no error: results of older runs may name
        passes this process does not know)."""
        if name is None:
            return None
        load_plugins()
        return self._items.get(name)

    def has_trait(self, name: str | None, trait: str) -> bool:
        """Whether the registered item ``name`` declares ``trait``."""
        entry = self.find(name)
        return entry is not None and entry.has(trait)


MODEL_SOURCES: Registry[Callable[..., Any]] = Registry("model source")
DATA_SOURCES: Registry[Callable[..., Any]] = Registry("data source")
PASSES: Registry[Callable[..., Any]] = Registry("pass")
METRICS: Registry[Callable[..., Any]] = Registry("metric")
ENGINES: Registry[Callable[..., Any]] = Registry("execution engine")


def register_pass(
    name: str,
    options: type[BaseModel] = NoOptions,
    *,
    replace: bool = False,
    traits: set[str] | frozenset[str] = frozenset(),
    hints: dict[str, Hint] | None = None,
) -> Any:
    """Register ``fn(model, ctx, options) -> Variant`` as the pass ``name``; ``traits`` say what
    the pass is (see :data:`TRAITS`), ``hints`` what to try when its variant is slower than its
    parent (``slower``) or lost fidelity (``fidelity``)."""
    return PASSES.register(name, options, replace=replace, traits=traits, hints=hints)


def register_engine(name: str, *, replace: bool = False) -> Any:
    """Register ``factory(execution_config) -> Engine`` as the execution engine ``name``."""
    return ENGINES.register(name, NoOptions, replace=replace)


def register_model_source(name: str, options: type[BaseModel], *, replace: bool = False) -> Any:
    """Register a model source: ``fn(options) -> nn.Module``."""
    return MODEL_SOURCES.register(name, options, replace=replace)


def register_data_source(name: str, options: type[BaseModel], *, replace: bool = False) -> Any:
    """Register a data source: ``fn(options, seed) -> DataBundle``."""
    return DATA_SOURCES.register(name, options, replace=replace)


def register_metric(name: str, *, replace: bool = False) -> Any:
    """Register ``fn(outputs, labels|None, baseline_outputs|None) -> dict | None`` as a metric."""
    return METRICS.register(name, NoOptions, replace=replace)


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


def resolve_callable(
    target: str, what: str = "target", error: type[TorchtameError] = TorchtameError
) -> Callable[..., Any]:
    """Import ``package.module:attr`` or ``path/to/file.py:attr``; failures raise ``error``."""
    if ":" not in target:
        raise error(
            f"{what} {target!r} is not of the form 'package.module:callable'",
            hint="write e.g. 'torchtame.zoo:digits_cnn' or 'mymodels.py:build'",
        )
    module_name, _, attr = target.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise error(f"{what}: file {module_name!r} does not exist")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except TorchtameError:
        raise
    except ImportError as exc:
        raise error(
            f"{what} {target!r}: cannot import module {module_name!r} ({exc})",
            hint="check the spelling and that the module is importable (PYTHONPATH)",
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            raise error(
                f"{what} {target!r}: module {module_name!r} has no attribute {part!r}",
                hint=f"did you mean {', '.join(close)}?" if close else None,
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{what} {target!r} is not callable")
    return obj
