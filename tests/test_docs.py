"""Every figure the README shows has a committed source in benchmarks/."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")


def _sections() -> dict[str, str]:
    return dict(re.findall(r"<!-- (\w+):start -->(.*?)<!-- \1:end -->", RESULTS, re.S))


def test_every_results_section_says_command_date_machine_and_has_its_figures() -> None:
    sections = _sections()
    assert {"peers", "int8_modes", "unlabeled", "ray_cluster", "quickstart", "harness"} <= set(sections)
    for name, text in sections.items():
        for field in ("- command: `python benchmarks/", "- date: ", "- machine: "):
            assert field in text, (name, field)
        raw = re.search(r"raw figures: `(benchmarks/results/[\w.-]+\.json)`", text)
        assert raw, name
        json.loads((ROOT / raw.group(1)).read_text(encoding="utf-8"))
        script = re.search(r"command: `python (benchmarks/\w+\.py)", text).group(1)
        assert (ROOT / script).is_file(), script


def test_the_readme_quickstart_table_is_the_committed_run() -> None:
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", README, re.S | re.M)
    table = next(b for b in blocks if "variant" in b and "p50 ms" in b)
    quickstart = _sections()["quickstart"]
    assert table.strip() in quickstart, "README's quickstart table differs from benchmarks/RESULTS.md"


def test_readme_speed_claims_point_to_their_section() -> None:
    """A paragraph with speed-ups (e.g. "13x", "1.96x") names the RESULTS.md section it comes from."""
    for paragraph in README.split("\n\n"):
        if paragraph.startswith("```") or "|" in paragraph:
            continue
        if re.search(r"\b\d+(\.\d+)?x (faster|slower)", paragraph):
            assert "RESULTS.md" in paragraph, paragraph[:200]


def test_the_readme_health_table_is_the_code_table() -> None:
    from torchtame.evaluate.health import FINDINGS, FLAG, findings_table

    table = re.search(r"<!-- health-table:start -->\n(.*?)\n<!-- health-table:end -->", README, re.S)
    assert table, "README has no health table between its markers"
    assert table.group(1) == findings_table(), "regenerate it: torchtame.evaluate.health.findings_table()"
    assert {code for code, _, _ in FINDINGS} == set(FLAG)  # every finding has a flag and a row


FIGURE = re.compile(
    r"(\d+(?:\.\d+)?x\b|cosine \d\.\d+|\b\d+(?:\.\d+)? s\b|±\d+(?:\.\d+)?%|\d+(?:\.\d+)? MiB|\d+\.\d+%"
    r"|\d+/\d+ layers|\(\d+/\d+\))"
)


def test_readme_figures_are_rendered_from_the_committed_json() -> None:
    """The generated blocks are exactly what benchmarks/common.py renders from benchmarks/results."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    assert common.readme_blocks(README) == README, "run `python benchmarks/common.py` and commit README.md"
    for name in common.README_BLOCKS:
        block = re.search(rf"<!-- {name}:start -->\n(.+?)\n<!-- {name}:end -->", README, re.S)
        assert block and FIGURE.search(block.group(1)), name


def test_readme_prose_has_no_hand_written_figures() -> None:
    """Outside code, tables and the generated blocks, the README states no measured figure
    (speed-ups, cosines, seconds, spreads, MiB): each one would go stale unchecked."""
    text = re.sub(r"```.*?```", "", README, flags=re.S)
    text = re.sub(r"<!-- ([\w-]+):start -->.*?<!-- \1:end -->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code shows formats and options, not results
    found = [
        m.group(0)
        for paragraph in text.split("\n\n")
        if not paragraph.lstrip().startswith("|")
        for m in FIGURE.finditer(paragraph)
    ]
    assert found == []
    assert FIGURE.search("5.0x faster, cosine 0.9985, 27 s, ±11%")  # the pattern finds each kind
