"""A short, plain training loop used to train quickstart models and to fine-tune pruned ones."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .errors import DataError
from .inputs import batch_size, call, prepare, select_output
from .options import TrainOptions
from .progress import NullProgress, Progress


def recalibrate_batchnorm(model: nn.Module, batches: Any) -> nn.Module:
    """Recompute every BatchNorm's running statistics from ``batches`` (input structures), e.g.
    for random-weight models, whose stored statistics otherwise shrink activations to ~1e-9 in
    deep networks (no int8 format can represent them, no fidelity figure can judge them), or
    after pruning. Returns the model in eval mode, each BatchNorm's momentum as it was (left at
    None, later training would keep a cumulative average, and torch.export cannot capture it
    in training mode: PT2E QAT refused such a model)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over all batches
    model.train()
    try:
        with torch.no_grad():
            for x in batches:
                call(model, x)
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
    return model.eval()


LR_SCALE = "torchtame_lr_scale"


def make_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters. A parameter with a ``torchtame_lr_scale``
    attribute (:data:`LR_SCALE`) trains in its own group at ``lr`` times that scale, without weight
    decay (QAT's learned activation ranges); the rest at ``lr``."""
    scales: dict[float | None, list[nn.Parameter]] = {}  # None: unmarked, at ``lr`` with decay
    for p in model.parameters():
        if p.requires_grad:
            scales.setdefault(getattr(p, LR_SCALE, None), []).append(p)
    groups = [
        {"params": ps, "lr": lr, "weight_decay": weight_decay}
        if k is None
        else {"params": ps, "lr": lr * k, "weight_decay": 0.0}
        for k, ps in scales.items()
    ]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    return torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay)


@dataclass(frozen=True)
class Distill:
    """Learn from a teacher's outputs instead of (or besides) labels: KL divergence to the
    teacher's softened class scores, or cosine / MSE to its features."""

    teacher: nn.Module
    temperature: float = 4.0
    alpha: float = 0.0  # weight of cross-entropy on labels, where labels may be used
    features: bool = False  # the output is an embedding or hidden states, not class scores
    feature_loss: str = "cosine"
    logits_loss: str = "kl"  # class scores: kl (softened), or cosine / mse on the scores themselves
    intermediate: str | tuple[str, ...] = "none"  # modules whose outputs are matched too
    intermediate_weight: float = 1.0

    def loss(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        if self.features or self.logits_loss != "kl":
            kind = self.feature_loss if self.features else self.logits_loss
            s, t = student.float().flatten(1), teacher.float().flatten(1)
            if kind == "mse":
                return nn.functional.mse_loss(s, t)
            return (1.0 - nn.functional.cosine_similarity(s, t, dim=1)).mean()
        s, t = student.float().reshape(-1, student.shape[-1]), teacher.float().reshape(-1, teacher.shape[-1])
        temp = self.temperature
        kl = nn.functional.kl_div(
            nn.functional.log_softmax(s / temp, dim=-1),
            nn.functional.softmax(t / temp, dim=-1),
            reduction="batchmean",
        )
        return kl * temp * temp


def train(
    model: nn.Module,
    loader: DataLoader | None,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    lr: float = 1e-3,
    optimizer: str = "adam",
    weight_decay: float = 0.0,
    device: str = "cpu",
    seed: int = 0,
    progress: Progress | None = None,
    description: str = "train",
    output: str | int | None = None,
    distill: Distill | None = None,
    use_labels: bool = True,
    on_step: Callable[[int], None] | None = None,
    on_epoch: Callable[[int, float], None] | None = None,
    mixup: float = 0.0,
) -> dict[str, Any]:
    """Train ``model`` in place on its measured ``output``: cross-entropy on labels, or
    distillation from ``distill.teacher`` (no labels needed; mixed with cross-entropy by
    ``distill.alpha`` where labels may be used). Returns the mean loss of each epoch.

    Runs ``epochs`` passes over ``loader`` or exactly ``steps`` optimizer steps (cycling the loader).
    ``on_step(steps done)`` runs once before the first step (0, the model in training mode) and
    after every optimizer step; ``on_epoch(epoch, mean loss)`` after
    every pass (quantization-aware training freezes and records there). ``mixup`` > 0 trains on
    mixed pairs of inputs (:class:`Mixup`). The model is left in eval mode on the CPU.
    """
    _check_trainable(loader, distill, use_labels)
    assert loader is not None
    torch.manual_seed(seed)
    # A loader of our own, so the shuffle order depends on ``seed`` alone, not on earlier use.
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=True, generator=generator)
    progress = progress or NullProgress()
    model.to(device).train()
    teacher = distill.teacher.to(device).eval() if distill is not None else None
    opt = make_optimizer(model, optimizer, lr, weight_decay)
    total = steps if steps is not None else (epochs or 1) * len(loader)
    peaks = [group["lr"] for group in opt.param_groups]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peaks, total_steps=total)
    objective = _Objective(model, distill, output, use_labels, Mixup(mixup, seed) if mixup > 0 else None)
    epoch_losses: list[float] = []
    done = 0
    if on_step is not None:
        on_step(0)
    with progress.task(description, total=total) as task:
        while done < total:
            running, count = 0.0, 0
            for x, y in loader:
                if done >= total:
                    break
                x, y = prepare(x, device), y.to(device)
                opt.zero_grad(set_to_none=True)
                loss = objective(x, y, done)
                loss.backward()
                opt.step()
                sched.step()
                n = batch_size(x)
                running += loss.item() * n
                count += n
                done += 1
                task.advance(1, loss=f"{loss.item():.3f}")
                if on_step is not None:
                    on_step(done)
            epoch_losses.append(running / max(count, 1))
            if on_epoch is not None:
                on_epoch(len(epoch_losses), epoch_losses[-1])
    model.eval()  # (exported graphs' eval() returns None: not chained)
    model.to("cpu")
    if teacher is not None:
        teacher.to("cpu")
    return {
        "steps": done,
        "epoch_losses": [round(v, 5) for v in epoch_losses],
        "loss": "distill" if distill is not None else "cross-entropy",
    }


