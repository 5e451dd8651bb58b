"""Report tables of training-time compression: sparsity per layer (prune.sparse) and the QAT
training curve (quantize.qat), read from each variant's info."""

from __future__ import annotations

from typing import Any

from ..results import info_of, size_of

Table = tuple[str, str, list[str], list[list[str]]]  # title, note, header, rows


def sparse_variants(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in results.get("variants", []) if info_of(v).get("layer_sparsity")]


def sparsity_table(results: dict[str, Any]) -> Table | None:
    """Layer x sparse variant: the fraction of zero weights; a size row both ways underneath."""
    variants = sparse_variants(results)
    if not variants:
        return None
    layers: list[str] = []
    for v in variants:
        layers += [n for n in info_of(v)["layer_sparsity"] if n not in layers]
    head = ["layer", *[f"{v['name']} ({info_of(v).get('pattern')})" for v in variants]]
    body = [[layer, *[_pct(info_of(v)["layer_sparsity"].get(layer)) for v in variants]] for layer in layers]
    body.append(["all sparsified layers", *[_pct(info_of(v).get("sparsity")) for v in variants]])
    body.append(["MB saved (dense file)", *[_mb(size_of(v).get("bytes")) for v in variants]])
    body.append(["MB in a sparse format", *[_mb(size_of(v).get("sparse_format_bytes")) for v in variants]])
    body.append(["MB compressed (xz)", *[_mb(size_of(v).get("compressed_bytes")) for v in variants]])
    note = (
        "Fraction of zero weights per layer (dense: left alone). The saved files are dense; the sparse-"
        "format size is what non-zero values plus a one-bit-per-weight mask take; compressed is the "
        "saved file through xz. Dense kernels multiply the zeros, so on the CPU sparsity shrinks a "
        "model in a sparse format but does not speed it up."
    )
    return "Sparsity", note, head, body


def qat_table(results: dict[str, Any]) -> Table | None:
    """Epoch x QAT variant: training loss and fidelity to float on held-apart calibration batches."""
    curves = [
        (v["name"], info_of(v)["curve"]) for v in results.get("variants", []) if info_of(v).get("curve")
    ]
    if not curves:
        return None
    head = ["epoch", *[f"{name} loss" for name, _ in curves], *[f"{name} cosine" for name, _ in curves]]
    epochs = max(len(c) for _, c in curves)
    body = []
    for i in range(epochs):
        row = [str(i)]
        row += [_num(c[i].get("loss")) if i < len(c) else "-" for _, c in curves]
        row += [_num(c[i].get("cosine"), 5) if i < len(c) else "-" for _, c in curves]
        body.append(row)
    note = (
        "Quantization-aware training: epoch 0 is the fake-quantized model after calibration, before any "
        "training; cosine is its fidelity to the float model on calibration batches held apart from "
        "training and evaluation."
    )
    return "Quantization-aware training", note, head, body


def tables(results: dict[str, Any]) -> list[Table]:
    return [t for t in (sparsity_table(results), qat_table(results)) if t is not None]


def _pct(v: float | None) -> str:
    return "dense" if not v else f"{100 * v:.1f}%"


def _mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 1e6:.3f}"


def _num(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def sparsity_plot(plt: Any, results: dict[str, Any]) -> Any:
    variants = sparse_variants(results)
    if not variants:
        return None
    layers: list[str] = []
    for v in variants:
        layers += [n for n in info_of(v)["layer_sparsity"] if n not in layers]
    fig, ax = plt.subplots(figsize=(6.4, 0.3 * len(layers) * len(variants) ** 0.5 + 1.4))
    height = 0.8 / len(variants)
    for k, v in enumerate(variants):
        values = [100 * info_of(v)["layer_sparsity"].get(n, 0.0) for n in layers]
        ax.barh([i + k * height for i in range(len(layers))], values, height=height, label=v["name"])
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(layers))], layers, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("zero weights per layer (%)")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


def qat_plot(plt: Any, results: dict[str, Any]) -> Any:
    curves = [
        (v["name"], info_of(v)["curve"]) for v in results.get("variants", []) if info_of(v).get("curve")
    ]
    if not curves:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    for name, c in curves:
        a.plot(
            [e["epoch"] for e in c if e.get("loss") is not None],
            [e["loss"] for e in c if e.get("loss") is not None],
            marker="o",
            label=name,
        )
        b.plot([e["epoch"] for e in c], [e["cosine"] for e in c], marker="o", label=name)
    a.set_xlabel("epoch")
    a.set_ylabel("training loss")
    b.set_xlabel("epoch")
    b.set_ylabel("cosine to float (held apart)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
