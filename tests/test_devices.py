"""Device detection and selection; `optimize env`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torchtame import DeviceError, run
from torchtame.devices import detect_environment, resolve_device, resolve_devices

from .conftest import load_results, run_cli, tiny_recipe

NO_CUDA = not torch.cuda.is_available()


def test_environment_has_the_essentials() -> None:
    env = detect_environment().to_dict()
    assert env["torch"] == torch.__version__
    assert env["cpu"]["logical_cores"] >= 1
    assert "x86" in env["cpu"]["quantized_engines"] or "qnnpack" in env["cpu"]["quantized_engines"]
    assert "CPUExecutionProvider" in env["onnxruntime"]["providers"]
    assert env["cuda"]["device_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_cpu_and_auto() -> None:
    assert resolve_device("cpu").device == "cpu"
    auto = resolve_device("auto")
    assert auto.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert auto.reason


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_explicit_cuda_without_gpu_fails_before_work(tmp_path: Path) -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_devices(["cuda"])
    with pytest.raises(DeviceError):
        run(tiny_recipe(tmp_path, devices=["cuda:1"]))
    assert not (tmp_path / "runs").exists()  # no run directory was started
    proc = run_cli("--device", "cuda", "recipes/quickstart.yaml", "--output-dir", str(tmp_path / "x"))
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_cpu_and_cuda_list_measures_cpu_and_reports_cuda(tmp_path: Path) -> None:
    steps = [{"name": "int8", "pass": "quantize.dynamic"}]
    result = run(tiny_recipe(tmp_path, devices=["cpu", "cuda"], steps=steps))
    res = load_results(result.run_dir)
    assert res["status"] == "complete"
    cuda = next(d for d in res["devices"] if d["requested"] == "cuda")
    assert not cuda["available"] and "not available" in cuda["reason"]
    for v in res["variants"]:
        assert {m["device"] for m in v["latency"]} == {"cpu"}
        assert any(s["device"] == "cuda" for s in v["skipped_devices"])
    md = (result.run_dir / "report.md").read_text()
    assert "cuda: CUDA is not available" in md


@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that says it has two CUDA GPUs; what runs on "cuda:N" really runs on the CPU."""
    import contextlib

    import torchtame.devices as devices
    import torchtame.pipeline.measure as measure
    import torchtame.pipeline.pretrain as pretrain

    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    monkeypatch.setattr(devices, "cuda_name", lambda i: f"Fake GPU {i}")
    fake = [
        {"index": i, "name": f"Fake GPU {i}", "memory_gib": 16.0, "capability": "9.0", "bf16": True}
        for i in range(2)
    ]
    info = {"built_with": "13.0", "cudnn": None, "device_count": 2, "devices": fake}
    monkeypatch.setattr(devices, "cuda_info", lambda: info)
    monkeypatch.setattr(pretrain, "training_device", lambda devices: "cpu")
    real_runner, real_latency = measure.make_runner, measure.measure_latency

    @contextlib.contextmanager
    def runner(variant, device, *args):
        with real_runner(variant, "cpu", *args) as pair:
            yield pair

    def latency(fn, x, *, device="cpu", **kw):
        return dataclasses.replace(real_latency(fn, x, device="cpu", **kw), device=device)

    monkeypatch.setattr(measure, "make_runner", runner)
    monkeypatch.setattr(measure, "measure_latency", latency)
    monkeypatch.setattr(measure, "cuda_peak", lambda run, x, device: {"peak_memory_mb": 1.0})


def test_auto_is_the_cpu_and_the_first_gpu(two_fake_gpus: None) -> None:
    assert [c.device for c in resolve_devices(["auto"])] == ["cpu", "cuda:0"]
    assert [c.device for c in resolve_devices(["auto", "cuda:1"])] == ["cpu", "cuda:0", "cuda:1"]
    assert [c.device for c in resolve_devices(["cpu", "auto"])] == ["cpu", "cuda:0"]  # no duplicates
    assert resolve_device("auto").device == "cuda:0"  # one device (a constraint's `device: auto`)
    assert not resolve_device("cuda:2").available


def test_auto_on_a_gpu_machine_measures_int8_on_the_cpu(two_fake_gpus: None, tmp_path: Path) -> None:
    steps = [
        {"name": "int8", "pass": "quantize.static"},
        {"name": "fp16", "pass": "quantize.half"},
    ]
    lat = {"batch_sizes": [1], "warmup": 1, "min_runs": 3, "min_time_s": 0}
    result = run(
        tiny_recipe(tmp_path, devices=["auto"], steps=steps, evaluate={"latency": lat, "memory": False})
    )
    res = load_results(result.run_dir)
    assert [d["device"] for d in res["devices"]] == ["cpu", "cuda:0"]
    by = {v["name"]: v for v in res["variants"]}
    assert {m["device"] for m in by["baseline"]["latency"]} == {"cpu", "cuda:0"}
    # int8 runs on the CPU only: measured there (accuracy and latency), "cpu only" on the GPU
    assert {m["device"] for m in by["int8"]["latency"]} == {"cpu"}
    assert by["int8"]["accuracy"]["device"] == "cpu" and by["int8"]["accuracy"]["top1"] > 50
    assert any("cpu only" in s["reason"] for s in by["int8"]["skipped_devices"])
    assert {m["device"] for m in by["fp16"]["latency"]} == {"cuda:0"}
    assert by["fp16"]["accuracy"]["device"] == "cuda:0"


def test_out_of_range_cuda_index() -> None:
    choice = resolve_device("cuda:7")
    assert not choice.available


def test_env_json_parses_and_table_prints() -> None:
    proc = run_cli("env", "--json")
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert data["cuda_available"] == torch.cuda.is_available()
    assert data["cpu"]["torch_threads"] >= 1
    table = run_cli("env")
    assert table.returncode == 0 and "quantized engines" in table.stdout


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU")
def test_cuda_run_measures_both_devices(tmp_path: Path) -> None:
    steps = [
        {"name": "int8", "pass": "quantize.static"},
        {"name": "fp16", "pass": "quantize.half"},
        {"name": "bf16", "pass": "quantize.half", "options": {"dtype": "bfloat16"}},
    ]
    result = run(tiny_recipe(tmp_path, devices=["cpu", "cuda"], steps=steps))
    res = load_results(result.run_dir)
    by = {v["name"]: v for v in res["variants"]}
    assert {m["device"] for m in by["baseline"]["latency"]} == {"cpu", "cuda:0"}
    assert {m["device"] for m in by["int8"]["latency"]} == {"cpu"}
    assert any("cpu only" in s["reason"] for s in by["int8"]["skipped_devices"])
    assert {m["device"] for m in by["fp16"]["latency"]} == {"cuda:0"}
    assert by["fp16"]["accuracy"]["top1"] > 80


def test_onnx_variant_on_cuda_needs_the_cuda_provider(tmp_path: Path) -> None:
    from torchtame.runtime import cuda_provider_available
    from torchtame.variant import Variant

    v = Variant(name="m-onnx", onnx_path=tmp_path / "m.onnx")
    ok, reason = v.runs_on("cuda:0")
    assert ok == cuda_provider_available()
    if not ok:
        assert "onnxruntime-gpu" in reason
    assert v.runs_on("cpu") == (True, "")
