"""Recipe validation: every mistake names its field (and line), exit code 2 from the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from torchtame import RecipeError, load_recipe
from torchtame.recipe import json_schema

from .conftest import run_cli

GOOD = textwrap.dedent(
    """\
    name: ok
    model:
      source: python
      target: torchtame.zoo:digits_cnn
    data:
      source: digits
    steps:
      - name: q
        pass: quantize.dynamic
    """
)


def test_good_recipe_loads_with_defaults() -> None:
    r = load_recipe(GOOD)
    assert r.name == "ok"
    assert r.devices == ["auto"]
    assert r.steps[0].pass_ == "quantize.dynamic"
    assert r.steps[0].options.dtype == "qint8"
    assert r.steps[0].from_ == "baseline"
    assert r.evaluate.latency.batch_sizes == [1]


def _error(text: str) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(text)
    return str(info.value)


BAD = [
    # (what is wrong, recipe text, substrings the message must hold)
    ("unknown top-level key", GOOD + "colour: red\n", ["colour", "unknown key", "allowed:"]),
    ("typo'd key suggests the fix", GOOD.replace("steps:", "stepz:"), ["stepz", "did you mean 'steps'"]),
    ("missing model", "name: x\ndata: {source: digits}\n", ["model", "missing"]),
    ("unknown model source", GOOD.replace("source: python", "source: hub"), ["model", "hub", "python"]),
    ("unknown pass", GOOD.replace("quantize.dynamic", "quantize.magic"), ["steps[0]", "quantize.magic"]),
    ("bad pass option value", GOOD + "    options: {dtype: int4}\n", ["steps[0].options.dtype", "int4"]),
    ("unknown pass option", GOOD + "    options: {bits: 4}\n", ["steps[0].options.bits", "allowed:"]),
    ("bad device", GOOD + "devices: [tpu]\n", ["devices", "tpu", "cuda:N"]),
    ("seed not an int", GOOD + "seed: abc\n", ["seed", "abc"]),
    (
        "from names a later variant",
        GOOD + "  - name: p\n    pass: prune.structured\n    from: zzz\n",
        ["steps[1].from", "zzz", "baseline"],
    ),
    ("duplicate step name", GOOD + "  - name: q\n    pass: prune.structured\n", ["steps[1].name", "twice"]),
    (
        "pruning ratio out of range",
        GOOD + "  - name: p\n    pass: prune.structured\n    options: {ratio: 1.5}\n",
        ["steps[1].options.ratio", "1.5"],
    ),
    (
        "batch size zero",
        GOOD.replace("source: digits", "source: digits\n  batch_size: 0"),
        ["data.batch_size", "0"],
    ),
    (
        "latency batch size negative",
        GOOD + "evaluate: {latency: {batch_sizes: [-1]}}\n",
        ["evaluate.latency.batch_sizes[0]"],
    ),
    ("unknown metric", GOOD + "evaluate: {metrics: [f1]}\n", ["evaluate.metrics", "f1", "top1"]),
    ("bad report format", GOOD + "report: {formats: [pdf]}\n", ["report.formats[0]", "pdf"]),
    (
        "split adds over 1",
        GOOD.replace("source: digits", "source: digits\n  split: {train: 0.9, evaluation: 0.5}"),
        ["data.split", "add up"],
    ),
    ("name with a slash", GOOD.replace("name: ok", "name: a/b"), ["name", "a/b"]),
    ("bad step name type", GOOD.replace("name: q", "name: [1]"), ["steps[0].name"]),
    (
        "export names unknown variant",
        GOOD + "export: {onnx: true, variants: [nope]}\n",
        ["export.variants", "nope"],
    ),
]


@pytest.mark.parametrize(("what", "text", "needles"), BAD, ids=[b[0] for b in BAD])
def test_bad_recipe_names_the_field(what: str, text: str, needles: list[str]) -> None:
    msg = _error(text)
    for needle in needles:
        assert needle in msg, f"{what}: {needle!r} not in {msg!r}"


def test_error_gives_the_yaml_line() -> None:
    msg = _error(GOOD + "    options: {dtype: int4}\n")
    assert msg.startswith("recipe:10:"), msg


def test_not_yaml_names_the_line() -> None:
    msg = _error("name: x\nmodel: [unclosed\n")
    assert "not valid YAML" in msg and "recipe:" in msg


def test_top_level_must_be_a_mapping() -> None:
    assert "mapping" in _error("- just\n- a list\n")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_overrides_replace_fields() -> None:
    r = load_recipe(GOOD, devices=["cpu"], output_dir="elsewhere")
    assert r.devices == ["cpu"] and str(r.output_dir) == "elsewhere"


def test_resolved_yaml_round_trips() -> None:
    r = load_recipe(GOOD)
    again = load_recipe(r.to_yaml())
    assert again.model_dump() == r.model_dump()


def test_schema_lists_sources_and_passes() -> None:
    text = json.dumps(json_schema())
    for name in (
        "quantize.dynamic",
        "quantize.static",
        "prune.structured",
        "export.onnx",
        "torchvision",
        "digits",
    ):
        assert name in text


def test_cli_bad_recipe_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD + "    options: {dtype: int4}\n")
    proc = run_cli(str(bad))
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) <= 2, proc.stderr
    assert "steps[0].options.dtype" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_schema_is_json() -> None:
    proc = run_cli("schema")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["title"] == "torchtame recipe"


def test_shipped_recipes_are_valid() -> None:
    root = Path(__file__).resolve().parents[1] / "recipes"
    files = sorted(root.glob("*.yaml"))
    assert files
    for f in files:
        load_recipe(f)
