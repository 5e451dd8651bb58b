"""How repeatable is the latency harness? Measure one variant 5 times and print the spread.

    .venv/bin/python benchmarks/harness_stability.py [--repeats 5] [--batch 1 64]

Spread of one setting = (max p50 - min p50) / median p50 over the repeats. The target on the
2-core development machine is a median spread under 5% (see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

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
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats")
    print(f"{'variant':<8} {'batch':>5} {'p50 per repeat (ms)':<48} {'spread':>7}")
    spreads = []
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
    print(f"median spread: {statistics.median(spreads):.1%} (target < 5%)")


if __name__ == "__main__":
    main()
