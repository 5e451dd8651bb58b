"""Check a quickstart run on a GPU machine: what `devices: [auto]` measured where.

    python benchmarks/gpu_check.py RUN/results.json

Expected: the CPU and cuda:0 both resolved; the baseline timed on both, with CUDA-event timings
and a CUDA peak memory; every torch int8 variant measured on the CPU (accuracy and latency) and
marked "cpu only" on the GPU; fp16 measured on the GPU. Prints one line per check and exits 1 on
the first failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    res = json.loads(Path(sys.argv[1]).read_text())
    by = {v["name"]: v for v in res["variants"]}
    failures = []

    def check(ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            failures.append(what)

    devices = [d["device"] for d in res["devices"] if d.get("available", True)]
    check(devices[:2] == ["cpu", "cuda:0"], f"auto resolved to the CPU and cuda:0 ({devices})")
    base = {m["device"]: m for m in by["baseline"]["latency"]}
    check({"cpu", "cuda:0"} <= set(base), "baseline timed on both devices")
    cuda = [m for m in by["baseline"]["latency"] if m["device"] == "cuda:0"]
    check(bool(cuda) and all(m.get("timer") == "cuda-events" for m in cuda), "CUDA timings use CUDA events")
    check(bool(cuda) and all((m.get("peak_memory_mb") or 0) > 0 for m in cuda), "CUDA peak memory recorded")
    for name in ("int8-dynamic", "int8-static", "pruned-ft-int8"):
        v = by.get(name, {})
        devs = {m["device"] for m in v.get("latency", [])}
        check(
            devs == {"cpu"} and (v.get("accuracy") or {}).get("device") == "cpu",
            f"{name} measured on the CPU",
        )
    fp16 = by.get("fp16", {})
    check({m["device"] for m in fp16.get("latency", [])} == {"cuda:0"}, "fp16 measured on the GPU")
    for name, v in by.items():
        for m in v.get("latency", []):
            print(
                f"      {name:<16} {m['device']:<7} b{m['batch_size']:<3} p50 {m['p50_ms']:9.3f} ms  "
                f"peak {m.get('peak_memory_mb')} MiB  {m.get('timer')} io={m.get('io')}"
            )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
