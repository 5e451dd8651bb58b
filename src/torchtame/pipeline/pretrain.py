"""Train the recipe's model before optimizing it (``model.train``), cached by content hash."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

import torch

from ..data import DataBundle
from ..devices import training_device
from ..progress import Progress
from ..recipe import Recipe
from ..training import train_with_options

log = logging.getLogger("torchtame")


def pretrain(
    model: torch.nn.Module, recipe: Recipe, data: DataBundle, devices: list[str], progress: Progress
) -> dict[str, Any]:
    """Train ``model`` in place (or load the cached result); returns what results.json records."""
    cfg = recipe.model.train
    key = json.dumps(
        {
            "model": recipe.model.model_dump(mode="json"),
            "data": recipe.data.model_dump(mode="json"),
            "seed": recipe.seed,
            "torch": torch.__version__.split("+")[0],
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = recipe.output_dir / ".cache" / f"pretrained-{digest}.pt"
    if cfg.cache and cache.is_file():
        model.load_state_dict(torch.load(cache, map_location="cpu", weights_only=True))
        log.info("reusing the trained model cached at %s", cache)
        return {"cached": True, "cache": str(cache)}
    progress.status("training the model")
    t0 = time.perf_counter()
    stats = train_with_options(
        model,
        data.train,
        cfg,
        device=training_device(devices),
        seed=recipe.seed,
        progress=progress,
        description="train model",
    )
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    if cfg.cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, cache)
    return {"cached": False, "cache": str(cache) if cfg.cache else None, **stats}
