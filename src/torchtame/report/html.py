"""report.html: one self-contained page (plots embedded as PNG data URIs)."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from .markdown import render_markdown
from .rows import Row, latency_keys, pareto_front, rows_from_results


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def plots(results: dict[str, Any]) -> dict[str, str]:
    """Title -> PNG data URI for each plot that has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows_from_results(results) if r.status == "ok"]
    keys = latency_keys(rows)
    out: dict[str, str] = {}
    if keys:
        key = keys[0]
        pts = [(r.name, r.latency[key]["p50_ms"], _quality(r)) for r in rows if key in r.latency and _quality(r) is not None]
        if pts:
            front = set(pareto_front(pts))  # type: ignore[arg-type]
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for name, lat, acc in pts:
                on = name in front
                ax.scatter(lat, acc, s=60 if on else 30, c="tab:red" if on else "tab:blue", zorder=3)
                ax.annotate(name, (lat, acc), textcoords="offset points", xytext=(4, 4), fontsize=8)
            fr = sorted((p for p in pts if p[0] in front), key=lambda p: p[1])
            ax.plot([p[1] for p in fr], [p[2] for p in fr], "--", c="tab:red", label="Pareto front")
            ax.set_xlabel(f"p50 latency (ms), {key[0]}, batch {key[1]}")
            ax.set_ylabel("top-1 accuracy (%)" if rows[0].top1 is not None else "agreement with baseline (%)")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
            out["Latency vs accuracy"] = _png(fig)
    sized = [r for r in rows if r.size_mb is not None]
    if sized:
        fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(sized) + 1.2))
        ax.barh([r.name for r in sized], [r.size_mb for r in sized], color="tab:green")
        ax.invert_yaxis()
        ax.set_xlabel("size on disk (MB)")
        ax.grid(axis="x", alpha=0.3)
        out["Size per variant"] = _png(fig)
    if keys:
        fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 1.4))
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            ys = [r.speedup.get(key, 0.0) for r in rows]
            ax.barh([j + i * width for j in range(len(rows))], ys, height=width, label=f"{key[0]} b{key[1]}")
        ax.set_yticks([j + width * (len(keys) - 1) / 2 for j in range(len(rows))], [r.name for r in rows])
        ax.invert_yaxis()
        ax.axvline(1.0, c="grey", lw=1)
        ax.set_xlabel("speed-up vs baseline (p50)")
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        out["Speed-up per device"] = _png(fig)
    return out


def _quality(r: Row) -> float | None:
    if r.top1 is not None:
        return r.top1
    if r.agreement is not None:
        return r.agreement
    return 100.0 if r.name == "baseline" else None


def _md_table_to_html(md: str) -> str:
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    if len(lines) < 2:
        return ""
    def cells(line: str) -> list[str]:
        return [c.strip().replace("\\|", "|") for c in line.strip().strip("|").split(" | ")]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cells(lines[0]))
    body = ""
    for ln in lines[2:]:
        cs = cells(ln)
        cls = ' class="failed"' if cs and cs[-1].startswith("failed") else ""
        body += f"<tr{cls}>" + "".join(f"<td>{html.escape(c.strip('`'))}</td>" for c in cs) + "</tr>"
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1rem 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}tr.failed td{color:#b00}
.plots{display:flex;flex-wrap:wrap;gap:1rem}.plots figure{margin:0}figcaption{font-weight:600}
pre{background:#f7f7f7;padding:1rem;overflow:auto;font-size:12px}
"""


def render_html(results: dict[str, Any], recipe_yaml: str | None = None) -> str:
    md = render_markdown(results)
    sections = md.split("\n## ")
    table_html = _md_table_to_html(md.split("## Variants", 1)[-1])
    prose = []
    for sec in sections[2:]:
        title, _, body = sec.partition("\n")
        items = "".join(
            f"<li>{html.escape(ln[2:])}</li>" for ln in body.splitlines() if ln.startswith("- ")
        )
        rest = " ".join(html.escape(ln) for ln in body.splitlines() if ln and not ln.startswith("- "))
        prose.append(f"<h2>{html.escape(title)}</h2><ul>{items}</ul><p>{rest}</p>")
    figs = "".join(
        f'<figure><figcaption>{html.escape(t)}</figcaption><img alt="{html.escape(t)}" src="{uri}"></figure>'
        for t, uri in plots(results).items()
    )
    note = sections[1].split("\n\n")[-1] if len(sections) > 1 else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>torchtame: {html.escape(str(results.get('recipe')))}</title><style>{CSS}</style></head><body>"
        f"<h1>torchtame report: {html.escape(str(results.get('recipe')))}</h1>"
        f"<p>Status: <b>{html.escape(str(results.get('status')))}</b>; started {html.escape(str(results.get('started')))}</p>"
        f"<h2>Variants</h2>{table_html}<p>{html.escape(note)}</p>"
        f"<div class='plots'>{figs}</div>"
        + "".join(prose)
        + (f"<h2>Recipe</h2><pre>{html.escape(recipe_yaml)}</pre>" if recipe_yaml else "")
        + "</body></html>"
    )
