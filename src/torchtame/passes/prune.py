"""Structured (channel) pruning through torch-pruning.

Importance criteria and the pruner are separate objects, as in Torch-Pruning itself: the recipe
picks a criterion by name, a ratio (global, or per layer) or a target fraction of MACs/params,
and the pass removes whole channels, so the pruned model is smaller and faster without sparse
kernels. Optional fine-tuning between iterative steps recovers accuracy.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from ..errors import PassError, first_line
from ..evaluate.macs import count_macs_params
from ..inputs import call, output_items, prepare, select_output
from ..options import Strict, TrainOptions
from ..registry import register_pass
from ..variant import PassContext, Variant
from ._select import match_modules, require_float
from .attention import split_multihead
from .finetune import train_with
from .reconstruct import reconstruct_pruned_linears

Criterion = Literal["l1", "l2", "magnitude", "bn_scale", "taylor", "lamp", "fpgm", "random"]


class Target(Strict):
    macs: float | None = Field(None, gt=0, lt=1, description="Keep at most this fraction of MACs.")
    params: float | None = Field(None, gt=0, lt=1, description="Keep at most this fraction of params.")

    @model_validator(mode="after")
    def _one(self) -> Target:
        if (self.macs is None) == (self.params is None):
            raise ValueError("set exactly one of `macs` or `params`")
        return self

    @property
    def what(self) -> str:
        return "MACs" if self.macs is not None else "params"

    @property
    def goal(self) -> float:
        return self.macs if self.macs is not None else self.params  # type: ignore[return-value]

    def fraction(self, macs: int, params: int, base: tuple[int, int]) -> float:
        """The fraction of the baseline's MACs or params that ``macs``/``params`` keep."""
        return macs / base[0] if self.macs is not None else params / base[1]

    def reached(self, macs: int, params: int, base: tuple[int, int]) -> bool:
        return self.fraction(macs, params, base) <= self.goal + 1e-9


class FinetuneBetween(TrainOptions):
    """Training between iterative pruning steps (default: one epoch)."""

    epochs: int | None = Field(None, ge=1, le=1000, description="Passes over the train split (default 1).")


class PruneOptions(Strict):
    importance: Criterion = Field("l2", description="Channel importance criterion.")
    ratio: float | None = Field(
        0.5, ge=0, lt=1, description="Fraction of channels to remove in each prunable layer."
    )
    layer_ratios: dict[str, float] = Field(
        default_factory=dict, description="Per-layer ratios by module name (override `ratio`)."
    )
    target: Target | None = Field(None, description="Prune until at most this fraction remains.")
    global_pruning: bool = Field(False, description="Rank channels across layers, not per layer.")
    ignored_layers: list[str] | None = Field(
        None, description="Module names/regexes left untouched (default: the classifier head)."
    )
    round_to: int | None = Field(None, ge=1, description="Keep channel counts multiples of this.")
    iterative_steps: int = Field(1, ge=1, le=100)
    finetune_between: FinetuneBetween | None = None
    taylor_batches: int = Field(4, ge=1, description="Batches with gradients for `taylor`.")
    prune_heads: bool = Field(
        True,
        description="Attention models: remove whole heads besides FFN channels (query/key/value "
        "Linears as in BERT/DistilBERT/BART, fused qkv as in timm, nn.MultiheadAttention as in "
        "torchvision's ViT and nn.Transformer, which is first split into separate projections); the model "
        "width (embeddings, residual stream) is always kept.",
    )
    head_ratio: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Fraction of heads to remove per attention layer (default: `ratio`); with `ratio: 0` "
        "only heads are removed.",
    )
    max_layer_ratio: float = Field(0.9, gt=0, le=1, description="Never remove more per layer.")
    reconstruct: bool = Field(
        True,
        description="After pruning, refit each Linear whose inputs were pruned (attention output "
        "projections, second FFN Linears, classifiers) by least squares, so that on calibration "
        "batches it reproduces the unpruned layer's output; no labels, no training.",
    )
    reconstruct_batches: int = Field(16, ge=1, description="Calibration batches the refit uses.")

    @model_validator(mode="after")
    def _ratio_or_target(self) -> PruneOptions:
        if self.target is not None:
            self.ratio = None
        if self.ratio is None and self.target is None and not self.layer_ratios:
            raise ValueError("set `ratio`, `layer_ratios` or `target`")
        for name, r in self.layer_ratios.items():
            if not 0 <= r < 1:
                raise ValueError(f"layer_ratios[{name!r}] = {r} must be in [0, 1)")
        return self


