"""report.md: the variant table, skipped devices, failures, environment and settings.

The table cells and the sections are built once here (``variant_table_cells``, ``sections``)
and rendered by both the Markdown and the HTML report.
"""

from __future__ import annotations

from typing import Any

from ..results import accuracy_of, findings_of, info_of, latencies
from .compression import tables as compression_tables
from .rows import Row, fmt_num, latency_keys, result_task, rows_from_results


def variant_table_cells(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one list of cells per variant (the last cell is the status)."""
    rows = rows_from_results(results)
    keys = latency_keys(rows)
    head = ["variant", "from", "pass", "dtype", *Row.SUMMARY_HEAD]
    for device, bs in keys:
        head += [f"{device} b{bs} p50 ms", "p90 ms", "speed-up", "peak MiB"]
    head += ["flags", "status"]
    body = []
    for r in rows:
        cells = [r.name, r.parent or "", r.pass_name, r.dtype]
        if r.status != "ok":  # the reason is a line of its own under the table (Failures)
            blanks = ["-"] * (len(Row.SUMMARY_HEAD) + 4 * len(keys) + 1)
            body.append([*cells, *blanks, "failed (see Failures)"])
            continue
        cells += r.summary_cells()
        for k in keys:
            m = r.latency.get(k)
            skipped = next((x["reason"] for x in r.skipped if x["device"] == k[0]), None)
            cells += [
                fmt_num(m["p50_ms"], 3) if m else (skipped.split(" (")[0] if skipped else "-"),
                fmt_num(m["p90_ms"], 3) if m else "-",
                r.speedup_cell(k),
                fmt_num(r.memory(k), 1),
            ]
        chosen = (results.get("selection") or {}).get("chosen") == r.name
        body.append([*cells, r.flags or "-", "ok, chosen" if chosen else "ok"])
    return _measured_columns(head, body)


EMPTY = {"-", "not measured", "n/a", ""}


def _measured_columns(head: list[str], body: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Leave out a column in which no variant has a figure (top-1 without labels, memory that was
    not measured): a column of "not measured" tells the reader nothing."""
    measured = [row for row in body if not row[-1].startswith("failed")]

    def shown(i: int) -> bool:
        return i < 4 or head[i] in ("flags", "status") or any(row[i] not in EMPTY for row in measured)

    keep = [i for i in range(len(head)) if shown(i)]
    return [head[i] for i in keep], [[row[i] for i in keep] for row in body]


def latency_note(results: dict[str, Any]) -> str:
    settings = results.get("settings", {})
    lat = settings.get("latency", {})
    rounds = settings.get("latency_rounds") or 1
    interval = (
        f"the median over {rounds} shuffled rounds of the per-round ratio, ± half its 95% interval "
        "(bootstrap over the paired rounds); a compiled variant also shows its speed-up against the "
        "float model compiled the same way, timed in the same rounds"
        if rounds > 1
        else "one reading each, so no interval (set `latency.rounds` for one)"
    )
    return (
        f"Latency: median (p50) and p90 of at least {lat.get('min_runs')} timed calls and "
        f"{lat.get('min_time_s')} s after {lat.get('warmup')} warm-up calls, "
        f"{settings.get('threads')} threads; speed-up is baseline p50 / variant p50 on the same "
        f"device, batch size and thread count: {interval}. Peak MiB is the memory one batch needs (CUDA: the "
        "allocator's peak; CPU: peak resident memory of a fresh process that loads the artefact and "
        "runs the batch, median of several). Size is the saved artefact's bytes. MACs are counted "
        "at the aten level on float models; * marks MACs inherited from the float parent (int8 and ONNX "
        "graphs do the same arithmetic)."
    )


def health_lines(results: dict[str, Any]) -> list[str]:
    """One line per health finding: the variant, what is wrong, and the next step to try."""
    marks = {"error": "✖ error", "warning": "⚠ warning", "info": "info"}
    lines = []
    for v in results.get("variants", []):
        for f in findings_of(v):
            lines.append(f"`{v['name']}` {marks[f['level']]}: {f['message']}. Next: {f['suggestion']}.")
    return lines


def recovery_trials(results: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Variant -> (algorithms, cosine on calibration batches) of every recovery it tried or applied."""
    out = {}
    for v in results.get("variants", []):
        rec = info_of(v).get("recovery")
        if not rec:
            continue
        if rec.get("trials"):
            out[v["name"]] = [
                (" + ".join(t["algorithms"]) or "none", t["cosine"]) for t in rec["trials"] if "cosine" in t
            ]
        elif rec.get("cosine") is not None:
            out[v["name"]] = [("none", rec["cosine_without"]), (" + ".join(rec["chosen"]), rec["cosine"])]
    return out


def recovery_lines(results: dict[str, Any]) -> list[str]:
    """What accuracy recovery did per variant: fidelity before and after each algorithm."""
    lines = []
    every = recovery_trials(results)
    for v in results.get("variants", []):
        rec = info_of(v).get("recovery")
        if not rec:
            continue
        chosen = " + ".join(rec.get("chosen") or []) or "none"
        trials = every.get(v["name"], [])
        shown = "; ".join(f"{name}: cosine {c:.5f}" for name, c in trials)
        notes = [f"{r['algorithm']} {r['note']}" for r in rec.get("applied", []) if r.get("note")]
        notes += [
            f"range_search narrowed {r['narrowed']} of {r['tensors']} activation ranges "
            f"({', '.join(f'{k} {n}' for k, n in r['methods'].items())}; median int8 error "
            f"{r['median_error_vs_minmax']:.2f}x min/max's)"
            for r in rec.get("applied", [])
            if r.get("algorithm") == "range_search" and r.get("methods")
        ]
        line = f"`{v['name']}` ({rec['mode']}): kept {chosen}"
        if shown:
            on = rec.get("judged_on", "calibration batches, held apart from evaluation")
            line += f" (fidelity to float on {on}: {shown})"
        lines.append(line + (f"; {'; '.join(notes)}" if notes else ""))
    return lines


def sections(results: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(title, bullet items) of the sections after the table."""
    out: list[tuple[str, list[str]]] = []
    health = health_lines(results)
    if health:
        out.append(("Health", health))
    recovery = recovery_lines(results)
    if recovery:
        out.append(("Recovery", recovery))
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
    timing = timing_lines(results)
    if timing:
        out.append(("How it was measured", timing))
    return out


def timing_lines(results: dict[str, Any]) -> list[str]:
    """How each device/runtime pair was timed and where its memory figure comes from."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for v in results["variants"]:
        for m in latencies(v):
            seen.setdefault((m["device"], m.get("runtime", "pytorch")), m)
    lines = []
    for (device, runtime), m in sorted(seen.items()):
        io = {"device": "inputs and outputs on the device", "host": "host memory"}.get(m.get("io"), "")
        timer = {"cuda-events": "CUDA events on the device's stream", "wall-clock": "host clock"}.get(
            m.get("timer"), m.get("timer") or "host clock"
        )
        memory = (
            "peak memory: not measured"
            if "peak_memory_mb" not in m
            else "peak memory: CUDA allocator peak"
            if device.startswith("cuda")
            else "peak memory: a fresh process's peak resident memory (median of readings)"
        )
        lines.append(f"{device}, {runtime}: {timer}{', ' + io if io else ''}; {memory}")
    return lines


def selection_lines(results: dict[str, Any]) -> list[str]:
    """The constraints, the chosen variant (or the best found) and each candidate's verdict."""
    sel = results.get("selection")
    if not sel:
        return []
    c = ", ".join(f"{k} {v}" for k, v in sel["constraints"].items())
    setting = sel["latency_setting"]
    head = f"Constraints: {c} (latency on {setting['device']}, batch {setting['batch_size']})."
    if sel["chosen"]:
        head += f" Chosen: `{sel['chosen']}`, the fastest variant that meets every constraint."
    else:
        head += f" No variant meets every constraint; the best found is `{sel['best_found']}`."
    items = [head]
    for v in sel["candidates"]:
        figures = [
            f"p50 {v['p50_ms']:.3f} ms" if v["p50_ms"] is not None else "",
            f"drop {v['accuracy_drop']:.2f}" if v["accuracy_drop"] is not None else "",
            f"cosine {v['cosine']:.4f}" if v.get("cosine") is not None else "",
            f"agreement {v['agreement']:.2f}%" if v.get("agreement") is not None else "",
            f"{v['size_mib']:.3f} MiB" if v["size_mib"] is not None else "",
        ]
        shown = ", ".join(f for f in figures if f)
        mark = f"meets ({shown})" if v["meets"] else "rejected: " + "; ".join(v["reasons"])
        items.append(f"`{v['name']}`: {mark}")
    for stop in (results.get("search") or {}).get("stopped", []):
        items.append(f"search, {stop['family']}: stopped early: {stop['reason']}")
    for low in (results.get("search") or {}).get("float_lowered", []):
        items.append(
            f"`{low['candidate']}` ({len(low['excluded'])} node(s) float) has {low['metric']} "
            f"{low['after']:.4g} against {low['before']:.4g} for `{low['parent']}`: "
            + low.get("why", "no ONNX files to compare")
        )
    return items


def sensitivity_table(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Layers ranked by the drop that quantizing / pruning each alone causes."""
    sens = (results.get("search") or {}).get("sensitivity") or {}
    q = {s["layer"]: s for s in sens.get("quantize", [])}
    p = {s["layer"]: s for s in sens.get("prune", [])}
    layers = list(dict.fromkeys([*q, *p]))
    if not layers:
        return [], []

    def cell(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return "-"
        return fmt_num(entry["drop"], 2) if entry.get("drop") is not None else "n/a"

    def key(layer: str) -> float:
        return -max(((q.get(layer) or {}).get("drop") or 0.0), ((p.get(layer) or {}).get("drop") or 0.0))

    head = ["rank", "layer", "type", "int8 alone: loss (pts)", "pruned alone: loss (pts)"]
    body = [
        [
            str(i + 1),
            layer,
            (q.get(layer) or p.get(layer) or {}).get("type", ""),
            cell(q.get(layer)),
            cell(p.get(layer)),
        ]
        for i, layer in enumerate(sorted(layers, key=key))
    ]
    return head, body


def sensitivity_note(sens: dict[str, Any]) -> str:
    ratio = sens.get("prune_ratio", 0.5)
    return (
        f"Drop in {sens.get('basis', 'top-1')} points when only that layer is quantized to int8, or "
        f"only that layer loses {ratio:.0%} of its channels (no fine-tuning); most sensitive first."
    )


def intro(results: dict[str, Any]) -> list[str]:
    lines = [
        f"Status: **{results.get('status')}**. Started {results.get('started')}, "
        f"finished {results.get('finished')}."
    ]
    if results.get("error"):
        lines.append(f"Run error: {results['error']}")
    data = results.get("data") or {}
    if data:
        lines.append(f"Data: {data.get('description')}; {data_line(results)}")
    return lines


def data_line(results: dict[str, Any]) -> str:
    """What the quality figures mean for this run, in one sentence that tells the truth."""
    data = results.get("data") or {}
    task = result_task(results)
    settings = results.get("settings") or {}
    output = settings.get("output")
    what = f"the model's `{output}` output" if output is not None else "the model's output"
    if data.get("has_labels") and task == "classification" and data.get("labels") == "report_only":
        return (
            f"top-1 accuracy on labelled evaluation data is reported, but the labels were withheld "
            f"from the optimizer: constraints, search and training used the fidelity of {what} to the "
            "baseline only."
        )
    measured = any(accuracy_of(v).get("top1") is not None for v in results.get("variants", []))
    if data.get("has_labels") and task == "classification" and not measured:
        return (
            f"the data has labels, but top-1 was not among `evaluate.metrics`: fidelity of {what} to the "
            "baseline (top-1 agreement of class scores, cosine similarity)."
        )
    if data.get("has_labels") and task == "classification":
        return f"top-1 accuracy on labelled evaluation data, and fidelity of {what} to the baseline."
    if task == "classification":
        return (
            f"no labels, so accuracy is not measured; fidelity of {what} to the baseline "
            "(top-1 agreement of class scores, cosine similarity)."
        )
    return (
        f"{what} is not class scores (embeddings, hidden states), so the headline is its cosine "
        "similarity to the baseline's, with max/mean absolute error in results.json."
    )


def render_markdown(results: dict[str, Any], recipe_yaml: str | None = None) -> str:
    head, body = variant_table_cells(results)
    out = [f"# torchtame report: {results.get('recipe')}", ""]
    for line in intro(results):
        out += [line, ""]
    out += ["## Variants", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cells in body:
        cells = [f"`{cells[0]}`", *cells[1:]]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out += ["", latency_note(results), ""]
    sel = selection_lines(results)
    if sel:
        out += ["## Selection", "", sel[0], "", *[f"- {item}" for item in sel[1:]], ""]
    shead, sbody = sensitivity_table(results)
    if sbody:
        sens = (results.get("search") or {}).get("sensitivity", {})
        out += ["## Sensitivity", "", sensitivity_note(sens), ""]
        out += ["| " + " | ".join(shead) + " |", "|" + "---|" * len(shead)]
        out += ["| " + " | ".join(row) + " |" for row in sbody]
        out.append("")
    for title, note, thead, tbody in compression_tables(results):
        out += [f"## {title}", "", note, "", "| " + " | ".join(thead) + " |", "|" + "---|" * len(thead)]
        out += ["| " + " | ".join(row) + " |" for row in tbody]
        out.append("")
    for title, items in sections(results):
        out += [f"## {title}", "", *[f"- {item}" for item in items], ""]
    if recipe_yaml:
        out += ["## Recipe (as resolved)", "", "```yaml", recipe_yaml.rstrip(), "```", ""]
    return "\n".join(out)
