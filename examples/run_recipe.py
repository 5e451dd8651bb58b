"""Run a recipe from Python, as a deployment pipeline would, and pick a variant by rule.

.venv/bin/python examples/run_recipe.py [RECIPE]
"""

from __future__ import annotations

import sys

import torchtame

recipe = torchtame.load_recipe(sys.argv[1] if len(sys.argv) > 1 else "recipes/quickstart.yaml")
recipe.evaluate.latency.min_time_s = 0.1  # a quicker measurement for the example
result = torchtame.run(recipe)

ok = [v for v in result.variants.values() if v.ok and v.latency_at("cpu") and v.fidelity.top1 is not None]
within = [v for v in ok if (v.fidelity.top1_drop or 0.0) <= 1.0]
fastest = min(within, key=lambda v: v.latency_at("cpu").p50_ms)  # at the largest batch measured
timing = fastest.latency_at("cpu")
print(
    f"fastest variant within 1 point of the baseline: {fastest.name} "
    f"({timing.p50_ms:.3f} ms at batch {timing.batch_size}, "
    f"{fastest.size.mb:.2f} MB) -> {result.run_dir / 'variants' / fastest.name}"
)
