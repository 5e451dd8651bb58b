"""``prune.sparse``: weight sparsity, unstructured (magnitude) or N:M semi-structured (2:4).

Zeros are set in the weights of Linear and Conv layers; the architecture is unchanged. Masks live
in torch.ao.pruning's ``FakeSparsity`` parametrizations (a ``BaseSparsifier`` whose mask rule
handles convolutions too: torch.ao's own ``WeightNormSparsifier`` only takes 2-D weights), so
fine-tuning between the steps of a gradual schedule, and after the last, keeps the zeros zero.
``squash_mask`` then leaves plain modules with zeros in their weights.

N:M groups run along the input dimension: M consecutive input features of a Linear, M consecutive
input channels at each kernel position of a convolution (NVIDIA's ASP layout). On the CPU, and on
GPUs without sparse tensor cores, dense kernels still multiply the zeros: the variant is smaller
in a sparse format, not faster (the health check says so). On CUDA with compute capability 8.0+,
:func:`semi_structured` converts 2:4 Linear weights with ``to_sparse_semi_structured``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from ..errors import PassError
from ..options import Strict, TrainOptions
from ..registry import register_pass
from ..variant import PassContext, Variant
from ._select import match_modules, require_float
from .finetune import train_with

log = logging.getLogger("torchtame")

SPARSE_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def parse_pattern(value: Any) -> Any:
    """``2:4`` as users write it. YAML 1.1 reads an unquoted ``2:4`` as the base-60 integer 124:
    that integer is read back as the pattern it came from (2 * 60 + 4)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 60:
        n, m = divmod(value, 60)
        return f"{n}:{m}"
    return value


class SparseOptions(Strict):
    sparsity: float = Field(
        0.5, gt=0, lt=1, description="Unstructured: fraction of weights set to zero (N:M: fixed by N/M)."
    )
    pattern: str = Field(
        "unstructured",
        description="unstructured (magnitude), or N:M semi-structured, e.g. 2:4 (N zeros in every M "
        "consecutive input weights; 2:4 is what sparse tensor cores accelerate).",
    )
    scope: Literal["layer", "global"] = Field(
        "layer",
        description="Unstructured: every layer to the same sparsity, or one magnitude threshold across "
        "layers (layers differ; each keeps at least 5% of its weights).",
    )
    ignored_layers: list[str] | None = Field(
        None, description="Module names/regexes left dense (default: the classifier head)."
    )
    steps: int = Field(
        1, ge=1, le=100, description="Gradual schedule: reach the sparsity in this many steps."
    )
    finetune_between: TrainOptions | None = Field(
        None, description="Training between the steps of a gradual schedule (zeros stay zero)."
    )
    finetune: TrainOptions | None = Field(
        None, description="Training after the last step, zeros kept (`loss: distill` needs no labels)."
    )

    _parse = field_validator("pattern", mode="before")(parse_pattern)

    @field_validator("pattern")
    @classmethod
    def _known(cls, v: str) -> str:
        if v == "unstructured":
            return v
        parts = v.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or not 0 < int(parts[0]) < int(parts[1]):
            raise ValueError(f'pattern {v!r} is neither `unstructured` nor N:M with 0 < N < M, e.g. "2:4"')
        return v

    @property
    def n_m(self) -> tuple[int, int] | None:
        if self.pattern == "unstructured":
            return None
        n, m = self.pattern.split(":")
        return int(n), int(m)


def _groups(w: torch.Tensor, m: int) -> torch.Tensor:
    """The weight as (groups of ``m`` consecutive input weights, m): input dimension last."""
    if w.dim() > 2:  # (out, in, *kernel) -> (out, *kernel, in)
        w = w.movedim(1, -1)
    return w.reshape(-1, m)


