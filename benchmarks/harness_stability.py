"""How repeatable is the latency harness? Measure one variant 5 times and print the spread.

    .venv/bin/python benchmarks/harness_stability.py [--repeats 5] [--batch 1 64] [--quick]

Spread of one setting = (max p50 - min p50) / median p50 over the repeats. The target on the
2-core development machine is a median spread under 5%; the figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import torch
from common import out_dir, parser, publish

from torchtame.data import DigitsData, load_data
from torchtame.evaluate.latency import measure_latency
from torchtame.pipeline import apply_pass
from torchtame.runtime import quantized_engine
from torchtame.zoo import digits_cnn


def render(data: dict[str, Any]) -> list[str]:
    rows = ["| variant | batch | p50 per repeat (ms) | spread |", "|---|---|---|---|"]
    for r in data["rows"]:
        p50s = " ".join(f"{p:.3f}" for p in r["p50_ms"])
        rows.append(f"| {r['variant']} | {r['batch']} | {p50s} | {r['spread']:.1%} |")
    median = statistics.median(r["spread"] for r in data["rows"])
    return [
        f"- one process, the same module timed {data['repeats']} times back to back per setting (10 warm-up "
        f"calls, >= {data['min_runs']} calls and {data['min_time']:g} s each); spread = (max - min) / median "
        "of the p50s",
        "- this is the harness's own repeatability; differences between separate runs of `optimize` "
        "are larger (see the quickstart section)",
        "",
        *rows,
        "",
        f"Median spread: {median:.1%} (target < 5%).",
    ]


def main() -> None:
    ap = parser(__doc__, "2 repeats of batch 1, 0.05 s each")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--min-time", type=float, default=1.0)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.batch, args.min_time = 2, [1], 0.05
    min_runs = 5 if args.quick else 50
    warnings.filterwarnings("ignore")
    data = load_data(DigitsData(source="digits", batch_size=64), 0)
    fp32 = digits_cnn().eval()
    int8 = apply_pass("quantize.static", fp32, data)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats")
    records = []
    for name, module, backend in (("fp32", fp32, None), ("int8", int8.module, int8.backend)):
        for bs in args.batch:
            x = data.example_input(bs)
            p50s = []
            with quantized_engine(backend), torch.inference_mode():
                for _ in range(args.repeats):
                    s = measure_latency(module, x, warmup=10, min_runs=min_runs, min_time_s=args.min_time)
                    p50s.append(round(s.p50_ms, 5))
            spread = (max(p50s) - min(p50s)) / statistics.median(p50s)
            print(f"{name:<8} {bs:>5} {' '.join(f'{p:7.3f}' for p in p50s):<48} {spread:7.1%}")
            records.append({"variant": name, "batch": bs, "p50_ms": p50s, "spread": round(spread, 5)})
    command = (
        "python benchmarks/harness_stability.py"
        + (" --quick" if args.quick else "")
        + (f" --repeats {args.repeats}" if args.repeats != 5 and not args.quick else "")
    )
    figures = {"repeats": args.repeats, "min_time": args.min_time, "min_runs": min_runs, "rows": records}
    title = "Latency harness repeatability"
    publish(out_dir(args), "harness", title, command, time.perf_counter() - t0, figures, render)


if __name__ == "__main__":
    main()
