"""report.md: the variant table, skipped devices, failures, environment and settings."""

from __future__ import annotations

from typing import Any

from .rows import fmt_num, human_count, latency_keys, rows_from_results


def variant_table_md(results: dict[str, Any]) -> str:
    rows = rows_from_results(results)
    keys = latency_keys(rows)
    head = ["variant", "from", "pass", "dtype", "top-1 %", "drop (pts)", "agreement %", "size MB",
            "size ratio", "params", "MACs"]
    for device, bs in keys:
        head += [f"{device} b{bs} p50 ms", f"p90 ms", "speed-up"]
    head.append("status")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r.name}`", r.parent or "", r.pass_name, r.dtype]
        if r.status != "ok":
            cells += ["-"] * (7 + 3 * len(keys)) + [f"failed: {(r.error or '').splitlines()[0][:120]}"]
        else:
            cells += [
                fmt_num(r.top1) if r.top1 is not None else "not measured",
                fmt_num(r.top1_drop),
                fmt_num(r.agreement),
                fmt_num(r.size_mb, 3),
                fmt_num(r.size_ratio, 3),
                human_count(r.params),
                human_count(r.macs),
            ]
            for k in keys:
                m = r.latency.get(k)
                s = r.speedup.get(k)
                skipped = next((x["reason"] for x in r.skipped if x["device"] == k[0]), None)
                cells += [
                    fmt_num(m["p50_ms"], 3) if m else (skipped.split(" (")[0] if skipped else "-"),
                    fmt_num(m["p90_ms"], 3) if m else "-",
                    f"{s:.2f}x" if s else "-",
                ]
            cells.append("ok")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def render_markdown(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    settings = results.get("settings", {})
    lat = settings.get("latency", {})
    out = [
        f"# torchtame report: {results.get('recipe')}",
        "",
        f"Status: **{results.get('status')}**. Started {results.get('started')}, "
        f"finished {results.get('finished')}.",
        "",
    ]
    if results.get("error"):
        out += [f"> Run error: {results['error']}", ""]
    data = results.get("data") or {}
    if data:
        out += [f"Data: {data.get('description')}; accuracy "
                + ("on labelled evaluation data." if data.get("has_labels") else
                   "not measured (no labels); fidelity is agreement with the baseline."), ""]
    out += ["## Variants", "", variant_table_md(results), ""]
    out += [
        f"Latency: median (p50) and p90 of at least {lat.get('min_runs')} timed calls and "
        f"{lat.get('min_time_s')} s after {lat.get('warmup')} warm-up calls, "
        f"{settings.get('threads')} threads; speed-up is baseline p50 / variant p50 on the same "
        "device, batch size and thread count. Size is the saved artefact's bytes.",
        "",
    ]
    skipped = {
        (d["device"], d["reason"]) for v in results["variants"] for d in v.get("skipped_devices", [])
    }
    if skipped:
        out += ["## Not measured", ""]
        out += [f"- {dev}: {reason}" for dev, reason in sorted(skipped)]
        out.append("")
    failed = [v for v in results["variants"] if v["status"] != "ok"]
    if failed:
        out += ["## Failures", ""]
        out += [f"- `{v['name']}` ({v.get('pass')}): {v.get('error')}" for v in failed]
        out.append("")
    cpu = env.get("cpu", {})
    cuda = env.get("cuda", {})
    gpus = ", ".join(f"{d['name']} ({d['memory_gib']} GiB, sm {d['capability']})" for d in cuda.get("devices", []))
    out += [
        "## Environment",
        "",
        f"- torch {env.get('torch')}, Python {env.get('python')}, {env.get('platform')}",
        f"- CPU: {cpu.get('processor')} ({cpu.get('logical_cores')} logical cores, "
        f"{cpu.get('torch_threads')} torch threads), quantized engines: "
        f"{', '.join(cpu.get('quantized_engines', []))}",
        f"- CUDA: {gpus or 'not available'}",
        f"- onnxruntime {env.get('onnxruntime', {}).get('version')}: "
        f"{', '.join(env.get('onnxruntime', {}).get('providers', []))}",
        "",
    ]
    if results.get("warnings"):
        total = sum(results["warnings"].values())
        out += [f"Library warnings caught and summarised: {total} "
                f"({len(results['warnings'])} distinct; see results.json).", ""]
    return "\n".join(out)
