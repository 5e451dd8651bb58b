"""Wall time of `recipes/quickstart-search.yaml`: the local engine versus a two-node Ray cluster
started on this machine (loopback addresses), build and measurement phases separately.

    .venv/bin/python benchmarks/ray_cluster.py [--quick] [--results-dir D]

Both nodes of the cluster share this machine's cores, so this measures Ray's overhead and what
parallel builds buy on one box, not a real cluster's speed-up. The trained model is cached before
either run, so neither pays for training.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from common import out_dir, parser, publish, shortened

import torchtame

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
LOOPBACK = "127.0.0.2"


def timed_run(out: Path, execution: dict[str, Any] | None, quick: bool = False) -> dict[str, Any]:
    recipe = torchtame.load_recipe(ROOT / "recipes" / "quickstart-search.yaml", output_dir=str(out))
    raw = recipe.model_dump(mode="json", by_alias=True)
    if quick:  # the same search, narrowed to a few candidates with short training and timings
        raw["search"].update(sensitivity=False, prune_ratios=[0.5], combine=False, onnx=False, finetune=None)
        raw = shortened(raw)
    if execution:
        raw["execution"] = execution
    recipe = torchtame.load_recipe(raw)
    t0 = time.perf_counter()
    res = torchtame.run(recipe).results
    wall = time.perf_counter() - t0
    built = [v for v in res["variants"] if v["status"] == "ok"]
    return {
        "wall_s": round(wall, 1),
        "build_s": round(sum(v.get("build_s") or 0 for v in built), 1),
        "measure_s": round(sum(v.get("measure_s") or 0 for v in built), 1),
        "variants": len(res["variants"]),
        "failed": [v["name"] for v in res["variants"] if v["status"] != "ok"],
        "chosen": (res.get("selection") or {}).get("chosen"),
        "top1": {v["name"]: (v.get("accuracy") or {}).get("top1") for v in built},
        "nodes": sorted({m.get("node") for v in built for m in v.get("latency", [])}),
    }


def start_cluster(env: dict[str, str], nodes: int = 2) -> str:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    common = ["--node-ip-address", LOOPBACK, "--num-cpus", "1", "--resources", '{"torchtame_measure": 1}']
    head = [RAY, "start", "--head", "--port", str(port), "--include-dashboard=false", "--disable-usage-stats"]
    node = [RAY, "start", "--address", f"{LOOPBACK}:{port}", "--disable-usage-stats"]
    for cmd in (head + common, node + common)[:nodes]:
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=180)
    return f"{LOOPBACK}:{port}"


def render(data: dict[str, Any]) -> list[str]:
    local, cluster = data["local"], data["ray_2_nodes"]
    shared = set(local["top1"]) & set(cluster["top1"])
    differ = sorted(n for n in shared if local["top1"][n] != cluster["top1"][n])
    return [
        f"{data['recipe']} (sensitivity analysis, candidates, selection) with the model "
        "already trained and cached. The cluster is two Ray nodes started on this machine on loopback "
        "addresses (one CPU and one measuring slot each): both share the same two cores, so this shows "
        "Ray's overhead and what overlapping builds buys on one box, not a real cluster's speed-up.",
        "",
        "| engine | wall s | sum of build s | sum of measure s | variants | nodes measured on |",
        "|---|---|---|---|---|---|",
        f"| local | {local['wall_s']} | {local['build_s']} | {local['measure_s']} | "
        f"{local['variants']} | 1 |",
        f"| ray, {len(cluster['nodes'])} nodes | {cluster['wall_s']} | {cluster['build_s']} | "
        f"{cluster['measure_s']} | "
        f"{cluster['variants']} | {len(cluster['nodes'])} |",
        "",
        f"Same top-1 for every variant built by both engines: {'no' if differ else 'yes'}"
        + (f" ({', '.join(differ)} differ)" if differ else "")
        + f"; chosen: local `{local['chosen']}`, ray `{cluster['chosen']}`. Failed: local "
        f"{local['failed'] or 'none'}, ray {cluster['failed'] or 'none'}. Fine-tuned candidates train "
        "with the build task's CPUs as torch threads (`execution.step_cpus`, here 1) against this "
        "machine's 2 threads locally, so their float sums, and then their top-1, can differ slightly; "
        "with equal threads the engines give equal figures (tests/test_ray.py). The Ray run builds more "
        "candidates: its independent ones (the pruning grid, the onnxruntime calibrations) build at once "
        "instead of stopping at the first that meets the constraints. Build and measure sums are each "
        "engine's own task times; on Ray they overlap.",
    ]


def main() -> None:
    args = parser(__doc__, "a narrowed search (no sensitivity, one pruning ratio)").parse_args()
    results = out_dir(args)
    warnings.filterwarnings("ignore")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    os.environ.update(RAY_AUTH_MODE="disabled")
    out = Path(tempfile.mkdtemp(prefix="torchtame-ray-bench-"))
    t0 = time.perf_counter()
    if not args.quick:
        timed_run(out, None)  # warm: trains and caches the model
    local = timed_run(out, None, args.quick)
    print("local", local, flush=True)
    address = start_cluster(env, 1 if args.quick else 2)  # --quick: the head node alone
    try:
        cluster = timed_run(out, {"engine": "ray", "address": address}, args.quick)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
    print("ray", cluster, flush=True)
    recipe = "`recipes/quickstart-search.yaml`" + (", narrowed to one node (--quick)," if args.quick else "")
    data = {"recipe": recipe, "local": local, "ray_2_nodes": cluster}
    command = "python benchmarks/ray_cluster.py" + (" --quick" if args.quick else "")
    title = "Local engine vs a two-node Ray cluster on one machine"
    publish(results, "ray_cluster", title, command, time.perf_counter() - t0, data, render)


if __name__ == "__main__":
    main()
