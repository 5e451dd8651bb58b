"""``nn.MultiheadAttention`` as separate query/key/value Linears, so its heads can be pruned.

``nn.MultiheadAttention`` keeps one packed ``in_proj_weight`` whose width is tied to its
``embed_dim`` (the model width): removing a head would mean narrowing the residual stream.
:class:`SplitMultiheadAttention` computes exactly the same function with ``q_proj``, ``k_proj``,
``v_proj`` (embed_dim -> heads x head_dim) and ``out_proj`` (heads x head_dim -> embed_dim), the
layout torch-pruning prunes by head. It takes the same call (query, key, value, key_padding_mask,
need_weights, attn_mask, average_attn_weights, is_causal) and returns ``(output, weights)``, so
torchvision's ViT and ``nn.TransformerEncoderLayer`` (which falls back to its plain path, as it
does for any attention without the packed bias) call it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SplitMultiheadAttention(nn.Module):
    """The function of an ``nn.MultiheadAttention`` with separate projections (see the module)."""

    in_proj_bias = None  # nn.TransformerEncoderLayer reads it to decide on its fused fast path
    _qkv_same_embed_dim = False

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, batch_first: bool, bias: bool) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.batch_first = batch_first
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.v_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias)
        self.dropout = 0.0

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> SplitMultiheadAttention:
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("only self-attention layouts without bias_k/add_zero_attn are split")
        e = mha.embed_dim
        split = cls(e, mha.num_heads, e // mha.num_heads, mha.batch_first, mha.in_proj_bias is not None)
        with torch.no_grad():
            for i, proj in enumerate((split.q_proj, split.k_proj, split.v_proj)):
                proj.weight.copy_(mha.in_proj_weight[i * e : (i + 1) * e])
                if proj.bias is not None:
                    proj.bias.copy_(mha.in_proj_bias[i * e : (i + 1) * e])
            split.out_proj.weight.copy_(mha.out_proj.weight)
            if split.out_proj.bias is not None:
                split.out_proj.bias.copy_(mha.out_proj.bias)
        split.dropout = mha.dropout
        return split.train(mha.training)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.reshape(b, n, self.num_heads, -1).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, n, _ = query.shape
        q, k, v = (
            self._heads(self.q_proj(query)),
            self._heads(self.k_proj(key)),
            self._heads(self.v_proj(value)),
        )
        mask = _additive_mask(attn_mask, key_padding_mask, q.dtype, b, k.shape[2])
        causal = is_causal and mask is None
        drop = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q @ k.transpose(-2, -1)) / self.head_dim**0.5
            if mask is not None:
                scores = scores + mask
            elif causal:
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            weights = F.dropout(scores.softmax(-1), drop, self.training)
            out = weights @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop, is_causal=causal)
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, -1))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        return out, weights


def _additive_mask(
    attn_mask: torch.Tensor | None, padding: torch.Tensor | None, dtype: torch.dtype, b: int, s: int
) -> torch.Tensor | None:
    """One additive mask broadcastable to (batch, heads, L, S) from MHA's two kinds."""
    out = None
    if attn_mask is not None:
        if attn_mask.dim() != 2:
            raise ValueError("a per-head (3-D) attn_mask ties the mask to the head count; pass a 2-D mask")
        out = (
            attn_mask.to(dtype).masked_fill(attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else attn_mask
        )
        out = out.to(dtype)
    if padding is not None:
        pad = torch.zeros(b, 1, 1, s, dtype=dtype)
        pad = (
            pad.masked_fill(padding.bool().reshape(b, 1, 1, s), float("-inf"))
            if padding.dtype == torch.bool
            else (pad + padding.to(dtype).reshape(b, 1, 1, s))
        )
        out = pad if out is None else out + pad
    return out


def split_multihead(model: nn.Module, ignored: list[str]) -> list[str]:
    """Replace every ``nn.MultiheadAttention`` (outside ``ignored``) by its split equivalent, in
    place; returns the names replaced."""
    done = []
    for name, m in list(model.named_modules()):
        if not isinstance(m, nn.MultiheadAttention) or any(
            name == i or name.startswith(i + ".") for i in ignored
        ):
            continue
        try:
            split = SplitMultiheadAttention.from_mha(m)
        except ValueError:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, split)
        done.append(name)
    return done