def make_importance(name: str) -> Any:
    import torch_pruning as tp

    imp = tp.importance
    return {
        "l1": lambda: imp.GroupMagnitudeImportance(p=1),
        "l2": lambda: imp.GroupMagnitudeImportance(p=2),
        "magnitude": lambda: imp.GroupMagnitudeImportance(p=2),
        "bn_scale": lambda: imp.BNScaleImportance(),
        "taylor": lambda: imp.GroupTaylorImportance(),
        "lamp": lambda: imp.LAMPImportance(p=2),
        "fpgm": lambda: imp.FPGMImportance(p=2),
        "random": lambda: imp.RandomImportance(),
    }[name]()


def default_head(model: nn.Module, example: Any, output: str | int | None = None) -> list[str]:
    """The classifier head: the last Linear whose width is the output's last dimension, or the last
    Conv whose channels are the output's second dimension (for (N, C, H, W) outputs)."""
    with torch.no_grad():
        out = select_output(call(model, example), output)
    head = None
    for name, m in model.named_modules():
        linear = isinstance(m, nn.Linear) and out.dim() in (2, 3) and m.out_features == out.shape[-1]
        conv = isinstance(m, nn.Conv1d | nn.Conv2d) and out.dim() >= 3 and m.out_channels == out.shape[1]
        if linear or conv:
            head = name
    return [head] if head else []


def channel_counts(model: nn.Module) -> dict[str, int]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            out[name] = m.out_channels
        elif isinstance(m, nn.Linear):
            out[name] = m.out_features
    return out


# (query, key, value, head count) attribute names of attention modules whose heads can be pruned
HEAD_LAYOUTS = [
    ("query", "key", "value", "num_attention_heads"),  # BERT, RoBERTa, ViT (transformers)
    ("q_lin", "k_lin", "v_lin", "n_heads"),  # DistilBERT
    ("q_proj", "k_proj", "v_proj", "num_heads"),  # BART-style
]


@dataclass
class Attention:
    """The attention modules of a model and how torch-pruning is told about their heads."""

    num_heads: dict[nn.Module, int] = field(default_factory=dict)
    prunable: list[tuple[str, nn.Module, str, str]] = field(default_factory=list)  # name, module, q, n
    fixed: list[str] = field(default_factory=list)  # nn.MultiheadAttention: heads tied to the width
    unknown: list[str] = field(default_factory=list)


def _fused(m: nn.Module) -> bool:
    """timm's ``Attention`` layout: ``qkv`` Linear of 3 x heads x head_dim outputs, ``num_heads``."""
    qkv, heads = getattr(m, "qkv", None), getattr(m, "num_heads", None)
    return isinstance(qkv, nn.Linear) and isinstance(heads, int) and qkv.out_features % (3 * heads) == 0


