"""Check a quickstart run: what `devices: [auto]` measured where (the prepared GPU check).

    python benchmarks/gpu_check.py RUN/results.json
    python benchmarks/gpu_check.py --quick      (a tiny run here, checked the same way)

Expected on a GPU machine: the CPU and cuda:0 both resolved; the baseline timed on both, with
CUDA-event timings and a CUDA peak memory; every torch int8 variant measured on the CPU (accuracy
and latency) and marked "cpu only" on the GPU; fp16 measured on the GPU. Without a GPU: the CPU
alone, fp16 marked "cuda only" and never timed. Prints one line per check and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def tiny_run() -> dict[str, Any]:
    """The quickstart cut to its int8 and fp16 steps, short training and timings, `devices: [auto]`."""
    import torchtame

    raw = torchtame.load_recipe(ROOT / "recipes" / "quickstart.yaml").model_dump(mode="json", by_alias=True)
    raw["steps"] = [s for s in raw["steps"] if s["name"] in ("int8-dynamic", "int8-static", "fp16")]
    from common import shortened

    raw = shortened(raw, rounds=1)
    raw["output_dir"] = tempfile.mkdtemp(prefix="torchtame-gpu-check-")
    return torchtame.run(raw).results


def check_run(res: dict[str, Any]) -> list[str]:
    by = {v["name"]: v for v in res["variants"]}
    failures = []

    def check(ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            failures.append(what)

    devices = [d["device"] for d in res["devices"] if d.get("available", True)]
    gpu = "cuda:0" in devices
    expected = ["cpu", "cuda:0"] if gpu else ["cpu"]
    check(devices[: len(expected)] == expected, f"auto resolved to {expected} ({devices})")
    base = {m["device"]: m for m in by["baseline"]["latency"]}
    check(set(expected) <= set(base), f"baseline timed on {expected}")
    cuda = [m for m in by["baseline"]["latency"] if m["device"] == "cuda:0"]
    if gpu:
        events = bool(cuda) and all(m.get("timer") == "cuda-events" for m in cuda)
        check(events, "CUDA timings use CUDA events")
        memory = bool(cuda) and all((m.get("peak_memory_mb") or 0) > 0 for m in cuda)
        check(memory, "CUDA peak memory recorded")
    for name in ("int8-dynamic", "int8-static", "pruned-ft-int8"):
        if name not in by:
            continue
        v = by[name]
        devs = {m["device"] for m in v.get("latency", [])}
        on_cpu = devs == {"cpu"} and (v.get("accuracy") or {}).get("device") == "cpu"
        check(on_cpu, f"{name} measured on the CPU")
    fp16 = by.get("fp16", {})
    measured = {m["device"] for m in fp16.get("latency", [])}
    skipped = {d["device"] for d in fp16.get("skipped_devices", [])}
    if gpu:
        check(measured == {"cuda:0"}, "fp16 measured on the GPU")
    else:
        check(not measured and "cpu" in skipped, "fp16 not timed without a GPU (cuda only)")
    for name, v in by.items():
        for m in v.get("latency", []):
            print(
                f"      {name:<16} {m['device']:<7} b{m['batch_size']:<3} p50 {m['p50_ms']:9.3f} ms  "
                f"peak {m.get('peak_memory_mb')} MiB  {m.get('timer')} io={m.get('io')}"
            )
    return failures


def sparse_2_4() -> bool:
    """2:4 Linear weights on sparse tensor cores (compute capability 8.0+): outputs and a timing
    against the same weights dense, printed for the record."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        print("skip  2:4 sparse tensor cores: no CUDA GPU of compute capability 8.0+")
        return True
    from torchtame.passes.sparse import nm_mask, semi_structured

    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
    with torch.no_grad():
        for m in dense:
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(nm_mask(m.weight, 2, 4))
    dense = dense.half().cuda().eval()
    fast = copy.deepcopy(dense)
    converted = semi_structured(fast)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        err = (fast(x) - dense(x)).abs().max().item()
        times = {}
        for name, m in (("dense", dense), ("2:4", fast)):
            for _ in range(5):
                m(x)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                m(x)
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - start) / 50 * 1000
    ok = len(converted) == 2 and err < 0.1
    print(
        f"{'ok  ' if ok else 'FAIL'}  2:4 sparse tensor cores: {len(converted)} layers converted, "
        f"max abs error {err:.3g}; {times['dense']:.3f} ms dense, {times['2:4']:.3f} ms 2:4 "
        f"({times['dense'] / times['2:4']:.2f}x)"
    )
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", type=Path, help="a quickstart run's results.json")
    ap.add_argument("--quick", action="store_true", help="check a tiny run made here instead")
    args = ap.parse_args()
    if args.results is None and not args.quick:
        ap.error("give a results.json, or --quick")
    res = tiny_run() if args.quick else json.loads(args.results.read_text())
    failed = check_run(res)
    sparse_ok = sparse_2_4()
    sys.exit(1 if failed or not sparse_ok else 0)


if __name__ == "__main__":
    main()