def _check_trainable(loader: DataLoader | None, distill: Distill | None, use_labels: bool) -> None:
    """Training needs a train split, and labels unless it distils."""
    if loader is None:
        need = "data" if distill is not None else "labelled data"
        raise DataError(
            f"training needs {need}, but the data source has no train split",
            hint="use a data source with labels (digits, imagefolder) and a `split.train` > 0"
            if distill is None
            else "use a data source with a `split.train` > 0",
        )
    if distill is None and not use_labels:
        raise DataError(
            "training with cross-entropy needs labels, but they are withheld from the optimizer "
            "(`data.labels: report_only`) or absent",
            hint="use `loss: distill` (learns from the baseline's outputs, no labels needed)",
        )


class Mixup:
    """Mixed pairs of inputs (Zhang et al. 2018): ``lam * x + (1 - lam) * x[perm]`` with ``lam`` drawn
    from Beta(alpha, alpha) per batch, reproducibly from ``seed``. Under distillation the teacher
    scores the same mixed inputs ("function matching", Beyer et al. 2022), so the student also
    learns the teacher between the training samples; cross-entropy weighs both labels by ``lam``."""

    def __init__(self, alpha: float, seed: int) -> None:
        import numpy as np

        self.alpha = alpha
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, x: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            kind = type(x).__name__ if not isinstance(x, torch.Tensor) else f"{x.dtype} tensor"
            raise DataError(
                f"`mixup` mixes float inputs (images, features), but this model's inputs are {kind}",
                hint="set `mixup: 0` for token ids or structured inputs",
            )
        lam = float(self.rng.beta(self.alpha, self.alpha))
        perm = torch.randperm(x.shape[0], generator=self.generator).to(x.device)
        return lam * x + (1.0 - lam) * x[perm], perm, lam


class _Objective:
    """The loss of one batch: cross-entropy on labels, distillation from the teacher, or their mix
    (labels count where they may be used and distillation's ``alpha`` gives them weight); on mixed
    inputs where ``mixup`` is given."""

    def __init__(
        self,
        model: nn.Module,
        distill: Distill | None,
        output: str | int | None,
        use_labels: bool,
        mixup: Mixup | None = None,
    ) -> None:
        self.model, self.distill, self.output, self.mixup = model, distill, output, mixup
        self.teacher = distill.teacher if distill is not None else None
        self.with_labels = use_labels and (distill is None or distill.alpha > 0)
        self.ce = nn.CrossEntropyLoss()
        self.inner = (
            intermediate_modules(distill.teacher, model, distill.intermediate) if distill is not None else []
        )

    def _ce(self, out: torch.Tensor, y: torch.Tensor, perm: torch.Tensor | None, lam: float) -> torch.Tensor:
        if perm is None:
            return self.ce(out, y)
        return lam * self.ce(out, y) + (1.0 - lam) * self.ce(out, y[perm])

    def __call__(self, x: Any, y: torch.Tensor, done: int) -> torch.Tensor:
        if self.with_labels and (y < 0).any():
            raise DataError(
                "training needs labels, but the data has label -1 (unlabelled)",
                hint="use `loss: distill` with `alpha: 0` (no labels needed)",
            )
        perm, lam = None, 1.0
        if self.mixup is not None:
            x, perm, lam = self.mixup(x)
        with _outputs_of(self.model, self.inner) as inner:
            out = select_output(call(self.model, x), self.output)
        if self.distill is None:
            loss = self._ce(out, y, perm, lam)
        else:
            assert self.teacher is not None
            with torch.no_grad(), _outputs_of(self.teacher, self.inner) as taught:
                target = select_output(call(self.teacher, x), self.output)
            loss = self.distill.loss(out, target)
            if self.inner:
                loss = loss + self.distill.intermediate_weight * intermediate_loss(inner, taught)
            if self.with_labels:
                loss = self.distill.alpha * self._ce(out, y, perm, lam) + (1 - self.distill.alpha) * loss
        if not torch.isfinite(loss):
            raise DataError(
                f"training diverged (loss {loss.item()}) after {done} steps",
                hint="lower the learning rate, or check the data for NaN",
            )
        return loss