def find_attention(model: nn.Module, ignored: list[str]) -> Attention:
    found = Attention()
    for name, m in model.named_modules():
        if any(name == i or name.startswith(i + ".") for i in ignored):
            continue
        if isinstance(m, nn.MultiheadAttention):
            found.num_heads[m] = m.num_heads
            found.fixed.append(name)
            continue
        layout = next(
            (
                (q, k, v, n)
                for q, k, v, n in HEAD_LAYOUTS
                if all(isinstance(getattr(m, a, None), nn.Linear) for a in (q, k, v))
                and isinstance(getattr(m, n, None), int)
            ),
            None,
        )
        if _fused(m):  # one qkv Linear holding every head's query, key and value (timm)
            found.num_heads[m.qkv] = m.num_heads
            found.prunable.append((name, m, "qkv", "num_heads"))
        elif layout is not None:
            q, k, v, n = layout
            for a in (q, k, v):
                found.num_heads[getattr(m, a)] = getattr(m, n)
            found.prunable.append((name, m, q, n))
        elif "attention" in type(m).__name__.lower():
            inner = [c for c in m.modules() if c is not m]
            if any(isinstance(c, nn.Linear) for c in inner) and not any(
                c in found.num_heads or isinstance(c, nn.MultiheadAttention) for c in inner
            ):
                found.unknown.append(name)
    known = {n for n, *_ in found.prunable} | set(found.fixed)
    found.unknown = [
        u for u in found.unknown if not any(k.startswith(u + ".") or u.startswith(k + ".") for k in known)
    ]
    return found


def _taylor_grads(model: nn.Module, ctx: PassContext, batches: int) -> None:
    loader = ctx.data.train or ctx.data.calibration
    if not ctx.data.use_labels:
        raise PassError(
            "`importance: taylor` needs labels the optimizer may use", hint="use l2 or lamp instead"
        )
    model.zero_grad()
    loss_fn = nn.CrossEntropyLoss()
    for i, (x, y) in enumerate(loader):
        if i >= batches:
            break
        loss_fn(select_output(call(model, x), ctx.output), y).backward()


def _head_options(attention: Attention, opts: PruneOptions, ratio: float) -> dict[str, Any]:
    if not attention.num_heads:
        return {}
    heads = opts.prune_heads and bool(attention.prunable)
    head_ratio = opts.head_ratio if opts.head_ratio is not None else ratio
    return {
        "num_heads": attention.num_heads,
        "prune_num_heads": heads,
        "prune_head_dims": False,
        "head_pruning_ratio": head_ratio if heads else 0.0,
    }


def _update_heads(attention: Attention, pruner: Any) -> dict[str, list[int]]:
    """Tell each pruned attention module its new head count; returns {module: [before, after]}."""
    changed = {}
    for name, m, q, n in attention.prunable:
        before = getattr(m, n)
        after = pruner.num_heads.get(getattr(m, q), before)
        setattr(m, n, after)
        if hasattr(m, "all_head_size"):
            m.all_head_size = getattr(m, q).out_features
        if q == "qkv":  # fused: the head width is unchanged, so is the softmax scale
            head_dim = m.qkv.out_features // (3 * after)
            if hasattr(m, "head_dim"):
                m.head_dim = head_dim
            if hasattr(m, "attn_dim"):
                m.attn_dim = after * head_dim
        changed[name] = [before, after]
    return changed


def _check_runs(model: nn.Module, example: Any) -> None:
    """A pruned model that cannot run its example input is an error, never a variant."""
    try:
        with torch.no_grad():
            call(model, example)
    except Exception as exc:
        raise PassError(
            f"the pruned model no longer runs: {first_line(exc, 200)}",
            hint="torch-pruning missed a coupling in this model; add the layer involved (or its parent "
            "block) to `ignored_layers`",
        ) from exc


def _all_outputs_sum(out: Any) -> torch.Tensor:
    """torch-pruning traces the graph back from this: every output tensor, so no branch is missed."""
    return sum(t.float().sum() for _, t in output_items(out))  # type: ignore[return-value]


NAME = "prune.structured"


