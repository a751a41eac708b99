"""The folded path: the causal bias as one more q/k channel, SDPA's causal kernel, no L x L tensor."""

from __future__ import annotations

import torch
from torch import nn

from .compat import repeat_kv
from .slopes import CAUSAL


def folded_unavailable(alibi, query: torch.Tensor, attention_mask, kwargs: dict) -> str | None:
    """Why the folded path cannot run this call exactly, or ``None`` when it can."""
    if alibi.kind != CAUSAL:
        return f"the {alibi.kind!r} bias is not causal (the fold needs softmax to ignore a per-query constant)"
    if query.dtype not in (torch.float32, torch.float64):
        return f"{query.dtype} cannot hold the folded channel (it grows with position): only float32/float64"
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        return f"the attention mask is a {type(attention_mask).__name__}, not a tensor"
    if kwargs.get("position_bias") is not None:
        return "the layer passes its own position_bias"
    if kwargs.get("softcap") is not None:
        return "the layer soft-caps its scores (sdpa cannot)"
    if kwargs.get("cache") is not None:
        return "a paged cache is in use"
    return None


def folded_causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    slopes: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> tuple[torch.Tensor, None]:
    """Causal ALiBi through SDPA's causal kernel, with the bias folded into q and k.

    The causal bias ``-m_h (i - j)`` equals ``m_h j`` up to a per-query constant, which softmax
    ignores. So q gets a channel of 1 and k a channel ``m_h (j - c) / scaling`` (``c`` centres the
    positions to halve the channel's size, hence its fp32 rounding): ``q' k'^T * scaling`` is
    ``q k^T * scaling + m_h j - m_h c``. v gets a zero channel (SDPA wants equal head sizes) and the
    output drops it. Shapes ``(B, H, L, D)``; returns ``(B, q, H, D)`` like transformers' backends.

    transformers' mask is used as it is: ``None`` (pure causal: SDPA's ``is_causal``, with the keys
    cut to the queries exactly as transformers' sdpa does, whose ``None`` means top-left alignment)
    or a boolean / additive mask that already holds causality and padding for any cache offset.
    """
    batch, heads, q_len, head_dim = query.shape
    if key.shape[1] != heads:  # grouped KV heads: the channel differs per query head
        key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
    if scaling is None:
        scaling = head_dim**-0.5
    is_causal = attention_mask is None and q_len > 1
    if is_causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    kv_len = key.shape[2]
    exact = torch.promote_types(query.dtype, torch.float32)  # fp32 slopes, fp64 stays fp64
    positions = torch.arange(kv_len, device=query.device, dtype=exact) - (kv_len - 1) / 2
    channel = (slopes.to(exact)[:, None] * positions / scaling).to(query.dtype)  # (H, kv)
    one = query.new_ones(()).expand(batch, heads, q_len, 1)
    query = torch.cat([query, one], dim=-1)  # (B, H, q, D + 1)
    key = torch.cat([key, channel[None, :, :, None].expand(batch, heads, kv_len, 1)], dim=-1)
    value = nn.functional.pad(value, (0, 1))
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
    )  # (B, H, q, D + 1)
    return output[..., :head_dim].transpose(1, 2).contiguous(), None
