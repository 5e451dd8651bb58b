"""Single-step `recovery: auto` against the search, on one model, side by side.

    .venv/bin/python benchmarks/auto_vs_search.py [--quick] [--results-dir D]

The model is a torchvision mobilenet_v2 (width 0.5) trained here on the digits (real weights, real
inputs; torchtame.zoo.DigitsMobileNet), trained once and shared by every run (the
pipeline's training cache). Four runs of the same recipe, timed whole (baseline measurement,
building and measuring every variant; the model's training is left out):

- `strategy: search` with `min_cosine` and recovery off: the search as it was when issue #24 was
  filed (static int8 keeping the most sensitive layers float, onnxruntime int8 with each
  calibration method and excluded nodes);
- the same search with recovery on (its `-recovered` candidate is tried before keeping layers
  float);
- one step, `quantize.static` with `mode: pt2e, recovery: auto` (both single steps with
  `float_target` set to the search's `min_cosine`: with the default 0.995 auto skips AdaRound and
  the float stage once it passes 0.995, short of a 0.998 goal);
- one step, `quantize.onnx` with `recovery: auto` (onnxruntime, what the search picked last time).

Per run: wall time, what it chose (or built), cosine and top-1 agreement with fp32 on the digits'
evaluation split, and speed-up over fp32 at batch 64 with its 95% interval (the pipeline's three
paired rounds at the end of each run).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from common import QUICK_ROUNDS, out_dir, parser, publish

import torchtame

MIN_COSINE = 0.998
MODEL = {"source": "python", "target": "torchtame.zoo:DigitsMobileNet", "train": {"epochs": 10, "lr": 0.003}}
# --quick: the quickstart's CNN, narrow, FX (no compile step), so the script's path runs in seconds
QUICK_MODEL = {
    "source": "python",
    "target": "torchtame.zoo:digits_cnn",
    "kwargs": {"width": 8, "hidden": 32},
    "train": {"epochs": 2, "lr": 0.003},
}


def _recipe(name: str, work: Path, quick: bool, **extra: Any) -> dict[str, Any]:
    quick_timing = {"warmup": 2, "min_runs": 5, "min_time_s": 0.05, "rounds": QUICK_ROUNDS}
    rounds = quick_timing if quick else {"rounds": 3}
    return {
        "name": name,
        "seed": 0,
        "output_dir": str(work),
        "model": QUICK_MODEL if quick else MODEL,
        "data": {"source": "digits", "batch_size": 64},
        "devices": ["cpu"],
        "evaluate": {"metrics": ["top1", "fidelity"], "latency": {"batch_sizes": [64], **rounds}},
        **extra,
    }


SINGLE = ("one step, quantize.static recovery: auto", "one step, quantize.onnx recovery: auto")


def _mode(quick: bool) -> str:
    return "fx" if quick else "pt2e"


def _iterations(quick: bool) -> int:
    return 10 if quick else 200


def _figures(entry: dict[str, Any]) -> dict[str, Any]:
    acc = entry.get("accuracy") or {}
    timing = next((m for m in entry.get("latency") or [] if m["batch_size"] == 64), {})
    return {
        "variant": entry["name"],
        "cosine": round(acc.get("cosine_similarity", 0.0), 5),
        "agreement": round(acc.get("top1_agreement", 0.0), 2),
        "speedup_b64": timing.get("speedup"),
        "speedup_low": timing.get("speedup_low"),
        "speedup_high": timing.get("speedup_high"),
    }


def run_one(recipe: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The run's results and its wall time less the model's training (the first run trains and
    caches the model; the others load it)."""
    t0 = time.perf_counter()
    res = torchtame.run(recipe).results
    training = (res.get("model") or {}).get("training") or {}
    return res, round(time.perf_counter() - t0 - training.get("seconds", 0.0), 1)


def search_row(work: Path, quick: bool, recovery: bool) -> dict[str, Any]:
    qopts = {"mode": _mode(quick), "adaround_iterations": _iterations(quick)}
    search = {"prune": False, "qat": False, "recovery": recovery, "quantize_options": qopts}
    if quick:
        search.update(sensitivity=False, onnx=False)
    name = "search-recovery" if recovery else "search"
    recipe = _recipe(name, work, quick, strategy="search", search=search)
    recipe["constraints"] = {"min_cosine": MIN_COSINE, "batch_size": 64}
    res, seconds = run_one(recipe)
    sel = res.get("selection") or {}
    picked = sel.get("chosen") or sel.get("best_found")
    by = {v["name"]: v for v in res["variants"]}
    row = {"seconds": seconds, "met": bool(sel.get("chosen")), "candidates": res["search"]["candidates"]}
    if picked in by:
        row.update(_figures(by[picked]))
    if recovery:
        row["recovery"] = res["search"].get("recovery", {})
    return row


