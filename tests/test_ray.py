"""Ray execution: a local Ray instance gives the local engine's figures; a two-node cluster on this
machine (loopback only) records both nodes; a worker killed mid-task fails its variant, not the run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from torchtame import register_pass, run

from .conftest import ROOT, tiny_recipe

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
RAY_BIN = str(Path(sys.executable).with_name("ray"))
LOOPBACK = "127.0.0.2"  # Ray rewrites 127.0.0.1 to the machine's public address, not 127.0.0.2


@pytest.fixture(autouse=True)
def _workers_import_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray workers import passes registered here (tests.test_ray) from the repository root."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance (2 CPUs, one measuring slot) for the tests that need one; the engine
    uses a running instance instead of starting its own."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=2,
        resources={"torchtame_measure": 1},
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    if ray.is_initialized():
        ray.shutdown()


def _suicide(model, ctx, opts):
    """The worker process dies mid-build, as when a node is lost."""
    os._exit(1)


register_pass("test.suicide")(_suicide)

STEPS = [
    {"name": "int8", "pass": "quantize.static", "options": {"mode": "fx"}},
    {"name": "pruned", "pass": "prune.structured", "options": {"ratio": 0.5}},
    {"name": "pruned-ft", "from": "pruned", "pass": "finetune", "options": {"epochs": 1}},
]


def _recipe(
    tmp_path: Path, execution: dict | None = None, steps: list | None = None, memory: bool = False
) -> dict:
    r = tiny_recipe(tmp_path, steps=steps or STEPS, evaluate={"memory": memory})
    if steps is None:
        r["export"] = {"onnx": True, "variants": ["pruned-ft"]}
    if execution:
        r["execution"] = execution
    return r


def _figures(result) -> dict[str, tuple]:
    return {
        v["name"]: (v["status"], (v.get("accuracy") or {}).get("top1"), (v.get("size") or {}).get("macs"))
        for v in result.results["variants"]
    }


def test_local_ray_gives_the_local_engines_figures_and_resumes(tmp_path: Path, local_ray) -> None:
    local = run(_recipe(tmp_path))
    # the same torch threads; memory is measured on the worker, from the artefact it received
    remote = run(_recipe(tmp_path, {"engine": "ray", "step_cpus": 2}, memory=True))
    assert remote.status == "complete"
    assert _figures(remote) == _figures(local)
    assert all(m["peak_memory_mb"] > 0 for v in remote.results["variants"] for m in v["latency"])
    execution = remote.results["execution"]
    assert execution["engine"] == "ray" and len(execution["nodes"]) == 1
    node = execution["nodes"][0]["node"]
    for v in remote.results["variants"]:
        assert {m["node"] for m in v["latency"]} == {node}
    by = {v["name"]: v for v in remote.results["variants"]}
    assert by["pruned-ft"]["built_on"] == node and (remote.run_dir / by["pruned-ft"]["artifact"][0]).is_file()
    assert by["pruned-ft-onnx"]["status"] == "ok"
    again = run(_recipe(tmp_path, {"engine": "ray"}, memory=True), resume=remote.run_dir)
    assert all(v.get("resumed") for v in again.results["variants"])


def test_a_killed_worker_fails_its_variant_not_the_run(tmp_path: Path, local_ray) -> None:
    steps = [
        {"name": "int8", "pass": "quantize.dynamic"},
        {"name": "lost", "pass": "test.suicide"},
        {"name": "after-lost", "from": "lost", "pass": "quantize.dynamic"},
        {"name": "pruned", "pass": "prune.structured", "options": {"ratio": 0.25}},
    ]
    result = run(_recipe(tmp_path, {"engine": "ray"}, steps))
    assert result.status == "complete"
    lost = result.variant("lost")
    assert lost["status"] == "failed" and "worker was lost" in lost["error"]
    assert "skipped" in result.variant("after-lost")["error"]
    assert result.variant("int8")["status"] == "ok" and result.variant("pruned")["status"] == "ok"


def test_ray_without_the_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtame import RunError

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RunError, match=r"torchtame\[ray\]"):
        run(_recipe(tmp_path, {"engine": "ray"}))


# last: its teardown stops every Ray process of this machine (`ray stop --force`)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@pytest.fixture()
def two_nodes(tmp_path: Path):
    """A head and a second node, one CPU and one measuring slot each, on loopback."""
    port = _free_port()
    common = ["--node-ip-address", LOOPBACK, "--num-cpus", "1", "--resources", '{"torchtame_measure": 1}']
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    head = [
        RAY_BIN,
        "start",
        "--head",
        "--port",
        str(port),
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    node = [RAY_BIN, "start", "--address", f"{LOOPBACK}:{port}", "--disable-usage-stats"]
    try:
        for cmd in (head + common, node + common):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, proc.stderr[-2000:]
        yield f"{LOOPBACK}:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY_BIN, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.skipif(shutil.which(RAY_BIN) is None and not Path(RAY_BIN).exists(), reason="needs the ray CLI")
def test_two_node_cluster_records_both_nodes(tmp_path: Path, two_nodes: str) -> None:
    if ray.is_initialized():  # the module's local instance is not this cluster
        ray.shutdown()
    result = run(_recipe(tmp_path, {"engine": "ray", "address": two_nodes}))
    assert result.status == "complete"
    nodes = {n["node"] for n in result.results["execution"]["nodes"]}
    assert len(nodes) == 2
    baseline = result.variant("baseline")
    assert {m["node"] for m in baseline["latency"]} == nodes  # the baseline is timed on every node
    used = {m["node"] for v in result.results["variants"] for m in v["latency"]}
    used |= {v["built_on"] for v in result.results["variants"] if v.get("built_on")}
    assert used == nodes
    # every speed-up uses its own node's baseline timing, never the other node's
    base_p50 = {m["node"]: m["p50_ms"] for m in baseline["latency"]}
    checked = 0
    for v in result.results["variants"]:
        for m in v["latency"]:
            assert m["speedup"] == pytest.approx(base_p50[m["node"]] / m["p50_ms"], rel=1e-3), (v["name"], m)
            checked += 1
    assert checked >= len(result.results["variants"])
