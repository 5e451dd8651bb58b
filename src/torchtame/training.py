"""A short, plain training loop used to train quickstart models and to fine-tune pruned ones."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .errors import DataError
from .inputs import call, prepare, select_output
from .options import TrainOptions
from .progress import NullProgress, Progress


def make_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


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
) -> dict[str, Any]:
    """Train ``model`` in place with cross-entropy on its measured ``output``; returns the mean
    loss of each epoch.

    Runs ``epochs`` passes over ``loader`` or exactly ``steps`` optimizer steps (cycling the loader).
    The model is left in eval mode on the CPU.
    """
    if loader is None:
        raise DataError(
            "training needs labelled data, but the data source has no train split",
            hint="use a data source with labels (digits, imagefolder) and a `split.train` > 0",
        )
    torch.manual_seed(seed)
    # A loader of our own, so the shuffle order depends on ``seed`` alone, not on earlier use.
    loader = DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    progress = progress or NullProgress()
    model.to(device).train()
    opt = make_optimizer(model, optimizer, lr, weight_decay)
    total = steps if steps is not None else (epochs or 1) * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
    loss_fn = nn.CrossEntropyLoss()
    epoch_losses: list[float] = []
    done = 0
    with progress.task(description, total=total) as task:
        while done < total:
            running, count = 0.0, 0
            for x, y in loader:
                if done >= total:
                    break
                x, y = prepare(x, device), y.to(device)
                if (y < 0).any():
                    raise DataError("training needs labels, but the data has label -1 (unlabelled)")
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(select_output(call(model, x), output), y)
                if not torch.isfinite(loss):
                    raise DataError(
                        f"training diverged (loss {loss.item()}) after {done} steps",
                        hint="lower the learning rate, or check the data for NaN",
                    )
                loss.backward()
                opt.step()
                sched.step()
                running += loss.item() * len(y)
                count += len(y)
                done += 1
                task.advance(1, loss=f"{loss.item():.3f}")
            epoch_losses.append(running / max(count, 1))
    model.eval().to("cpu")
    return {"steps": done, "epoch_losses": [round(v, 5) for v in epoch_losses]}


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
) -> dict[str, Any]:
    """:func:`train` with the recipe's training options (pre-training, fine-tuning)."""
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
    )
