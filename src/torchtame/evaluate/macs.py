"""MACs and parameter counts of a float model for one example batch."""

from __future__ import annotations

import torch
from torch import nn


def count_macs_params(model: nn.Module, example: torch.Tensor) -> tuple[int, int]:
    """MACs and parameters of a float model for one example batch (torch-pruning's counter)."""
    import torch_pruning as tp

    with torch.no_grad():
        macs, params = tp.utils.count_ops_and_params(model, example)
    return int(macs), int(params)
