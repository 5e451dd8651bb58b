"""What each accuracy-recovery option costs and gives on torchvision resnet18 (issue #24: every
option at most 2 minutes on 2 cores; AdaRound's iterations are an option).

    .venv/bin/python benchmarks/recovery_cost.py [--quick] [--results-dir D]

resnet18 (random init, BatchNorm statistics recalibrated on the inputs, as
benchmarks/recovery.py's CNNs), synthetic 3x224x224 images, calibration and evaluation drawn
apart. `quantize.static` in FX mode (what `mode: auto` chooses for resnet18) is built without
recovery, then once per option: each algorithm alone, bias correction in both forms, AdaRound at
its default and at twice its iterations, the three most sensitive layers kept float, and `auto`
(at its defaults, and with a float_target that makes it try AdaRound and the float stage too).
Per option: the pass's wall time, the recovery's own (`info.recovery.seconds`: its calibration
runs and every candidate it built and judged included), its extra over the plain pass, what the
recovery log says it did (an algorithm that cannot apply says so), and cosine and top-1 agreement
with float on the evaluation images. One run each, one option at a time.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from common import agreement, cosine, out_dir, parser, publish, synthetic

from torchtame import apply_pass
from torchtame.training import recalibrate_batchnorm

LIMIT_S = 120  # the budget per option on 2 cores
DEFAULT_ITERATIONS = 100  # RecoveryOptions.adaround_iterations

ADAROUND_LONGER = f"adaround ({2 * DEFAULT_ITERATIONS} iterations)"
AUTO_EVERY_STAGE = "auto (float_target 0.9999: AdaRound and the float stage tried too)"
NOT_DEFAULTS = (ADAROUND_LONGER, AUTO_EVERY_STAGE)  # how time grows; not counted against the budget
# option name -> quantize.static options besides mode: fx
OPTIONS: dict[str, dict[str, Any]] = {
    "range_search": {"recovery": ["range_search"]},
    "equalization": {"recovery": ["equalization"]},
    "bias_correction (empirical)": {"recovery": ["bias_correction"]},
    "bias_correction (analytic)": {"recovery": ["bias_correction"], "bias_correction_form": "analytic"},
    "smoothquant": {"recovery": ["smoothquant"]},
    f"adaround ({DEFAULT_ITERATIONS} iterations, the default)": {"recovery": ["adaround"]},
    ADAROUND_LONGER: {
        "recovery": ["adaround"],
        "adaround_iterations": 2 * DEFAULT_ITERATIONS,
    },
    "sensitive_float (3 layers)": {"recovery": ["sensitive_float"], "float_layers": 3},
    "auto": {"recovery": "auto"},
    AUTO_EVERY_STAGE: {"recovery": "auto", "float_target": 0.9999},
}
QUICK = ("range_search", "bias_correction (empirical)", "smoothquant", "auto")


def _model(quick: bool) -> tuple[torch.nn.Module, Any]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    data = synthetic([3, 32, 32] if quick else [3, 224, 224], 32 if quick else 96, 8)
    recalibrate_batchnorm(model, [x for x, _ in data.calibration])
    return model, data


def _did(rec: dict[str, Any] | None) -> str:
    """What the recovery record says was done (or why nothing was)."""
    if not rec:
        return "-"
    if rec.get("mode") == "auto":
        tried = [t for t in rec["trials"] if "skipped" not in t]
        skipped = [" + ".join(t["algorithms"]) for t in rec["trials"] if "skipped" in t]
        text = "chose " + (" + ".join(rec["chosen"]) or "none") + f" after {len(tried)} trials"
        return text + (
            f" ({', '.join(skipped)} not needed: cheaper ones met float_target)" if skipped else ""
        )
    parts = []
    for a in rec.get("applied", []):
        what = a.get("applied")
        detail = f"{what} layers" if isinstance(what, int) and not isinstance(what, bool) else None
        if a.get("algorithm") == "sensitive_float":
            detail = ", ".join(a.get("layers", []))
        at = f"applied at {a['at']}" if "at" in a and what else None
        parts.append(f"{a['algorithm']}: {a.get('note') or detail or at or what}")
    return "; ".join(parts) or "-"


def measure(quick: bool, iterations: int | None) -> list[dict[str, Any]]:
    model, data = _model(quick)
    held = torch.cat([x for x, _ in data.evaluation])
    with torch.inference_mode():
        ref = model(held)
    rows = []
    for name, options in {"none": {}, **OPTIONS}.items():
        if quick and name not in ("none", *QUICK):
            continue
        how = {"mode": "fx", **options}
        if iterations is not None and "adaround_iterations" not in how:
            how["adaround_iterations"] = iterations
        t0 = time.perf_counter()
        v = apply_pass("quantize.static", model, data, how)
        seconds = time.perf_counter() - t0
        rec = v.info.get("recovery")
        with torch.inference_mode():
            out = v.module(held)
        rows.append(
            {
                "option": name,
                "options": how,
                "pass_s": round(seconds, 1),
                "recovery_s": None if rec is None else rec.get("seconds"),
                "did": _did(rec),
                "cosine": round(cosine(ref, out), 5),
                "agreement": round(agreement(ref, out), 2),
            }
        )
        print(rows[-1], flush=True)
    return rows


def render(data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    plain = rows[0]
    lines = [
        f"torchvision resnet18 (random init, BatchNorm statistics recalibrated), {data['image']}, "
        f"{data['calibration_images']} calibration and {data['evaluation_images']} evaluation images "
        "drawn apart; `quantize.static` mode fx; one run per option. recovery s: the recovery's own "
        "time (its calibration runs and every candidate it built and judged); extra s: the pass's "
        "time over the plain pass; cosine and agreement with float on the evaluation images:",
        "",
        "| recovery | pass s | recovery s | extra s | what it did | cosine | agreement % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        extra = "-" if r["option"] == "none" else f"{r['pass_s'] - plain['pass_s']:.1f}"
        rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
        lines.append(
            f"| {r['option']} | {r['pass_s']:.1f} | {rec} | {extra} | {r['did']} | {r['cosine']:.5f} "
            f"| {r['agreement']:.2f} |"
        )
    # the target is for each option at its defaults: AdaRound's iterations and auto's float_target
    # are options (their rows beyond the defaults show how the time grows)
    counted = [r for r in rows[1:] if r["option"] not in NOT_DEFAULTS]
    over = [r for r in counted if r["pass_s"] - plain["pass_s"] > LIMIT_S]
    worse = [r for r in rows[1:] if r["option"].startswith("auto") and r["cosine"] < plain["cosine"]]
    lines += [
        "",
        "Targets (issue #24):",
        "",
        f"- every recovery option at its defaults costs at most {LIMIT_S} s over the plain pass on "
        "resnet18 on 2 cores (rows beyond the defaults not counted: "
        + ", ".join(o for o in NOT_DEFAULTS if o in {r["option"] for r in rows})
        + "): "
        + (
            "met (largest: "
            + max(counted, key=lambda r: r["pass_s"])["option"]
            + f", {max(r['pass_s'] for r in counted) - plain['pass_s']:.1f} s)"
            if not over
            else "NOT met: " + ", ".join(f"{r['option']} {r['pass_s'] - plain['pass_s']:.1f} s" for r in over)
        ),
        "- `auto` never keeps a recovery that makes fidelity worse: "
        + ("met" if not worse else f"NOT met: cosine {worse[0]['cosine']:.5f} < {plain['cosine']:.5f}"),
    ]
    return lines


def main() -> None:
    ap = parser(__doc__, "32x32 images, 32 calibration images, 10 AdaRound steps, four options")
    args = ap.parse_args()
    out = out_dir(args)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    rows = measure(args.quick, 10 if args.quick else None)
    figures = {
        "rows": rows,
        "image": "3x32x32" if args.quick else "3x224x224",
        "calibration_images": 32 if args.quick else 96,
        "evaluation_images": 32 if args.quick else 96,
    }
    command = "python benchmarks/recovery_cost.py" + (" --quick" if args.quick else "")
    publish(
        out,
        "recovery_cost",
        "Cost of each recovery option",
        command,
        time.perf_counter() - t0,
        figures,
        render,
    )


if __name__ == "__main__":
    main()
