"""Run a recipe from Python, as a deployment pipeline would, and pick a variant by rule.

.venv/bin/python examples/run_recipe.py [RECIPE]
"""

from __future__ import annotations

import sys

import torchtame

recipe = torchtame.load_recipe(sys.argv[1] if len(sys.argv) > 1 else "recipes/quickstart.yaml")
recipe.evaluate.latency.min_time_s = 0.1  # a quicker measurement for the example
result = torchtame.run(recipe)

ok = [v for v in result.results["variants"] if v["status"] == "ok" and v["latency"] and v["accuracy"]]
within = [v for v in ok if v["accuracy"].get("top1_drop", 0.0) <= 1.0]
fastest = min(within, key=lambda v: v["latency"][-1]["p50_ms"])
print(
    f"fastest variant within 1 point of the baseline: {fastest['name']} "
    f"({fastest['latency'][-1]['p50_ms']:.3f} ms at batch {fastest['latency'][-1]['batch_size']}, "
    f"{fastest['size']['bytes'] / 1e6:.2f} MB) -> {result.run_dir / 'variants' / fastest['name']}"
)
