"""Per-layer sensitivity: quantize (or prune) one layer at a time and measure the accuracy drop."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._warnings import caught
from ..data import DataBundle
from ..errors import first_line
from ..evaluate.accuracy import predict, top1_accuracy
from ..inputs import as_args, call, output_items
from ..passes.prune import default_head, make_importance
from ..passes.static.fx import StaticOptions, build_qconfig, calibrate_loader
from ..progress import NullProgress, Progress
from ..runtime import check_backend, quantized_engine

WEIGHT_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


METRICS = {
    "top1": "top-1 accuracy (%)",
    "agreement": "top-1 agreement with the baseline (%)",
    "cosine": "cosine similarity to the baseline (x100)",
}


def score(
    module: nn.Module,
    data: DataBundle,
    reference: torch.Tensor | None,
    backend: str | None = None,
    metric: str | None = None,
    output: str | int | None = None,
) -> float:
    """``metric`` on the evaluation split, in points: top-1 accuracy (labels the optimizer may
    use), top-1 agreement with ``reference`` outputs, or their cosine similarity x 100. Default:
    top-1 where labels may be used, else agreement."""
    metric = metric or ("top1" if data.use_labels else "agreement")
    if metric == "top1":
        return top1_accuracy(module, data.evaluation, backend, output)
    assert reference is not None
    with quantized_engine(backend), torch.inference_mode():
        outputs, _ = predict(lambda x: call(module, x), lambda x: x, data.evaluation, output)
    if metric == "cosine":
        cos = torch.nn.functional.cosine_similarity(outputs.flatten(1), reference.flatten(1), dim=1)
        return 100.0 * cos.mean().item()
    return 100.0 * (outputs.argmax(-1) == reference.argmax(-1)).float().mean().item()


def weight_layers(model: nn.Module) -> list[tuple[str, str]]:
    """(name, type) of every Conv/Linear layer, in execution-definition order."""
    return [(n, type(m).__name__) for n, m in model.named_modules() if isinstance(m, WEIGHT_LAYERS)]


def execution_order(model: nn.Module, example: Any) -> list[str]:
    """Names of the Conv/Linear layers in the order one forward pass runs them (first calls)."""
    order: list[str] = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, name=name: order.append(name) if name not in order else None
        )
        for name, m in model.named_modules()
        if isinstance(m, WEIGHT_LAYERS)
    ]
    try:
        with torch.inference_mode():
            call(model, example)
    finally:
        for h in hooks:
            h.remove()
    return order


def quantize_one(
    model: nn.Module, layer: str, data: DataBundle, opts: StaticOptions, backend: str
) -> nn.Module:
    """``model`` with only ``layer`` statically quantized (FX), everything else float."""
    from torch.ao.quantization import QConfigMapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    mapping = QConfigMapping().set_module_name(layer, build_qconfig(opts, backend))
    args, _ = as_args(data.example_input(1))
    prepared = prepare_fx(model.eval(), mapping, args)
    calibrate_loader(prepared, data.calibration, opts.calibration_batches)
    return convert_fx(prepared)


def quantization_sensitivity(
    model: nn.Module,
    data: DataBundle,
    baseline_score: float,
    reference: torch.Tensor | None,
    opts: StaticOptions | None = None,
    progress: Progress | None = None,
    metric: str | None = None,
    output: str | int | None = None,
) -> list[dict[str, Any]]:
    """The drop (points of ``metric``) from quantizing each Conv/Linear layer alone, most
    sensitive first."""
    import copy

    opts = opts or StaticOptions()
    backend = check_backend(opts.backend, static=True)
    progress = progress or NullProgress()
    layers = weight_layers(model)
    out = []
    with (
        caught("sensitivity"),
        quantized_engine(backend),
        progress.task("sensitivity: int8 per layer", len(layers)) as t,
    ):
        for name, kind in layers:
            try:
                q = quantize_one(copy.deepcopy(model), name, data, opts, backend)
                drop = baseline_score - score(q, data, reference, backend, metric, output)
                out.append({"layer": name, "type": kind, "drop": round(drop, 3)})
            except Exception as exc:  # an untraceable model gives no quantization sensitivity
                out.append({"layer": name, "type": kind, "drop": None, "error": first_line(exc, 160)})
            t.advance(1)
    return sorted(out, key=lambda s: -(s["drop"] if s["drop"] is not None else float("-inf")))


def pruning_sensitivity(
    model: nn.Module,
    data: DataBundle,
    baseline_score: float,
    reference: torch.Tensor | None,
    ratio: float = 0.5,
    importance: str = "l2",
    progress: Progress | None = None,
    metric: str | None = None,
    output: str | int | None = None,
) -> list[dict[str, Any]]:
    """The drop (points) from pruning ``ratio`` of each layer's channels alone (no fine-tuning)."""
    import copy

    import torch_pruning as tp

    progress = progress or NullProgress()
    example = data.example_input(1)
    head = set(default_head(model, example, output))
    layers = [(n, k) for n, k in weight_layers(model) if n not in head]
    out = []
    with caught("sensitivity"), progress.task("sensitivity: pruning per layer", len(layers)) as t:
        for name, kind in layers:
            m = copy.deepcopy(model).eval()
            try:
                pruner = tp.pruner.MetaPruner(
                    m,
                    example,
                    importance=make_importance(importance),
                    pruning_ratio=0.0,
                    pruning_ratio_dict={m.get_submodule(name): ratio},
                    ignored_layers=[m.get_submodule(h) for h in head],
                    output_transform=lambda out: sum(t.float().sum() for _, t in output_items(out)),
                )
                pruner.step()
                drop = baseline_score - score(m, data, reference, None, metric, output)
                out.append({"layer": name, "type": kind, "drop": round(drop, 3)})
            except Exception as exc:  # a layer torch-pruning cannot handle alone
                out.append({"layer": name, "type": kind, "drop": None, "error": first_line(exc, 160)})
            t.advance(1)
    return sorted(out, key=lambda s: -(s["drop"] if s["drop"] is not None else float("-inf")))
