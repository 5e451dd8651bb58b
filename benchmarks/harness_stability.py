"""How repeatable is the latency harness? Measure one variant 5 times and print the spread.

    .venv/bin/python benchmarks/harness_stability.py [--repeats 5] [--batch 1 64]

Spread of one setting = (max p50 - min p50) / median p50 over the repeats. The target on the
2-core development machine is a median spread under 5%; the figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from common import write_section

from torchtame.data import DigitsData, load_data
from torchtame.evaluate.latency import measure_latency
from torchtame.pipeline import apply_pass
from torchtame.runtime import quantized_engine
from torchtame.zoo import digits_cnn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--min-time", type=float, default=1.0)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    data = load_data(DigitsData(source="digits", batch_size=64), 0)
    fp32 = digits_cnn().eval()
    int8 = apply_pass("quantize.static", fp32, data)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats")
    print(f"{'variant':<8} {'batch':>5} {'p50 per repeat (ms)':<48} {'spread':>7}")
    spreads = []
    rows = ["| variant | batch | p50 per repeat (ms) | spread |", "|---|---|---|---|"]
    records = []
    for name, module, backend in (("fp32", fp32, None), ("int8", int8.module, int8.backend)):
        for bs in args.batch:
            x = data.example_input(bs)
            p50s = []
            with quantized_engine(backend), torch.inference_mode():
                for _ in range(args.repeats):
                    s = measure_latency(module, x, warmup=10, min_runs=50, min_time_s=args.min_time)
                    p50s.append(s.p50_ms)
            spread = (max(p50s) - min(p50s)) / statistics.median(p50s)
            spreads.append(spread)
            print(f"{name:<8} {bs:>5} {' '.join(f'{p:7.3f}' for p in p50s):<48} {spread:7.1%}")
            rows.append(f"| {name} | {bs} | {' '.join(f'{p:.3f}' for p in p50s)} | {spread:.1%} |")
            records.append({"variant": name, "batch": bs, "p50_ms": p50s, "spread": spread})
    median = statistics.median(spreads)
    print(f"median spread: {median:.1%} (target < 5%)")
    body = [
        f"- one process, the same module timed {args.repeats} times back to back per setting (10 warm-up "
        f"calls, >= 50 calls and {args.min_time:g} s each); spread = (max - min) / median of the p50s",
        "- this is the harness's own repeatability; differences between separate runs of `optimize` "
        "are larger (see the quickstart section)",
        "",
        *rows,
        "",
        f"Median spread: {median:.1%} (target < 5%).",
    ]
    command = "python benchmarks/harness_stability.py" + (
        f" --repeats {args.repeats}" if args.repeats != 5 else ""
    )
    write_section(
        "harness", "Latency harness repeatability", command, time.perf_counter() - t0, body, {"rows": records}
    )


if __name__ == "__main__":
    main()