@register_pass(
    NAME,
    PruneOptions,
    traits={"prunes", "trains"},
    hints={
        "slower": "prune more, or `round_to: 8` so the remaining widths suit the kernels",
        "fidelity": "fine-tune after pruning (a `finetune` step; `loss: distill` needs no labels), or prune "
        "less (`ratio`, `layer_ratios`)",
    },
)
def prune_structured(model: nn.Module | None, ctx: PassContext, opts: PruneOptions) -> Variant:
    """Remove whole channels ranked by an importance criterion (torch-pruning)."""
    assert model is not None
    require_float(ctx, NAME, "prune first, then quantize (`from:` the pruned variant)")
    model = model.float().eval()
    example = ctx.example_input
    kept = match_modules(model, opts.ignored_layers, "ignored_layers") if opts.ignored_layers else []
    split = split_multihead(model, kept) if opts.prune_heads else []
    unpruned = copy.deepcopy(model) if opts.reconstruct else None
    plan = _plan(model, ctx, opts)
    before_channels = channel_counts(model)
    base = count_macs_params(model, example)
    pruner, steps = _pruner(model, example, opts, plan)
    original_heads = {name: getattr(m, n) for name, m, _, n in plan.attention.prunable}
    history = _prune_steps(model, ctx, opts, pruner, steps, base, plan.attention)
    model.eval()
    heads = {k: [original_heads[k], after] for k, (_, after) in _update_heads(plan.attention, pruner).items()}
    _check_runs(model, example)
    refit = None
    if unpruned is not None:
        batches = [prepare(x) for x, *_ in itertools.islice(ctx.data.calibration, opts.reconstruct_batches)]
        refit = reconstruct_pruned_linears(model, unpruned, batches)
        del unpruned
    macs, params = count_macs_params(model, example)
    if opts.target is not None and not opts.target.reached(macs, params, base):
        raise PassError(
            f"pruning reached {opts.target.fraction(macs, params, base):.1%} of the baseline "
            f"{opts.target.what}, not the target {opts.target.goal:.0%}",
            hint="raise `max_layer_ratio`, or prune fewer ignored layers",
        )
    after = channel_counts(model)
    return ctx.variant(
        model,
        info={
            "importance": opts.importance,
            "ratio": opts.ratio,
            "ignored_layers": plan.names,
            "macs_fraction": round(macs / base[0], 4),
            "params_fraction": round(params / base[1], 4),
            "steps": history,
            "channels": {n: [before_channels[n], after[n]] for n in before_channels if n in after},
            **({"attention_heads": heads} if heads else {}),
            **({"heads_kept_whole": plan.attention.fixed} if plan.attention.fixed else {}),
            **({"multihead_split": split} if split else {}),
            **({"recurrent_kept_whole": plan.recurrent} if plan.recurrent else {}),
            **({"reconstruction": refit} if refit is not None else {}),
        },
    )


@dataclass
class Plan:
    """What is pruned: the layers left whole (by name, and every module kept), the attention
    layout, and the per-layer ratios."""

    names: list[str]
    ignored: list[nn.Module]
    recurrent: list[str]
    attention: Attention
    ratio_dict: dict[nn.Module, float]


def _plan(model: nn.Module, ctx: PassContext, opts: PruneOptions) -> Plan:
    names = (
        default_head(model, ctx.example_input, ctx.output)
        if opts.ignored_layers is None
        else match_modules(model, opts.ignored_layers, "ignored_layers")
    )
    attention = find_attention(model, names)
    if attention.unknown:
        shown = ", ".join(attention.unknown[:3])
        kind = type(model.get_submodule(attention.unknown[0])).__name__
        raise PassError(
            f"torch-pruning cannot prune attention module(s) {shown} ({kind}): their head layout is not "
            "one torchtame knows (query/key/value Linears with a head count)",
            hint=f"add them to `ignored_layers: [{shown}]` to prune only the other layers",
        )
    ignored = [model.get_submodule(n) for n in names]
    # embedding tables stay whole: their rows are the vocabulary, and in attention models their
    # width is the model width (the residual stream every layer adds to)
    ignored += [m for m in model.modules() if isinstance(m, nn.Embedding)]
    # vision Transformers embed patches with a convolution whose channels are the model width
    widths = {m.in_features for m in attention.num_heads if isinstance(m, nn.Linear)}
    ignored += [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.out_channels in widths]
    # torch-pruning's RNN handler breaks on LSTM/GRU weights (index out of range in weight_hh)
    recurrent = [n for n, m in model.named_modules() if isinstance(m, nn.RNNBase) and m not in ignored]
    ignored += [model.get_submodule(n) for n in recurrent]
    ratio_dict = {
        model.get_submodule(n): r
        for pattern, r in opts.layer_ratios.items()
        for n in match_modules(model, [pattern], "layer_ratios")
    }
    return Plan(names, ignored, recurrent, attention, ratio_dict)


