"""report.html: one self-contained page (plots embedded as PNG data URIs)."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from .compression import qat_plot, sparsity_plot
from .compression import tables as compression_tables
from .markdown import (
    intro,
    latency_note,
    recovery_trials,
    sections,
    selection_lines,
    sensitivity_note,
    sensitivity_table,
    variant_table_cells,
)
from .rows import Row, latency_keys, pareto_front, rows_from_results


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _quality(r: Row) -> float | None:
    return r.headline[1]


def plots(results: dict[str, Any]) -> dict[str, str]:
    """Title -> PNG data URI for each plot that has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows_from_results(results) if r.status == "ok"]
    keys = latency_keys(rows)
    made = {
        "Latency vs accuracy": _pareto(plt, rows, keys),
        "Size per variant": _sizes(plt, rows),
        "Peak memory per variant": _memory(plt, rows, keys),
        "Speed-up per device": _speedups(plt, rows, keys),
        "Per-layer sensitivity": _sensitivity(plt, results),
        "Recovery: fidelity per algorithm": _recovery(plt, results),
        "Sparsity per layer": _figure(sparsity_plot(plt, results)),
        "Quantization-aware training curve": _figure(qat_plot(plt, results)),
    }
    return {title: png for title, png in made.items() if png is not None}


def _pareto(plt: Any, rows: list[Row], keys: list[tuple[str, int]]) -> str | None:
    if not keys:
        return None
    key = keys[-1]  # the largest batch on the first device: where the differences show
    pts = [
        (r.name, r.latency[key]["p50_ms"], q)
        for r in rows
        if key in r.latency and (q := _quality(r)) is not None
    ]
    if not pts:
        return None
    front = set(pareto_front(pts))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, lat, acc) in enumerate(sorted(pts, key=lambda p: (p[2], p[1]))):
        on = name in front
        ax.scatter(lat, acc, s=60 if on else 30, c="tab:red" if on else "tab:blue", zorder=3)
        # stagger the labels of neighbouring points so they do not print over each other
        offset = (5, 6 + 9 * (i % 3)) if i % 2 else (5, -10 - 9 * (i % 3))
        ax.annotate(name, (lat, acc), textcoords="offset points", xytext=offset, fontsize=7)
    lats = [p[1] for p in pts]
    if min(lats) > 0 and max(lats) / min(lats) > 5:
        ax.set_xscale("log")
    fr = sorted((p for p in pts if p[0] in front), key=lambda p: p[1])
    ax.plot([p[1] for p in fr], [p[2] for p in fr], "--", c="tab:red", label="Pareto front")
    ax.set_xlabel(f"p50 latency (ms), {key[0]}, batch {key[1]}")
    what = rows[0].headline[0] if rows else "top-1 %"
    labels = {"top-1 %": "top-1 accuracy (%)", "agreement %": "agreement with baseline (%)"}
    ax.set_ylabel(labels.get(what, "cosine similarity to baseline"))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _png(fig)


def _bars(plt: Any, named: list[tuple[str, float]], color: str, label: str) -> str:
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(named) + 1.2))
    ax.barh([n for n, _ in named], [v for _, v in named], color=color)
    ax.invert_yaxis()
    ax.set_xlabel(label)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def _sizes(plt: Any, rows: list[Row]) -> str | None:
    sized = [(r.name, r.size_mb) for r in rows if r.size_mb is not None]
    return _bars(plt, sized, "tab:green", "size on disk (MB)") if sized else None


def _memory(plt: Any, rows: list[Row], keys: list[tuple[str, int]]) -> str | None:
    if not keys:
        return None
    mem = [(r.name, v) for r in rows if (v := r.memory(keys[-1])) is not None]
    label = f"peak inference memory (MiB), {keys[-1][0]}, batch {keys[-1][1]}"
    return _bars(plt, mem, "tab:purple", label) if mem else None


def _speedups(plt: Any, rows: list[Row], keys: list[tuple[str, int]]) -> str | None:
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 1.4))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ys = [r.speedup.get(key, 0.0) for r in rows]
        # error bars: the speed-up's 95% interval over paired rounds (none with one round)
        lows = [y - r.interval[key][0] if key in r.interval else 0.0 for r, y in zip(rows, ys, strict=True)]
        highs = [r.interval[key][1] - y if key in r.interval else 0.0 for r, y in zip(rows, ys, strict=True)]
        ax.barh(
            [j + i * width for j in range(len(rows))],
            ys,
            height=width,
            label=f"{key[0]} b{key[1]}",
            xerr=[lows, highs] if any(lows) or any(highs) else None,
            capsize=2,
        )
    ax.set_yticks([j + width * (len(keys) - 1) / 2 for j in range(len(rows))], [r.name for r in rows])
    ax.invert_yaxis()
    ax.axvline(1.0, c="grey", lw=1)
    ax.set_xlabel("speed-up vs baseline (p50; bars: 95% interval over paired rounds)")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def _figure(fig: Any) -> str | None:
    return None if fig is None else _png(fig)


