"""Catch library warnings (torch.ao's deprecation flood) where they arise; summarise them once."""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("torchtame")
_active: list[Counter[str]] = []


def _key(w: warnings.WarningMessage) -> str:
    text = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
    return f"{w.category.__name__}: {' '.join(text.split())[:160]}"


@contextmanager
def quiet_root_logger(level: int = logging.ERROR) -> Iterator[None]:
    """Raise the root logger's level for the block: some libraries (onnxruntime.quantization) log
    advisory lines through ``logging.warning`` instead of the warnings module."""
    root = logging.getLogger()
    saved = root.level
    root.setLevel(max(level, saved))
    try:
        yield
    finally:
        root.setLevel(saved)


@contextmanager
def caught(where: str, sink: Counter[str] | None = None) -> Iterator[Counter[str]]:
    """Record every warning raised inside and count it by message.

    Nested blocks pass their counts up to the enclosing one, so the outermost block (the
    pipeline's, around each step) holds them all; a block with no enclosing one logs a single
    debug line that summarises what it caught.
    """
    counts: Counter[str] = Counter() if sink is None else sink
    outer = _active[-1] if _active else None
    _active.append(counts)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            yield counts
        finally:
            _active.pop()
            new: Counter[str] = Counter(_key(w) for w in records)
            counts.update(new)
            if outer is not None:
                outer.update(counts if sink is None else new)
            elif counts and sink is None:
                log.debug("%s: %d library warnings caught: %s", where, sum(counts.values()), dict(counts))
