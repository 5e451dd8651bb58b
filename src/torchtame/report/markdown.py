"""report.md: the variant table, skipped devices, failures, environment and settings.

The table cells and the sections are built once here (``variant_table_cells``, ``sections``)
and rendered by both the Markdown and the HTML report.
"""

from __future__ import annotations

from typing import Any

from .rows import fmt_num, human_count, latency_keys, rows_from_results


def variant_table_cells(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one list of cells per variant (the last cell is the status)."""
    rows = rows_from_results(results)
    keys = latency_keys(rows)
    head = ["variant", "from", "pass", "dtype", "top-1 %", "drop (pts)", "agreement %", "size MB",
            "size ratio", "params", "MACs"]  # fmt: skip
    for device, bs in keys:
        head += [f"{device} b{bs} p50 ms", "p90 ms", "speed-up"]
    head.append("status")
    body = []
    for r in rows:
        cells = [r.name, r.parent or "", r.pass_name, r.dtype]
        if r.status != "ok":
            error = (r.error or "").splitlines()[0][:160]
            body.append([*cells, *["-"] * (7 + 3 * len(keys)), f"failed: {error}"])
            continue
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
        body.append([*cells, "ok"])
    return head, body


def latency_note(results: dict[str, Any]) -> str:
    settings = results.get("settings", {})
    lat = settings.get("latency", {})
    return (
        f"Latency: median (p50) and p90 of at least {lat.get('min_runs')} timed calls and "
        f"{lat.get('min_time_s')} s after {lat.get('warmup')} warm-up calls, "
        f"{settings.get('threads')} threads; speed-up is baseline p50 / variant p50 on the same "
        "device, batch size and thread count. Size is the saved artefact's bytes."
    )


def sections(results: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(title, bullet items) of the sections after the table."""
    out: list[tuple[str, list[str]]] = []
    skipped = {(d["device"], d["reason"]) for v in results["variants"] for d in v.get("skipped_devices", [])}
    if skipped:
        out.append(("Not measured", [f"{dev}: {reason}" for dev, reason in sorted(skipped)]))
    failed = [v for v in results["variants"] if v["status"] != "ok"]
    if failed:
        out.append(("Failures", [f"{v['name']} ({v.get('pass')}): {v.get('error')}" for v in failed]))
    env = results.get("environment", {})
    cpu, cuda, ort = env.get("cpu", {}), env.get("cuda", {}), env.get("onnxruntime", {})
    gpus = ", ".join(
        f"{d['name']} ({d['memory_gib']} GiB, sm {d['capability']})" for d in cuda.get("devices", [])
    )
    items = [
        f"torch {env.get('torch')}, Python {env.get('python')}, {env.get('platform')}",
        f"CPU: {cpu.get('processor')} ({cpu.get('logical_cores')} logical cores, "
        f"{cpu.get('torch_threads')} torch threads), quantized engines: "
        f"{', '.join(cpu.get('quantized_engines', []))}",
        f"CUDA: {gpus or 'not available'}",
        f"onnxruntime {ort.get('version')}: {', '.join(ort.get('providers', []))}",
    ]
    if results.get("warnings"):
        total = sum(results["warnings"].values())
        items.append(
            f"library warnings caught and summarised: {total} ({len(results['warnings'])} distinct, "
            "listed in results.json)"
        )
    out.append(("Environment", items))
    return out


def intro(results: dict[str, Any]) -> list[str]:
    lines = [
        f"Status: **{results.get('status')}**. Started {results.get('started')}, "
        f"finished {results.get('finished')}."
    ]
    if results.get("error"):
        lines.append(f"Run error: {results['error']}")
    data = results.get("data") or {}
    if data:
        how = (
            "accuracy on labelled evaluation data."
            if data.get("has_labels")
            else "accuracy not measured (no labels); agreement is fidelity to the baseline."
        )
        lines.append(f"Data: {data.get('description')}; {how}")
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    head, body = variant_table_cells(results)
    out = [f"# torchtame report: {results.get('recipe')}", ""]
    for line in intro(results):
        out += [line, ""]
    out += ["## Variants", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cells in body:
        cells = [f"`{cells[0]}`", *cells[1:]]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out += ["", latency_note(results), ""]
    for title, items in sections(results):
        out += [f"## {title}", "", *[f"- {item}" for item in items], ""]
    return "\n".join(out)
