"""MACs and parameter counts, counted at the aten level (``torch.utils.flop_counter``).

Counting the aten ops a forward pass runs is right for Conv2d/Linear subclasses that pad or
reshape in their own ``forward``, for functional calls (``F.conv2d``, ``x @ w``) and for
attention (``bmm``/``sdpa``), where module-hook counters miss or misjudge them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..inputs import call


def count_macs(model: nn.Module, example: Any) -> int:
    """Multiply-accumulates of one forward pass on ``example`` (FLOPs / 2 as torch counts them)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        call(model, example)
    return int(counter.get_total_flops() // 2)


def count_params(model: nn.Module) -> int:
    """Parameters (shared ones once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def count_macs_params(model: nn.Module, example: Any) -> tuple[int, int]:
    """MACs of one forward pass on ``example`` and the parameter count."""
    return count_macs(model, example), count_params(model)
