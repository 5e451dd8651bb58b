"""The package's layering holds: no import cycle, imports point down the floors, no god class;
and every registered pass or source is documented, in the schema, and round-trips its options."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from torchtame import register_pass
from torchtame.recipe import json_schema, recipe_model
from torchtame.registry import DATA_SOURCES, METRICS, MODEL_SOURCES, PASSES, Registry

PKG = Path(__file__).resolve().parents[1] / "src" / "torchtame"

# ARCHITECTURE.md explains these floors; a module may import its own floor or the floors below.
FLOORS = {
    1: [
        "_version",
        "_warnings",
        "errors",
        "options",
        "registry",
        "runtime",
        "variant",
        "devices",
        "progress",
        "inputs",
        "optional",
        "results",
    ],
    2: [
        "recipe",
        "recipe_errors",
        "models",
        "data",
        "training",
        "artifacts",
        "onnx_runtime",
        "zoo",
        "passes",
        "evaluate",
        "report",
    ],
    3: ["pipeline", "search", "execution", "deploy"],
    4: ["cli", "__init__", "__main__"],
}
# within floor 2: a pass never imports the recipe; evaluate/ and report/ never import passes/
FORBIDDEN = [("passes", "recipe"), ("evaluate", "passes"), ("report", "passes"), ("evaluate", "recipe")]
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _targets(module: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        full = f"{target}.{alias.name}" if target else alias.name
        out.append(full if full in known else target)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, function-level imports included; imports under
    ``if TYPE_CHECKING`` do not count. A package ``__init__`` importing its own submodules counts
    (stricter than needed: registries live in registry.py, so no submodule imports its package to
    register itself, and importing a package really runs its submodules)."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for module, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        deps: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in typing_only:
                continue
            for target in _targets(module, is_pkg, node, known):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if not target or target == module or not target.startswith("torchtame"):
                    continue
                deps.add(target)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def floor_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for floor, names in FLOORS.items():
        if top in names:
            return floor
    raise AssertionError(f"{module} has no floor: add it to FLOORS and ARCHITECTURE.md")


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_imports_point_down_the_floors() -> None:
    upward = [
        f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})"
        for m, deps in import_graph().items()
        for d in deps
        if floor_of(d) > floor_of(m)
    ]
    assert upward == []


def test_forbidden_neighbours() -> None:
    bad = []
    for m, deps in import_graph().items():
        for src, dst in FORBIDDEN:
            if m.startswith(f"torchtame.{src}") and any(d.startswith(f"torchtame.{dst}") for d in deps):
                bad.append(f"{m} imports {dst}")
    assert bad == []


def _too_long(kinds: tuple[type, ...], limit: int) -> list[str]:
    big = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, kinds) and node.end_lineno - node.lineno + 1 > limit:
                big.append(f"{path.relative_to(PKG)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return big


def test_no_class_over_200_lines() -> None:
    assert _too_long((ast.ClassDef,), MAX_CLASS_LINES) == []


def test_no_function_over_80_lines() -> None:
    """ARCHITECTURE.md would name a pass body excepted from this, with its reason; none is."""
    assert _too_long((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES) == []


def pass_name_literals(names: set[str]) -> list[str]:
    """String constants equal to a registered pass name, outside the module that registers it
    (docstrings and prose never equal a bare name, so only code that branches on one is found)."""
    owner = {e.name: e.fn.__module__ for e in PASSES.entries()}
    found = []
    for module, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names and owner.get(node.value) != module:
                found.append(f"{path.relative_to(PKG)}:{node.lineno}: {node.value!r}")
    return found


def test_no_pass_name_outside_its_module() -> None:
    """What a pass is lives where it registers (traits, hints, NAME): the rest of the package asks
    the registry or imports the pass's NAME."""
    assert pass_name_literals(set(PASSES.names())) == []


def test_pass_name_scan_finds_a_planted_literal(tmp_path: Path) -> None:
    assert pass_name_literals({"torchtame"})  # the package name is a literal in several modules


def test_pipeline_talks_to_engines_through_the_protocol() -> None:
    """No ``Any``-typed engine, no ``hasattr`` on the pipeline, and only execution/ imports pipeline/."""
    core = (PKG / "pipeline" / "core.py").read_text(encoding="utf-8")
    assert "engine: Any" not in core and "hasattr(" not in core
    graph = import_graph()
    pipeline = [deps for m, deps in graph.items() if m.startswith("torchtame.pipeline")]
    into = [d for deps in pipeline for d in deps if d.startswith("torchtame.execution")]
    assert into == []


def test_architecture_doc_names_only_modules_that_exist() -> None:
    import re

    doc = (PKG.parents[1] / "ARCHITECTURE.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", doc))
    assert len(named) > 30, named
    missing = [n for n in sorted(named) if not ((PKG / n).exists() or (PKG.parents[1] / n).exists())]
    assert missing == []
    # and every module of the package is named there
    unnamed = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p.name != "__init__.py" and str(p.relative_to(PKG)) not in named
    ]
    assert unnamed == []


# ------------------------------------------------------------------ registries


# the smallest valid options of items whose options have required fields
EXAMPLES = {
    ("model", "python"): {"target": "torchtame.zoo:digits_cnn"},
    ("model", "checkpoint"): {"path": "model.pt"},
    ("model", "torchscript"): {"path": "model.ts"},
    ("model", "torchvision"): {"name": "resnet18"},
    ("data", "python"): {"target": "mydata:build"},
    ("data", "torchvision"): {"name": "MNIST", "root": "datasets"},
    ("data", "synthetic"): {"shape": [3, 8, 8]},
    ("data", "imagefolder"): {"root": "images"},
    ("model", "transformers"): {"path": "models/bert"},
    ("data", "text"): {"path": "texts.txt", "tokenizer": "models/bert"},
}

REGISTRIES = [("pass", PASSES, "pass"), ("model", MODEL_SOURCES, "source"), ("data", DATA_SOURCES, "source")]


def _entries() -> list[tuple[str, object, str]]:
    recipe_model()  # registers every built-in
    return [(kind, e, tag) for kind, reg, tag in REGISTRIES for e in reg.entries()]


@pytest.mark.parametrize(("kind", "entry", "tag"), _entries(), ids=lambda x: getattr(x, "name", str(x)))
def test_registered_item_is_documented_in_schema_and_round_trips(kind, entry, tag) -> None:
    assert entry.summary, f"{kind} {entry.name!r} has no docstring summary"
    schema = json.dumps(json_schema())
    assert json.dumps(entry.name) in schema, f"{kind} {entry.name!r} is missing from `optimize schema`"
    fields = entry.options.model_fields
    raw = {"source": entry.name} if "source" in fields else {}
    raw.update(EXAMPLES.get((kind, entry.name), {}))
    opts = entry.options.model_validate(raw)  # fails for a new item without an entry in EXAMPLES
    again = entry.options.model_validate(opts.model_dump(mode="json", by_alias=True))
    assert again == opts


def test_metrics_are_registered() -> None:
    assert {"top1", "top5", "fidelity"} <= set(METRICS.names())


def test_registering_a_name_twice_needs_replace() -> None:
    reg: Registry = Registry("thing")

    class Opts(BaseModel):
        pass

    reg.register("x", Opts)(lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x", Opts)(lambda: 2)
    reg.register("x", Opts, replace=True)(lambda: 3)
    assert reg.get("x").fn() == 3
    with pytest.raises(ValueError, match="already registered"):
        register_pass("quantize.static")(lambda m, c, o: None)