def auto_row(work: Path, quick: bool, pass_name: str) -> dict[str, Any]:
    options: dict[str, Any] = {"recovery": "auto", "adaround_iterations": _iterations(quick)}
    options["float_target"] = MIN_COSINE  # the search's goal: auto stops short of it otherwise
    if pass_name == "quantize.static":
        options["mode"] = _mode(quick)
    steps = [{"name": "int8-auto", "pass": pass_name, "options": options}]
    res, seconds = run_one(_recipe(f"auto-{pass_name}", work, quick, steps=steps))
    entry = next(v for v in res["variants"] if v["name"] == "int8-auto")
    rec = entry["info"]["recovery"]
    row = {"seconds": seconds, **_figures(entry), "chosen": rec["chosen"], "auto_s": rec["seconds"]}
    row["met"] = row["cosine"] >= MIN_COSINE
    row["trials"] = len(rec["trials"])
    row["exports"] = rec.get("exports")
    return row


def render(data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    lines = [
        f"{data['model']}; constraint `min_cosine: {data['min_cosine']}` at batch 64; wall time of the "
        "whole run (baseline measurement, every variant built and measured; training excluded); the "
        "single steps get the same goal as `float_target`.",
        "",
        "| run | wall s | variant | meets | cosine | agreement % | speed-up b64 |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        speed = "-" if r.get("speedup_b64") is None else f"{r['speedup_b64']:.2f}x"
        if r.get("speedup_low") is not None:
            speed += f" [{r['speedup_low']:.2f}, {r['speedup_high']:.2f}]"
        lines.append(
            f"| {label} | {r['seconds']:.0f} | `{r.get('variant', '-')}` | {'yes' if r['met'] else 'no'} | "
            f"{r.get('cosine', 0):.5f} | {r.get('agreement', 0):.2f} | {speed} |"
        )
    search = rows["search (recovery off)"]
    lines += ["", "Search candidates (recovery off): " + ", ".join(search["candidates"]) + "."]
    verdicts = []
    for label in SINGLE:
        auto = rows[label]
        ratio = auto["seconds"] / search["seconds"]
        ok = ratio < 0.5 and auto.get("cosine", 0) >= search.get("cosine", 0) - 1e-4
        verdicts.append(ok)
        exports = auto.get("exports")
        shared = f"; {exports['exported']} export(s), {exports['reused']} reused" if exports else ""
        lines.append(
            f"- {label}: chose {' + '.join(auto['chosen']) or 'none'} after {auto['trials']} trials "
            f"({auto['auto_s']:.0f} s of its step{shared}); {auto['seconds']:.0f} s vs the search's "
            f"{search['seconds']:.0f} s ({ratio:.2f} of it), cosine {auto.get('cosine', 0):.5f} vs "
            f"{search.get('cosine', 0):.5f} -> {'met' if ok else 'NOT met'}"
        )
    lines += [
        "",
        "Target (#24): a single step with `recovery: auto` reaches what the search reaches in under half "
        "its time -> " + ("met" if any(verdicts) else "NOT met"),
    ]
    return lines


def main() -> None:
    ap = parser(__doc__, "a narrow digits CNN through FX, no sensitivity or onnxruntime, short timings")
    args = ap.parse_args()
    out = out_dir(args)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="torchtame-bench-"))
    rows = {
        "search (recovery off)": search_row(work, args.quick, recovery=False),
        "search (recovery on)": search_row(work, args.quick, recovery=True),
        SINGLE[0]: auto_row(work, args.quick, "quantize.static"),
        SINGLE[1]: auto_row(work, args.quick, "quantize.onnx"),
    }
    for label, row in rows.items():
        print(label, row, flush=True)
    data = {
        "model": "mobilenet_v2 (width 0.5) trained on the digits",
        "min_cosine": MIN_COSINE,
        "rows": rows,
    }
    command = "python benchmarks/auto_vs_search.py" + (" --quick" if args.quick else "")
    title = "Single-step recovery against the search"
    publish(out, "auto_vs_search", title, command, time.perf_counter() - t0, data, render)


if __name__ == "__main__":
    main()
