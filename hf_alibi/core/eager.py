"""The eager backend: plain attention with one additive float mask (the bias path's mask)."""

from __future__ import annotations

import torch
from torch import nn

from .compat import repeat_kv


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(cap(q k^T * scaling) + mask) v, softmax in float32. Shapes ``(B, H, L, D)``.

    ``softcap`` (Gemma 2's ``attn_logit_softcapping``) caps the scores, ``tanh(s / cap) * cap``,
    BEFORE the mask, and so before the ALiBi bias that the mask carries. That order is the model's
    own (its eager code adds the mask after the cap), and it is the one that keeps ALiBi working:
    a capped bias would saturate at ``-cap``, so keys beyond ``cap / m_h`` tokens would all look
    equally far and the penalty would stop growing with distance, which is what lets ALiBi
    extrapolate. Every path agrees: flex applies the cap inside its ``score_mod`` before the bias,
    and sdpa (no cap at all) refuses, as transformers' own sdpa does.
    """
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, H, q, kv)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, q, H, D)
    return output, weights