def _pruner(model: nn.Module, example: Any, opts: PruneOptions, plan: Plan) -> tuple[Any, int]:
    """torch-pruning's pruner and how many steps it takes (a target prunes in small steps until
    it is reached)."""
    import torch_pruning as tp

    if opts.target is not None:
        steps, ratio = max(opts.iterative_steps, 20), opts.max_layer_ratio
    else:
        steps, ratio = opts.iterative_steps, opts.ratio or 0.0
    ignored = plan.ignored
    heads_only = (
        ratio == 0 and not plan.ratio_dict and bool(opts.head_ratio) and bool(plan.attention.prunable)
    )
    if heads_only:  # torch-pruning prunes nothing at ratio 0: every other layer is held instead
        attention = set(plan.attention.num_heads)
        ignored = [
            *ignored,
            *(
                m
                for m in model.modules()
                if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d) and m not in attention
            ),
        ]
        ratio = opts.head_ratio or 0.0
    try:
        pruner = tp.pruner.MetaPruner(
            model,
            example,
            importance=make_importance(opts.importance),
            global_pruning=opts.global_pruning,
            pruning_ratio=ratio,
            pruning_ratio_dict=plan.ratio_dict or None,
            max_pruning_ratio=opts.max_layer_ratio,
            iterative_steps=steps,
            ignored_layers=ignored,
            round_to=opts.round_to,
            output_transform=_all_outputs_sum,
            **_head_options(plan.attention, opts, ratio),
        )
    except Exception as exc:
        raise PassError(
            f"torch-pruning cannot build a dependency graph of this model: {str(exc)[:200]}",
            hint="add the layer it names to `ignored_layers`",
        ) from exc
    return pruner, steps


def _prune_steps(
    model: nn.Module,
    ctx: PassContext,
    opts: PruneOptions,
    pruner: Any,
    steps: int,
    base: tuple[int, int],
    attention: Attention,
) -> list[dict[str, Any]]:
    """The pruning steps (fine-tuned between, where asked); stops once the target is reached."""
    history = []
    with ctx.progress.task(f"prune ({opts.importance})", total=steps) as task:
        for step in range(steps):
            if opts.importance == "taylor":
                model.train()
                _taylor_grads(model, ctx, opts.taylor_batches)
                model.eval()
            try:
                pruner.step()
            except Exception as exc:
                raise PassError(
                    f"torch-pruning failed at step {step + 1}: {str(exc)[:200]}",
                    hint="add the layer it names to `ignored_layers`",
                ) from exc
            model.zero_grad(set_to_none=True)
            _update_heads(attention, pruner)  # the model runs with its new head counts from here
            macs, params = count_macs_params(model, ctx.example_input)
            history.append({"step": step + 1, "macs": macs, "params": params})
            task.advance(1)
            if opts.finetune_between is not None and step + 1 < steps:
                train_with(
                    model, ctx, opts.finetune_between, f"fine-tune between steps {step + 1}", ctx.seed + step
                )
            if opts.target is not None and opts.target.reached(macs, params, base):
                break
    return history