def _recovery(plt: Any, results: dict[str, Any]) -> str | None:
    trials = recovery_trials(results)
    if not trials:
        return None
    labels = [f"{v}: {name}" for v, ts in trials.items() for name, _ in ts]
    values = [c for ts in trials.values() for _, c in ts]
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(labels) + 1.2))
    ax.barh(labels, values, color="tab:orange")
    ax.invert_yaxis()
    low = min(values)
    ax.set_xlim(max(0.0, low - (1 - low) * 0.5), 1.0)
    ax.set_xlabel("cosine to float on calibration batches (held apart from evaluation)")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def _sensitivity(plt: Any, results: dict[str, Any]) -> str | None:
    _, body = sensitivity_table(results)
    if not body:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(body) + 1.4))
    names = [r[1] for r in body]
    ys = range(len(names))
    q = [float(r[3]) if r[3] not in ("-", "n/a") else 0.0 for r in body]
    p = [float(r[4]) if r[4] not in ("-", "n/a") else 0.0 for r in body]
    ax.barh([y - 0.2 for y in ys], q, height=0.4, label="int8 (this layer only)")
    ax.barh([y + 0.2 for y in ys], p, height=0.4, label="pruned (this layer only)")
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("accuracy drop (points)")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1280px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1rem 0}
.scroll{overflow-x:auto;max-width:100%}th{white-space:normal}td{white-space:nowrap}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}tr.failed td{color:#b00}
.plots{display:flex;flex-wrap:wrap;gap:1rem}.plots figure{margin:0}figcaption{font-weight:600}
pre{background:#f7f7f7;padding:1rem;overflow:auto;font-size:12px}
"""


def render_html(results: dict[str, Any], recipe_yaml: str | None = None) -> str:
    esc = html.escape
    head, body = variant_table_cells(results)
    thead = "".join(f"<th>{esc(c)}</th>" for c in head)
    tbody = "".join(
        ("<tr class='failed'>" if cells[-1].startswith("failed") else "<tr>")
        + "".join(f"<td>{esc(c)}</td>" for c in cells)
        + "</tr>"
        for cells in body
    )
    figs = "".join(
        f'<figure><figcaption>{esc(t)}</figcaption><img alt="{esc(t)}" src="{uri}"></figure>'
        for t, uri in plots(results).items()
    )
    name = esc(str(results.get("recipe")))
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>torchtame: {name}</title>"
        f"<style>{CSS}</style></head><body>",
        f"<h1>torchtame report: {name}</h1>",
        *[f"<p>{esc(line).replace('**', '')}</p>" for line in intro(results)],
        f"<h2>Variants</h2><div class='scroll'><table><thead><tr>{thead}</tr></thead>"
        f"<tbody>{tbody}</tbody></table></div>",
        f"<p>{esc(latency_note(results))}</p>",
        f"<div class='plots'>{figs}</div>",
    ]
    sel = selection_lines(results)
    if sel:
        parts.append(f"<h2>Selection</h2><p>{esc(sel[0])}</p><ul>")
        parts += [f"<li>{esc(item)}</li>" for item in sel[1:]]
        parts.append("</ul>")
    shead, sbody = sensitivity_table(results)
    if sbody:
        note = sensitivity_note((results.get("search") or {}).get("sensitivity", {}))
        parts.append(f"<h2>Sensitivity</h2><p>{esc(note)}</p><div class='scroll'><table><thead><tr>")
        parts.append("".join(f"<th>{esc(h)}</th>" for h in shead))
        parts.append("</tr></thead><tbody>")
        parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in sbody]
        parts.append("</tbody></table></div>")
    for title, note, thead, tbody in compression_tables(results):
        parts.append(f"<h2>{esc(title)}</h2><p>{esc(note)}</p><div class='scroll'><table><thead><tr>")
        parts.append("".join(f"<th>{esc(h)}</th>" for h in thead))
        parts.append("</tr></thead><tbody>")
        parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in tbody]
        parts.append("</tbody></table></div>")
    for title, items in sections(results):
        parts.append(f"<h2>{esc(title)}</h2><ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>")
    if recipe_yaml:
        parts.append(f"<h2>Recipe</h2><pre>{esc(recipe_yaml)}</pre>")
    # lets a headless browser (and the tests) tell that every plot decoded and rendered
    parts.append(
        "<script>window.addEventListener('load',function(){var im=document.images,n=0;"
        "for(var i=0;i<im.length;i++){if(im[i].complete&&im[i].naturalWidth>0)n++;}"
        "document.body.setAttribute('data-images-rendered',n+'/'+im.length);"
        "document.body.setAttribute('data-page-width',document.documentElement.scrollWidth);});</script>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)