def _ungroup(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if len(shape) > 2:
        moved = (shape[0], *shape[2:], shape[1])
        # contiguous: a weight left in another memory layout runs different (faster or slower)
        # kernels, and that must not pass for an effect of the zeros
        return mask.reshape(moved).movedim(-1, 1).contiguous()
    return mask.reshape(shape)


def nm_mask(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the M - N largest of every M consecutive input weights."""
    g = _groups(w.detach().abs(), m)
    drop = g.topk(n, dim=1, largest=False).indices
    keep = torch.ones_like(g, dtype=torch.bool).scatter_(1, drop, False)
    return _ungroup(keep, w.shape)


def magnitude_mask(w: torch.Tensor, sparsity: float, threshold: float | None = None) -> torch.Tensor:
    """Zero the smallest ``sparsity`` of ``w`` (or everything below a global ``threshold``)."""
    a = w.detach().abs()
    if threshold is None:
        k = round(sparsity * a.numel())
        if k == 0:
            return torch.ones_like(a, dtype=torch.bool)
        threshold = a.flatten().kthvalue(k).values.item()
        keep = a > threshold
    else:
        keep = a > threshold
        floor = max(1, int(0.05 * a.numel()))  # a layer never loses everything
        if int(keep.sum()) < floor:
            keep = a >= a.flatten().topk(floor).values[-1]
    return keep


def _sparsifier_class() -> type:
    from torch.ao.pruning import BaseSparsifier

    class MagnitudeSparsifier(BaseSparsifier):
        """torch.ao.pruning's sparsifier life cycle (FakeSparsity masks, squash_mask) with a mask
        rule for weights of any rank: N:M groups or magnitude (per layer, or one global threshold)."""

        def __init__(self, opts: SparseOptions) -> None:
            super().__init__(defaults={"sparsity_level": 0.0})
            self.opts = opts
            self.threshold: float | None = None

        def step(self) -> None:  # type: ignore[override]
            if self.opts.n_m is None and self.opts.scope == "global":
                self.threshold = self._global_threshold()
            super().step()

        def _global_threshold(self) -> float | None:
            level = self.groups[0]["sparsity_level"] if self.groups else 0.0
            if level <= 0:
                return None
            every = torch.cat([self._weight(g).detach().abs().flatten() for g in self.groups])
            return every.kthvalue(max(1, round(level * every.numel()))).values.item()

        @staticmethod
        def _weight(config: dict[str, Any]) -> torch.Tensor:
            module, name = config["module"], config["tensor_name"]
            return getattr(module.parametrizations, name).original

        def update_mask(self, module: nn.Module, tensor_name: str, sparsity_level: float, **kw: Any) -> None:
            mask = getattr(module.parametrizations, tensor_name)[0].mask
            w = getattr(module.parametrizations, tensor_name).original
            if sparsity_level <= 0:
                mask.data = torch.ones_like(mask)
            elif self.opts.n_m is not None:
                mask.data = nm_mask(w, *self.opts.n_m)
            else:
                mask.data = magnitude_mask(w, sparsity_level, self.threshold)

    return MagnitudeSparsifier


def targets(model: nn.Module, opts: SparseOptions, ignored: list[str]) -> tuple[list[str], list[str]]:
    """The layers to sparsify, and those left dense because N:M cannot tile their input width. With
    the default ``ignored_layers`` such layers stay dense (reported); where the user listed the
    layers to leave alone, one that cannot tile is an error, before any work."""
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, SPARSE_TYPES) and not any(n == i or n.startswith(i + ".") for i in ignored)
    ]
    untileable: list[str] = []
    if opts.n_m is not None:
        m = opts.n_m[1]
        untileable = [n for n in names if _in_width(model.get_submodule(n)) % m]
        if untileable and opts.ignored_layers is not None:
            shown = ", ".join(untileable[:4]) + (
                f" and {len(untileable) - 4} more" if len(untileable) > 4 else ""
            )
            raise PassError(
                f"{opts.pattern} sparsity tiles groups of {m} input weights, and {len(untileable)} layer(s) "
                f"have an input width that is not a multiple of {m}: {shown}",
                hint=f"add them to `ignored_layers: [{', '.join(untileable[:4])}]` (a regex may cover "
                "many), or use `pattern: unstructured`",
            )
        names = [n for n in names if n not in untileable]
        if untileable:
            log.info(
                "prune.sparse: %d layer(s) left dense, their input width is not a multiple of %d: %s",
                len(untileable),
                m,
                ", ".join(untileable[:4]),
            )
    if not names:
        raise PassError(
            "prune.sparse found no Linear or Conv layer to sparsify", hint="check `ignored_layers`"
        )
    return names, untileable


def _in_width(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels // layer.groups


def layer_sparsity(model: nn.Module, names: list[str] | None = None) -> dict[str, float]:
    """Fraction of zeros in each Linear/Conv weight."""
    return {
        n: round(float((m.weight == 0).float().mean()), 4)
        for n, m in model.named_modules()
        if isinstance(m, SPARSE_TYPES) and (names is None or n in names)
    }


def check_pattern(model: nn.Module, names: list[str], n: int, m: int) -> list[str]:
    """Layers whose weights break N:M (fewer than N zeros in some group of M)."""
    return [
        name
        for name in names
        if bool(((_groups(model.get_submodule(name).weight.detach(), m) == 0).sum(1) < n).any())
    ]


def semi_structured(model: nn.Module) -> list[str]:
    """Convert 2:4-sparse fp16 Linear weights to ``torch.sparse.SparseSemiStructuredTensor`` (CUDA,
    compute capability 8.0+, where sparse tensor cores run them); returns the layers converted."""
    from torch.sparse import to_sparse_semi_structured

    done = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m.weight.is_cuda and not check_pattern(model, [name], 2, 4):
            m.weight = nn.Parameter(to_sparse_semi_structured(m.weight.detach()), requires_grad=False)
            done.append(name)
    return done


def _schedule(opts: SparseOptions) -> list[float]:
    """Sparsity after each step: cubic ramp (Zhu & Gupta 2017), fast first, gentle at the end."""
    goal = opts.sparsity
    return [goal * (1 - (1 - (k + 1) / opts.steps) ** 3) for k in range(opts.steps)]


NAME = "prune.sparse"


@register_pass(
    NAME,
    SparseOptions,
    traits={"trains", "same_architecture"},
    hints={
        "fidelity": "fine-tune with the zeros kept (`finetune: {loss: distill}`), a gradual schedule "
        "(`steps: 4` with `finetune_between`), lower `sparsity`, or leave sensitive layers dense "
        "(`ignored_layers`)",
    },
)
def prune_sparse(model: nn.Module | None, ctx: PassContext, opts: SparseOptions) -> Variant:
    """Zero weights by magnitude, unstructured or N:M, with optional training that keeps them zero."""
    from .prune import default_head

    assert model is not None
    require_float(ctx, NAME, "sparsify first, then quantize (`from:` the sparse variant)")
    model = model.float().eval()
    ignored = (
        default_head(model, ctx.example_input, ctx.output)
        if opts.ignored_layers is None
        else match_modules(model, opts.ignored_layers, "ignored_layers")
    )
    names, untileable = targets(model, opts, ignored)
    sparsifier = _sparsifier_class()(opts)
    sparsifier.prepare(model, [{"tensor_fqn": f"{n}.weight"} for n in names])
    history: list[dict[str, Any]] = []
    levels = [1.0] if opts.n_m is not None else _schedule(opts)
    for step, level in enumerate(levels):
        for group in sparsifier.groups:
            group["sparsity_level"] = level
        sparsifier.step()
        entry: dict[str, Any] = {"step": step + 1, "target": round(level, 4)}
        last = step + 1 == len(levels)
        train = opts.finetune if last else opts.finetune_between
        if train is not None:
            stats = train_with(model, ctx, train, f"fine-tune sparse (step {step + 1})", ctx.seed + step)
            entry["train_loss"] = stats.get("epoch_losses", [None])[-1]
        history.append(entry)
    sparsifier.squash_mask()
    with torch.no_grad():
        for n in names:  # the dense layout the parent had (see _ungroup)
            layer = model.get_submodule(n)
            layer.weight = nn.Parameter(layer.weight.detach().contiguous())
    model.eval()
    per_layer = layer_sparsity(model, names)
    total = sum(model.get_submodule(n).weight.numel() for n in names)
    zeros = sum(per_layer[n] * model.get_submodule(n).weight.numel() for n in names)
    if opts.n_m is not None and (broken := check_pattern(model, names, *opts.n_m)):
        raise PassError(f"{opts.pattern} pattern not held after training in {', '.join(broken[:3])}")
    log.info(
        "prune.sparse: %.1f%% of %d layers' weights are zero (%s)",
        100 * zeros / total,
        len(names),
        opts.pattern,
    )
    return ctx.variant(
        model,
        info={
            "pattern": opts.pattern,
            "scope": opts.scope if opts.n_m is None else "layer",
            "sparsity": round(zeros / total, 4),
            "layers": len(names),
            "ignored_layers": ignored,
            **({"left_dense_untileable": untileable} if untileable else {}),
            "layer_sparsity": per_layer,
            "steps": history,
            "kernels": "dense: the zeros are multiplied on this device; the sparse-format size is in "
            "the size figures",
        },
    )
