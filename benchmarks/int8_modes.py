"""Static int8: torch.ao FX versus PT2E (torchao, compiled), and what `mode: auto` chooses.

    .venv/bin/python benchmarks/int8_modes.py [--quick] [--batch 8] [--min-time 1.0] [--results-dir D]

Models: torchvision resnet18, mobilenet_v2, mobilenet_v3_small, timm tf_efficientnet_lite0
(random init; its convolutions are Conv2dSame subclasses that pad in forward), a ported
EfficientNet-style net whose Conv2d subclasses pad and call F.conv2d (tests/samepad.py: the shape
FX traces into functional convolutions), and the quickstart's digits CNN (trained here).
Random-weight models get BatchNorm statistics from the inputs first (otherwise the MobileNets'
activations are ~1e-9 and no int8 format or fidelity figure means anything). Inputs are synthetic
224x224 images (32x32 for the ported net, 8x8 digits for the CNN).

For each model: fp32 eager, FX int8 (eager kernels), PT2E int8 (torch.compile with freezing)
and, for reference, fp32 compiled, all timed side by side in one process (interleaved rounds in a
random order, medians; each speed-up with the lowest and highest single-round ratio in
brackets). Int8 layers are counted from each converted graph; cosine and top-1
agreement are against fp32 on held-out inputs.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.samepad

from common import (
    QUICK_ROUNDS,
    agreement,
    cosine,
    interleaved_rounds,
    medians,
    out_dir,
    parser,
    publish,
    ratio_ranges,
    with_spread,
)

from torchtame import apply_pass, load_data
from torchtame.data import DigitsData, SyntheticData
from torchtame.runtime import compiled, quantized_engine
from torchtame.training import recalibrate_batchnorm, train

ROUNDS = 5  # interleaved timing rounds: a speed-up's bracket is its lowest and highest round


def models(quick: bool) -> list[tuple[str, Any, Any]]:
    """(name, model, data) for each model of the benchmark."""
    import timm
    import torchvision
    from tests.samepad import ported_net

    from torchtame.zoo import digits_cnn

    out = []
    small = load_data(SyntheticData(source="synthetic", shape=[3, 32, 32], num_samples=64, batch_size=8), 0)
    out.append(("ported-samepad-net", ported_net(), small))
    if quick:  # the one model where FX and PT2E differ most
        return out
    digits = load_data(DigitsData(source="digits", batch_size=64), 0)
    torch.manual_seed(0)
    cnn = digits_cnn()
    train(cnn, digits.train, epochs=12, lr=3e-3)
    out.insert(0, ("digits-cnn", cnn.eval(), digits))
    images = load_data(
        SyntheticData(source="synthetic", shape=[3, 224, 224], num_samples=64, batch_size=8), 0
    )
    for name in ("resnet18", "mobilenet_v2", "mobilenet_v3_small"):
        torch.manual_seed(0)
        out.append((name, torchvision.models.get_model(name).eval(), images))
    torch.manual_seed(0)
    out.append(("tf_efficientnet_lite0", timm.create_model("tf_efficientnet_lite0").eval(), images))
    return out


def bench(
    name: str, model: torch.nn.Module, data: Any, batch: int, min_time: float, rounds: int = ROUNDS
) -> dict[str, Any]:
    if not data.has_labels:
        recalibrate_batchnorm(model, [x for x, _ in data.calibration])
    held_out = torch.cat([x for x, _ in data.evaluation])[:64]
    x = data.example_input(batch)
    row: dict[str, Any] = {"model": name}
    with torch.inference_mode():
        ref = model(held_out)
    variants: dict[str, Any] = {}
    for mode in ("fx", "pt2e", "auto"):
        t0 = time.perf_counter()
        try:
            v = apply_pass("quantize.static", copy.deepcopy(model), data, {"mode": mode})
        except Exception as exc:
            row[mode] = {"error": str(exc).splitlines()[0][:160]}
            print(f"  {mode}: failed: {row[mode]['error']}", flush=True)
            continue
        build_s = time.perf_counter() - t0
        fn = compiled(v.module) if v.compiled else v.module
        # torch.ao's x86 kernels pack weights for the first input shape they see: time a fresh copy
        # (a compiled module is timed as compiled: it was compiled for the timed batch first)
        timing = fn if v.compiled else copy.deepcopy(v.module)
        with quantized_engine(v.backend), torch.inference_mode():
            t0 = time.perf_counter()
            fn(x)
            first_call_s = time.perf_counter() - t0
            out = fn(held_out)
        graph = v.info["graph"]
        row[mode] = {
            "built_as": v.info["mode"],
            "int8_layers": f"{graph['int8_layers']}/{graph['weight_layers']}",
            "standalone_batchnorms": graph.get("standalone_batchnorms", 0),
            "cosine": round(cosine(ref, out), 5),
            "agreement": round(agreement(ref, out), 2),
            "build_s": round(build_s, 1),
            "compile_s": round(first_call_s, 1) if v.compiled else None,
            "reason": (v.info.get("mode_choice") or {}).get("reason"),
        }
        variants[mode] = (timing, v.backend)
    fp32_compiled = compiled(model)
    with torch.inference_mode():
        t0 = time.perf_counter()
        fp32_compiled(x)
        row["fp32_compile_s"] = round(time.perf_counter() - t0, 1)

    def timed(fn: Any, backend: str | None) -> Any:
        def run(v: Any) -> Any:
            with quantized_engine(backend):
                return fn(v)

        return run

    fns = {"fp32 eager": model, "fp32 compiled": fp32_compiled}
    fns.update({f"int8 {m}": timed(*variants[m]) for m in variants})
    per_round = interleaved_rounds(fns, x, rounds=rounds, min_time_s=min_time)
    p50 = medians(per_round)
    row["p50_ms"] = {k: round(v, 3) for k, v in p50.items()}
    row["ratio_ranges"] = ratio_ranges(per_round, ["fp32 eager", "fp32 compiled"])
    row["speedup_vs_fp32_eager"] = {k: round(p50["fp32 eager"] / v, 2) for k, v in p50.items()}
    for mode in ("fx", "pt2e", "auto"):
        if "error" not in row.get(mode, {"error": ""}):
            r = row[mode]
            speed = row["speedup_vs_fp32_eager"][f"int8 {mode}"]
            print(
                f"  {mode:<5} {r['int8_layers']:>6} int8, BN {r['standalone_batchnorms']:>2}, "
                f"cos {r['cosine']:.4f}, agree {r['agreement']:5.1f}%, {speed:.2f}x fp32 eager",
                flush=True,
            )
    return row


def markdown(rows: list[dict[str, Any]], batch: int) -> list[str]:
    head = [
        "model",
        "mode",
        "int8 layers",
        "unfolded BN",
        "cosine",
        "agreement %",
        f"b{batch} p50 ms",
        "vs fp32 eager",
        "vs fp32 compiled",
        "compile s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            f"| {r['model']} | fp32 eager | - | - | 1 | 100 | {r['p50_ms']['fp32 eager']:.3f} | 1.00x | - "
            "| - |"
        )
        spread = r.get("ratio_ranges", {})  # runs before it was recorded have none
        eager, comp = spread.get("fp32 eager", {}), spread.get("fp32 compiled", {})
        lines.append(
            f"| {r['model']} | fp32 compiled | - | - | 1 | 100 | {r['p50_ms']['fp32 compiled']:.3f} | "
            f"{with_spread(r['speedup_vs_fp32_eager']['fp32 compiled'], eager.get('fp32 compiled'))} | "
            f"1.00x | {r['fp32_compile_s']} |"
        )
        for mode in ("fx", "pt2e", "auto"):
            m = r.get(mode, {})
            if "error" in m:
                lines.append(f"| {r['model']} | int8 {mode} | failed: {m['error']} | | | | | | | |")
                continue
            label = f"int8 {mode}" + (f" (chose {m['built_as']})" if mode == "auto" else "")
            p50 = r["p50_ms"][f"int8 {mode}"]
            key = f"int8 {mode}"
            vs_compiled = (
                with_spread(r["p50_ms"]["fp32 compiled"] / p50, comp.get(key)) if m["compile_s"] else "-"
            )
            lines.append(
                f"| {r['model']} | {label} | {m['int8_layers']} | {m['standalone_batchnorms']} | "
                f"{m['cosine']:.4f} | {m['agreement']:.1f} | {p50:.3f} | "
                f"{with_spread(r['speedup_vs_fp32_eager'][key], eager.get(key))} | {vs_compiled} | "
                f"{m['compile_s'] or '-'} |"
            )
    lines += ["", "What `mode: auto` chose, and why:", ""]
    for r in rows:
        reason = (r.get("auto") or {}).get("reason") or (r.get("auto") or {}).get("error")
        lines.append(f"- {r['model']}: {reason}")
    lines += ["", "Targets (default static int8 = `mode: auto`):", ""]
    for r in rows:
        a = r.get("auto", {})
        if "error" in a:
            lines.append(f"- {r['model']}: auto failed -> NOT met")
            continue
        fast = r["speedup_vs_fp32_eager"]["int8 auto"]
        ok = fast > 1.0 and a["cosine"] >= 0.99
        lines.append(
            f"- {r['model']}: {fast:.2f}x fp32 eager at batch {batch}, cosine {a['cosine']:.4f}, agreement "
            f"{a['agreement']:.1f}% -> {'met' if ok else 'NOT met'} (faster than fp32 eager, cosine >= 0.99)"
        )
        if r["model"] == "tf_efficientnet_lite0":
            ok = a["agreement"] >= 95 and fast > 1.0
            lines.append(
                f"- {r['model']} (same-padding Conv2d subclasses): agreement {a['agreement']:.1f}% -> "
                f"{'met' if ok else 'NOT met'} (agreement >= 95% and faster than fp32 eager)"
            )
    return lines


def render(data: dict[str, Any]) -> list[str]:
    return [
        "Static int8 by graph mode. torch.ao FX runs its int8 kernels eagerly; PT2E (torchao's X86 "
        "Inductor quantizer on torchtame's normalised export) runs compiled with weight freezing, so "
        "it is shown against fp32 compiled the same way as well as against fp32 eager. Every row of "
        "a model is timed side by side in one process: interleaved rounds in a random order, median "
        "p50; in brackets, the lowest and highest single-round speed-up (paired by round: the machine's "
        "drift). Random-weight models have BatchNorm statistics from the inputs.",
        "",
        *markdown(data["rows"], data["batch"]),
    ]


def main() -> None:
    ap = parser(__doc__, "the ported net only, short timings")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--min-time", type=float, default=1.0)
    args = ap.parse_args()
    if args.quick:
        args.min_time = min(args.min_time, 0.05)
    out = out_dir(args)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    rows = []
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    for name, model, data in models(args.quick):
        print(name, flush=True)
        rows.append(bench(name, model, data, args.batch, args.min_time, rounds))
    command = "python benchmarks/int8_modes.py" + (" --quick" if args.quick else "")
    title = "Static int8: FX vs PT2E"
    figures = {"rows": rows, "batch": args.batch}
    publish(out, "int8_modes", title, command, time.perf_counter() - t0, figures, render)


if __name__ == "__main__":
    main()
