"""What every benchmark here shares: the machine line, side-by-side timing, RESULTS.md sections.

Timing: every row of a comparison (the fp32 reference included) is timed in each of ``rounds``
rounds, in a new random order each round, with torchtame's harness; a row keeps the median of its
p50s, and a speed-up the lowest and highest single-round ratio beside it. Machine drift then hits
all rows alike instead of the ones timed last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import random
import re
import statistics
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from torchtame import load_data
from torchtame.data import SyntheticData
from torchtame.evaluate.latency import measure_latency
from torchtame.inputs import call

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
# timing rounds of a --quick run: two, the fewest that give a speed-up its spread (paired rounds)
QUICK_ROUNDS = 2


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:  # the CPU model and whether it has VNNI: int8 kernels differ with it (torchtame.runtime)
        from torchtame.runtime import has_vnni

        lines = Path("/proc/cpuinfo").read_text().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        cpu = f"{names[0] if names else cpu} ({'VNNI' if has_vnni() else 'no VNNI'})"
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {torch.get_num_threads()} torch threads, {gpu}; torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def interleaved_rounds(
    fns: dict[str, Callable[[Any], Any]],
    x: Any,
    rounds: int = 3,
    min_time_s: float = 1.0,
    seed: int = 0,
    contexts: dict[str, Callable[[], AbstractContextManager[Any]]] | None = None,
) -> dict[str, list[float]]:
    """Each callable's p50 (ms) in every one of ``rounds`` rounds (paired by round), the callables
    in a new random order each round; a row's figure is the median of its rounds, and a speed-up's
    spread the lowest and highest single-round ratio (:func:`ratio_ranges`).

    ``contexts[name]()`` is entered around that callable's timing (a quantized engine, the
    attention fast-path switch), so every row runs under its own settings in the shared rounds.
    """
    rng = random.Random(seed)
    contexts = contexts or {}
    p50s: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        order = list(fns)
        rng.shuffle(order)
        for name in order:
            with contexts.get(name, contextlib.nullcontext)(), torch.inference_mode():
                stats = measure_latency(
                    lambda v, f=fns[name]: call(f, v), x, warmup=3, min_runs=10, min_time_s=min_time_s
                )
            p50s[name].append(stats.p50_ms)
    return p50s


def medians(per_round: dict[str, list[float]]) -> dict[str, float]:
    """Each row's figure: the median of its rounds' p50s (:func:`interleaved_rounds`)."""
    return {name: statistics.median(v) for name, v in per_round.items()}


def ratio_ranges(per_round: dict[str, list[float]], refs: list[str]) -> dict[str, dict[str, list[float]]]:
    """For each reference row in ``refs``, every row's lowest and highest single-round speed-up over
    it (paired by round, :func:`interleaved_rounds`): the spread the machine's drift gives a ratio
    of medians. ``{ref: {row: [low, high]}}``."""
    return {
        ref: {
            name: [round(min(r), 3), round(max(r), 3)]
            for name, times in per_round.items()
            for r in [[a / b for a, b in zip(per_round[ref], times, strict=True)]]
        }
        for ref in refs
    }


def with_spread(ratio: float, spread: list[float] | None, digits: int = 2, unit: str = "x") -> str:
    """``5.21x [4.80, 5.60]``: a speed-up and its rounds' spread (none where a run predates it);
    ``unit=""`` for a ratio that is not a speed-up (``0.99 [0.98, 1.00]``)."""
    return f"{ratio:.{digits}f}{unit}" + (
        f" [{spread[0]:.{digits}f}, {spread[1]:.{digits}f}]" if spread else ""
    )


def cosine(ref: torch.Tensor, out: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(ref.flatten(1).float(), out.flatten(1).float()).mean().item()


def synthetic(shape: list[int], n: int, batch: int, train: int = 0) -> Any:
    """Synthetic inputs of ``shape`` (calibration, evaluation and ``train`` samples of a train
    split drawn apart), seed 0."""
    spec = SyntheticData(
        source="synthetic", shape=shape, num_samples=n, batch_size=batch, train_samples=train
    )
    return load_data(spec, 0)


def agreement(ref: torch.Tensor, out: torch.Tensor) -> float:
    return 100.0 * (ref.argmax(-1) == out.argmax(-1)).float().mean().item()


def parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """Every benchmark's arguments: ``--quick`` (tiny sizes, written to a scratch directory unless
    ``--results-dir`` says where) and ``--results-dir``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{quick_help}; writes to a scratch directory")
    ap.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where RESULTS.md and results/*.json go (default: benchmarks/, or a scratch dir with --quick)",
    )
    return ap


def shortened(raw: dict[str, Any], rounds: int | None = None) -> dict[str, Any]:
    """A recipe (as a dict) with the short training and timings every ``--quick`` mode uses."""
    raw["model"]["train"]["epochs"] = 2
    raw["export"]["onnx"] = False
    raw["evaluate"]["memory"] = False
    raw["evaluate"]["latency"].update(min_time_s=0.02, min_runs=5)
    if rounds is not None:
        raw["evaluate"]["latency"]["rounds"] = rounds
    return raw


def out_dir(args: argparse.Namespace) -> Path:
    """benchmarks/ for a real run; a scratch directory (or ``--results-dir``) for ``--quick``."""
    if args.results_dir is not None:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        return Path(args.results_dir)
    return Path(tempfile.mkdtemp(prefix="torchtame-bench-")) if args.quick else HERE


def section_text(name: str, data: dict[str, Any], render: Callable[[dict[str, Any]], list[str]]) -> str:
    """A RESULTS.md section, rendered from its JSON alone (``meta`` and what ``render`` reads)."""
    meta = data["meta"]
    head = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; took {meta['seconds']:.0f} s",
        f"- machine: {meta['machine']}",
        f"- raw figures: `benchmarks/results/{name}.json`",
        "",
    ]
    title = [f"<!-- {name}:start -->", f"## {meta['title']}", ""]
    return "\n".join([*title, *head, *render(data), f"<!-- {name}:end -->"])


def publish(
    out: Path,
    name: str,
    title: str,
    command: str,
    seconds: float,
    data: dict[str, Any],
    render: Callable[[dict[str, Any]], list[str]],
) -> str:
    """Write ``out/results/NAME.json`` (the figures and how they were made) and replace this
    benchmark's section of ``out/RESULTS.md`` with what ``render`` makes of that JSON."""
    meta = {
        "title": title,
        "command": command,
        "date": dt.date.today().isoformat(),
        "seconds": round(seconds, 1),
        "machine": machine(),
    }
    data = {"meta": meta, **data}
    (out / "results").mkdir(parents=True, exist_ok=True)
    text_json = json.dumps(data, indent=2, default=_plain) + "\n"
    (out / "results" / f"{name}.json").write_text(text_json, encoding="utf-8")
    section = section_text(name, json.loads(text_json), render)  # exactly what a re-render sees
    results = out / "RESULTS.md"
    text = results.read_text(encoding="utf-8") if results.is_file() else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- {name}:start -->.*?<!-- {name}:end -->", re.S)
    text = (
        pattern.sub(lambda _: section, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + section + "\n"
    )
    results.write_text(text, encoding="utf-8")
    print(f"wrote {results} (section {name}) and {out / 'results' / f'{name}.json'}")
    return section


def _plain(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


# --------------------------------------------------------------------------- the README's figures


def _load(results: Path, name: str) -> dict[str, Any]:
    return json.loads((results / f"{name}.json").read_text(encoding="utf-8"))


def _row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def run_spreads(quick: dict[str, Any]) -> list[float]:
    """(max - min) / median of each variant's speed-up over the quickstart benchmark's runs."""
    runs = quick["runs"]
    spreads = []
    for name, figures in runs[0]["speedups"].items():
        for key in figures:
            values = [r["speedups"].get(name, {}).get(key, [None])[0] for r in runs]
            values = [v for v in values if v is not None]
            if name != "baseline" and len(values) > 1:
                spreads.append((max(values) - min(values)) / statistics.median(values))
    return spreads


def readme_figures(results: Path = HERE / "results") -> str:
    """The README's benchmark bullets, every figure read from the JSON named beside it."""
    peers, modes = _load(results, "peers"), _load(results, "int8_modes")
    unlabeled, ray = _load(results, "unlabeled"), _load(results, "ray_cluster")
    quick, harness = _load(results, "quickstart"), _load(results, "harness")
    rows = peers["rows"]
    lines = []
    twins = [
        r["b8_vs_direct"]
        for r in rows
        if r["model"] == "resnet18" and r["who"] == "torchtame" and r.get("b8_vs_direct")
    ]
    q = _row(rows, model="resnet18", approach="int8 static (torch.ao)", who="torchtame")
    pq = _row(rows, model="resnet18", approach="pruned 50% + int8", who="torchtame")
    if twins and q and pq:
        speed = with_spread(q["b8_speedup"], q.get("b8_speedup_range"), digits=1)
        lines.append(
            f"- `python benchmarks/peers.py` (`results/peers.json`): on resnet18 torchtame's rows run at "
            f"{min(twins):.2f}-{max(twins):.2f}x the speed of their direct twins (same graphs, same "
            f"kernels); its static int8 keeps cosine {q['cosine']:.4f} to fp32, is {speed} "
            f"faster than fp32 eager at batch 8 and {q['size_ratio']:.2f}x smaller; pruned 50% + "
            f"int8 reads {pq['b8_speedup']:.1f}x but is marked `{pq['verdict']}` (cosine "
            f"{pq['cosine']:.2f} without fine-tuning), so it counts in no target."
        )
    fx = _row(rows, model="mobilenet_v3_small", approach="int8 static (torch.ao)", who="torchtame")
    auto = next((r for r in rows if r["model"] == "mobilenet_v3_small" and "auto" in r["approach"]), None)
    if fx and auto:
        compiled = (
            f", {with_spread(auto['b8_vs_compiled'], auto.get('b8_vs_compiled_range'))} fp32 compiled"
            if auto.get("b8_vs_compiled")
            else ""
        )
        lines.append(
            f"- mobilenet_v3_small: FX int8 cosine {fx['cosine']:.3f}; `mode: auto` ({auto['approach']}) "
            f"cosine {auto['cosine']:.3f}, {with_spread(auto['b8_speedup'], auto.get('b8_speedup_range'))} "
            f"fp32 eager at batch 8{compiled} "
            "(`results/peers.json`)."
        )
    ref = next((r for r in rows if r["model"] == "transformer-encoder" and "default" in r["approach"]), None)
    dyn = _row(rows, model="transformer-encoder", approach="int8 dynamic (torch.ao)", who="torchtame")
    plain = _row(rows, model="transformer-encoder", approach="fp32 eager, no fast path")
    if ref and dyn and plain:
        speed = with_spread(dyn["b8_speedup"], dyn.get("b8_speedup_range"))
        lines.append(
            f"- Transformer encoder, dynamic int8: {speed} PyTorch's default fp32 (attention fast path "
            f"on) at batch 8, {plain['b8_ms'] / dyn['b8_ms']:.2f}x fp32 without the "
            "fast path (`results/peers.json`)."
        )
    for r in modes["rows"]:
        a = r.get("auto") or {}
        if "error" in a or not a:
            lines.append(f"- `python benchmarks/int8_modes.py`, {r['model']}: auto failed: {a.get('error')}")
            continue
        p50, spread = r["p50_ms"], r.get("ratio_ranges", {})
        eager = with_spread(
            r["speedup_vs_fp32_eager"]["int8 auto"], spread.get("fp32 eager", {}).get("int8 auto")
        )
        comp = with_spread(
            p50["fp32 compiled"] / p50["int8 auto"], spread.get("fp32 compiled", {}).get("int8 auto")
        )
        lines.append(
            f"- `int8_modes.py` (`results/int8_modes.json`), {r['model']}: `mode: auto` built "
            f"{a['built_as']}, {a['int8_layers']} layers int8, cosine {a['cosine']:.4f}, "
            f"{eager} fp32 eager at batch {modes['batch']}, {comp} fp32 compiled."
        )
    lines += _recovery_figures(results)
    d, rn = unlabeled["digits"], unlabeled["resnet18"]
    speed = with_spread(d["chosen_speedup_b64"], d.get("chosen_speedup_b64_interval"))
    lines.append(
        f"- `python benchmarks/unlabeled.py` (`results/unlabeled.json`): without labels the digits search "
        f"chooses `{d['chosen']}`, agreement {d['chosen_agreement']:.2f}%, {speed} fp32 at batch 64"
        + (" (95% interval)" if d.get("chosen_speedup_b64_interval") else "")
        + "; distillation takes a half-pruned resnet18 from cosine "
        f"{rn['pruned_cosine']:.2f} to {rn['distilled_cosine']:.2f} in {rn['steps']} steps."
    )
    lines.append(
        f"- `python benchmarks/ray_cluster.py` (`results/ray_cluster.json`): the search recipe took "
        f"{ray['local']['wall_s']:.0f} s locally and {ray['ray_2_nodes']['wall_s']:.0f} s on two loopback "
        "Ray nodes on the same 2 cores (Ray's overhead, not a speed-up)."
    )
    spreads = run_spreads(quick)
    if spreads:
        lines.append(
            f"- `python benchmarks/quickstart.py` (`results/quickstart.json`): over "
            f"{len(quick['runs'])} runs a speed-up moves by a median {statistics.median(spreads):.1%} "
            "(max - min over the median), the intervals of each run are in RESULTS.md."
        )
    hs = [r["spread"] for r in harness["rows"]]
    lines.append(
        f"- `python benchmarks/harness_stability.py` (`results/harness.json`): timing the same module "
        f"{harness['repeats']} times back to back, the median spread is {statistics.median(hs):.1%}."
    )
    return "\n".join(lines)


def _recovery_figures(results: Path) -> list[str]:
    """README bullets of the recovery and Transformer int8 benchmarks (when they have run)."""
    lines = []
    if (results / "recovery.json").is_file():
        for r in _load(results, "recovery")["rows"]:
            plain, best = r.get("pt2e") or r.get("onnx MinMax"), r.get("pt2e recovery auto")
            best = best or r.get("onnx recovery auto")
            if not plain or not best:
                continue
            floor = r.get("weights_only")
            chosen = " + ".join(best.get("chosen", [])) or "none"
            lines.append(
                f"- `recovery.py` (`results/recovery.json`), {r['model']}: int8 cosine {plain['cosine']:.4f} "
                f"(agreement {plain['agreement']:.1f}%) -> {best['cosine']:.4f} ({best['agreement']:.1f}%) "
                f"with `recovery: auto` (chose {chosen})"
                + (
                    f"; int8 weights alone: {floor['cosine']:.4f} ({floor['agreement']:.1f}%)."
                    if floor
                    else "."
                )
            )
    if (results / "recovery_cost.json").is_file():
        rows = _load(results, "recovery_cost")["rows"]
        extra = {r["option"]: r["pass_s"] - rows[0]["pass_s"] for r in rows[1:]}
        lines.append(
            "- `recovery_cost.py` (`results/recovery_cost.json`): on resnet18 at 224x224 (2 cores), over "
            f"the {rows[0]['pass_s']:.0f} s static int8 pass: "
            + ", ".join(f"{k} +{v:.0f} s" for k, v in extra.items())
            + "."
        )
    if (results / "transformer_int8.json").is_file():
        t = _load(results, "transformer_int8")
        p50, row = t["p50_ms"], t["rows"]["int8 pt2e"]
        spread = t.get("ratio_ranges", {}).get("fp32 eager (SDPA)", {}).get("int8 pt2e")
        speed = with_spread(p50["fp32 eager (SDPA)"] / p50["int8 pt2e"], spread)
        lines.append(
            f"- `transformer_int8.py` (`results/transformer_int8.json`): MiniLM-sized BertModel, static "
            f"int8 (PT2E) cosine {row['cosine']:.4f}, {speed} fp32 eager with SDPA at batch {t['batch']}, "
            f"sequence {t['length']}."
        )
    return lines


def quickstart_note(results: Path = HERE / "results") -> str:
    """How long the quickstart took and how much its speed-ups move between runs."""
    quick = _load(results, "quickstart")
    runs = quick["runs"]
    spreads = run_spreads(quick)
    later = ""
    if len(runs) > 1:
        cached = statistics.median(r["seconds"] for r in runs[1:])
        later = f", {cached:.0f} s once the trained model is cached"
    moved = statistics.median(spreads) if spreads else None
    # a quiet machine moves a speed-up by a percent or two between runs, a shared one by 20% (the
    # spread this script measured on busier days): the advice follows what this run measured
    advice = (
        "so read the second digit with care."
        if moved is not None and moved >= 0.05
        else "this machine was quiet (a shared one moves them by 20% or more)."
    )
    spread = (
        f" Between {len(runs)} separate runs a speed-up moved by a median {moved:.0%} "
        f"(max - min over the median; every run's figures with their intervals are in RESULTS.md), {advice}"
        if moved is not None
        else ""
    )
    return (
        f"The committed quickstart run took {runs[0]['seconds']:.0f} s on 2 CPU cores{later} "
        f"(`benchmarks/results/quickstart.json`).{spread}"
    )


def quickstart_table(results: Path = HERE / "results") -> str:
    """The quickstart's table, as the committed run's `optimize` printed it."""
    from quickstart import table_text

    return "```\n" + table_text(_load(results, "quickstart")["first_results"]) + "\n```"


README_BLOCKS = {
    "figures": readme_figures,
    "quickstart-note": quickstart_note,
    "quickstart-table": quickstart_table,
}


def readme_blocks(text: str, results: Path = HERE / "results") -> str:
    """``text`` (the README) with every generated block re-rendered from the JSON."""
    for name, render in README_BLOCKS.items():
        block = f"<!-- {name}:start -->\n{render(results)}\n<!-- {name}:end -->"
        pattern = rf"<!-- {name}:start -->.*?<!-- {name}:end -->"
        text = re.sub(pattern, lambda _, b=block: b, text, flags=re.S)
    return text


def write_readme_figures() -> None:
    """Replace the README's generated blocks with what the committed JSON says."""
    readme = HERE.parent / "README.md"
    readme.write_text(readme_blocks(readme.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":  # python benchmarks/common.py: the README's figures from the JSON
    write_readme_figures()
