"""Execution engines besides the local one; importing this package registers them by name (Ray is
imported only when a run uses it)."""

from __future__ import annotations

from . import ray_engine  # noqa: F401  (registers the "ray" engine)