def distill_from_options(opts: TrainOptions, teacher: nn.Module | None, features: bool) -> Distill | None:
    """The distillation the options ask for (None for cross-entropy)."""
    if opts.loss != "distill":
        return None
    if teacher is None:
        raise DataError("`loss: distill` needs a teacher model", hint="distill from the baseline")
    which = opts.intermediate if isinstance(opts.intermediate, str) else tuple(opts.intermediate)
    return Distill(
        teacher,
        opts.temperature,
        opts.alpha,
        features,
        opts.feature_loss,
        opts.logits_loss,
        which,
        opts.intermediate_weight,
    )


def intermediate_modules(teacher: nn.Module, student: nn.Module, which: str | tuple[str, ...]) -> list[str]:
    """The modules whose outputs distillation matches (``Distill.intermediate``), checked to be in
    both models."""
    if which == "none":
        return []
    if which == "attention":
        names: list[str] = []
        for n, m in teacher.named_modules():
            attention = isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention")
            if attention and not any(n.startswith(p + ".") for p in names):
                names.append(n)
        if not names:
            raise DataError(
                "`intermediate: attention` found no attention module in the teacher (nn.MultiheadAttention "
                "or a class named *Attention)",
                hint="name the modules to match: `intermediate: [blocks.0.attn, ...]`",
            )
    else:
        names = list(which)
    for model, role in ((teacher, "teacher"), (student, "model being trained")):
        have = dict(model.named_modules())
        missing = [n for n in names if n not in have]
        if missing:
            raise DataError(
                f"`intermediate` names module(s) the {role} does not have: {', '.join(missing[:5])}",
                hint="name modules both models have (print(model) lists them; exported or traced graphs "
                "keep no submodules: use `intermediate: none` there)",
            )
    return names


@contextlib.contextmanager
def _outputs_of(model: nn.Module, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """The (first tensor of the) output of each named module in the forward passes run inside."""
    seen: dict[str, torch.Tensor] = {}

    def grab(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            seen[name] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    handles = [model.get_submodule(n).register_forward_hook(grab(n)) for n in names]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def intermediate_loss(student: dict[str, torch.Tensor], teacher: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over the modules of the MSE of the student's output, normalised by the teacher's mean square."""
    losses = []
    for name, t in teacher.items():
        s = student.get(name)
        if s is None or s.shape != t.shape:
            got = "no output" if s is None else f"shape {tuple(s.shape)}"
            raise DataError(
                f"`intermediate`: module {name} gives {got} in the model being trained and shape "
                f"{tuple(t.shape)} in the teacher",
                hint="match modules whose output shape the optimization keeps (attention outputs keep the "
                "embedding width when only heads are pruned), or `intermediate: none`",
            )
        t = t.float()
        losses.append(nn.functional.mse_loss(s.float(), t) / t.pow(2).mean().clamp_min(1e-12))
    return torch.stack(losses).mean()


def held_out_loss(
    model: nn.Module,
    loader: DataLoader,
    distill: Distill | None,
    *,
    output: str | int | None,
    use_labels: bool,
    device: str,
    max_batches: int = 16,
    skip: int = 0,
) -> float:
    """The training objective (as :func:`train` computes it) on up to ``max_batches`` batches of a
    split held apart from training (after its first ``skip``), the model in eval mode; leaves the
    mode as it found it."""
    was_training = model.training
    objective = _Objective(model, distill, output, use_labels)
    total, count = 0.0, 0
    model.eval()
    try:
        # fork_rng: iterating a DataLoader draws a seed from the global generator, which would shift
        # the dropout masks of the training that goes on after this
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for x, y in itertools.islice(loader, skip, skip + max_batches):
                x, y = prepare(x, device), y.to(device)
                n = batch_size(x)
                total += objective(x, y, 0).item() * n
                count += n
    finally:
        model.train(was_training)
    return total / max(count, 1)


def train_with_options(
    model: nn.Module,
    loader: DataLoader | None,
    opts: TrainOptions,
    *,
    device: str,
    seed: int,
    progress: Progress | None,
    description: str,
    output: str | int | None = None,
    teacher: nn.Module | None = None,
    features: bool = False,
    use_labels: bool = True,
    **hooks: Any,
) -> dict[str, Any]:
    """:func:`train` with the recipe's training options (pre-training, fine-tuning); with
    ``loss: distill`` the ``teacher`` (the baseline) provides the targets."""
    distill = distill_from_options(opts, teacher, features)
    return train(
        model,
        loader,
        epochs=opts.epochs,
        steps=opts.steps,
        lr=opts.lr,
        optimizer=opts.optimizer,
        weight_decay=opts.weight_decay,
        device=device,
        seed=seed,
        progress=progress,
        description=description,
        output=output,
        distill=distill,
        use_labels=use_labels,
        mixup=opts.mixup,
        **hooks,
    )
