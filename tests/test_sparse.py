"""prune.sparse: unstructured and 2:4 weight sparsity, training that keeps the zeros, sparse then
int8, sizes both ways and the dense-kernel finding; on the digits CNN and on model code others
wrote (torchvision, transformers)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from torchtame import PassError, apply_pass, load_recipe, run
from torchtame.evaluate.size import sparse_format_bytes
from torchtame.passes.sparse import SparseOptions, check_pattern, layer_sparsity

ROOT = Path(__file__).resolve().parents[1]


def _accuracy(model: nn.Module, data) -> float:
    right = total = 0
    with torch.no_grad():
        for x, y in data.evaluation:
            right += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    return 100 * right / total


def test_pattern_2_4_is_read_as_written_even_unquoted() -> None:
    value = yaml.safe_load("pattern: 2:4")["pattern"]
    assert value == 124  # YAML 1.1's base-60 integer
    assert SparseOptions(pattern=value).n_m == (2, 4)
    assert SparseOptions(pattern="1:8").n_m == (1, 8)
    for bad in ("4:2", "2-4", "dense"):
        with pytest.raises(ValueError, match="neither `unstructured` nor N:M"):
            SparseOptions(pattern=bad)


def test_unstructured_keeps_accuracy_and_its_zeros_through_finetuning(trained_cnn, digits) -> None:
    before = _accuracy(trained_cnn, digits)
    options = {"sparsity": 0.5, "steps": 2, "finetune_between": {"epochs": 1}, "finetune": {"epochs": 2}}
    v = apply_pass("prune.sparse", trained_cnn, digits, options)
    assert v.info["sparsity"] == pytest.approx(0.5, abs=0.002)
    assert all(s == pytest.approx(0.5, abs=0.002) for s in v.info["layer_sparsity"].values())
    assert "classifier.4" in v.info["ignored_layers"]  # the head stays dense by default
    assert layer_sparsity(v.module)["classifier.4"] == 0
    assert not any(hasattr(m, "parametrizations") for m in v.module.modules())  # masks squashed
    assert _accuracy(v.module, digits) >= before - 1.0
    # global: one threshold, layers differ, each keeps something
    g = apply_pass("prune.sparse", trained_cnn, digits, {"sparsity": 0.8, "scope": "global"})
    per_layer = g.info["layer_sparsity"]
    assert g.info["sparsity"] == pytest.approx(0.8, abs=0.01)
    assert max(per_layer.values()) - min(per_layer.values()) > 0.2 and max(per_layer.values()) <= 0.95


def test_2_4_holds_on_real_layers_and_refuses_what_cannot_tile(trained_cnn, digits) -> None:
    import torchvision

    v = apply_pass("prune.sparse", trained_cnn, digits, {"pattern": "2:4", "finetune": {"epochs": 1}})
    names = list(v.info["layer_sparsity"])
    assert v.info["left_dense_untileable"] == ["features.0"]  # one input channel: nothing to tile
    assert not check_pattern(v.module, names, 2, 4)  # two zeros in every group of 4, after training
    assert all(w.is_contiguous() for w in v.module.parameters())  # no layout change passes as speed
    with pytest.raises(PassError, match=r"not a multiple of 4: features\.0") as err:
        options = {"pattern": "2:4", "ignored_layers": ["classifier.4"]}
        apply_pass("prune.sparse", trained_cnn, digits, options)
    assert "ignored_layers: [features.0]" in err.value.hint
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    sparse = copy.deepcopy(resnet)
    from torchtame.data import SyntheticData, load_data

    data = load_data(SyntheticData(source="synthetic", shape=[3, 32, 32], num_samples=16, batch_size=8), 0)
    s = apply_pass("prune.sparse", sparse, data, {"pattern": "2:4"})
    assert s.info["left_dense_untileable"] == ["conv1"]  # RGB input
    assert not check_pattern(s.module, list(s.info["layer_sparsity"]), 2, 4)
    assert s.module(x).shape == (2, 10)


def test_sparse_then_int8_keeps_the_zeros(trained_cnn, digits) -> None:
    from torchtame.passes.adaround import int8_weights

    sparse = apply_pass("prune.sparse", trained_cnn, digits, {"sparsity": 0.5})
    q = apply_pass("quantize.static", sparse.module, digits, {"mode": "fx"})
    zero = [float((t == 0).float().mean()) for t in int8_weights(q.module)]
    assert sum(z >= 0.5 for z in zero) == 4, zero  # every sparsified layer, still half zeros in int8
    weights = [t for t in int8_weights(q.module)]
    assert sparse_format_bytes(weights) < 0.65 * sum(t.numel() for t in weights)


def test_sparse_recipe_sizes_both_ways_and_says_kernels_are_dense(tmp_path: Path) -> None:
    recipe = yaml.safe_load((ROOT / "recipes" / "digits-sparse.yaml").read_text())
    assert recipe["steps"][1]["options"]["pattern"] == 124  # unquoted in the shipped recipe
    recipe["model"]["train"]["epochs"] = 4
    recipe["output_dir"] = str(tmp_path)
    recipe["evaluate"]["latency"] = {"batch_sizes": [32], "warmup": 2, "min_runs": 5, "min_time_s": 0.02}
    result = run(load_recipe(recipe))
    entries = {v["name"]: v for v in result.results["variants"]}
    base = entries["baseline"]["size"]["bytes"]
    assert "sparse_format_bytes" not in entries["baseline"]["size"]
    for name in ("sparse50", "sparse-2of4"):
        size = entries[name]["size"]
        assert size["bytes"] == pytest.approx(base, rel=0.01)  # saved dense, stated as such...
        assert size["sparse_format_bytes"] < 0.6 * base  # ...and what a sparse format takes
        codes = {f["code"]: f for f in entries[name]["health"]}
        assert "dense kernels on this device" in codes["sparse_dense_kernels"]["message"]
    small = entries["sparse50-int8"]["size"]
    assert small["compressed_bytes"] * 6 <= base  # >= 6x smaller than fp32 on disk, compressed
    assert small["sparse_format_bytes"] * 5.5 <= base  # ...and in a plain bitmask format
    report = (Path(result.run_dir) / "report.md").read_text()
    assert "## Sparsity" in report and "features.3" in report


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="2:4 sparse tensor cores need a CUDA GPU of compute capability 8.0+",
)
def test_semi_structured_2_4_runs_on_sparse_tensor_cores() -> None:
    from torchtame.data import SyntheticData, load_data
    from torchtame.passes.sparse import semi_structured

    data = load_data(SyntheticData(source="synthetic", shape=[256], num_samples=64, batch_size=32), 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()
    sparse = apply_pass("prune.sparse", model, data, {"pattern": "2:4", "ignored_layers": []}).module
    dense = sparse.half().cuda()
    fast = copy.deepcopy(dense)
    assert semi_structured(fast) == ["0", "2"]
    x = torch.randn(128, 256, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), dense(x), atol=2e-2, rtol=2e-2)
