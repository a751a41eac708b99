"""The dense kernels of the bias path: eager attention and torch's SDPA, each taking one additive float mask, the
bias merged with padding and causality (made and cached by ``mask.py``)."""

from __future__ import annotations

import torch
from torch import nn

from .compat import is_exporting, repeat_kv


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


def sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """torch's SDPA with the merged mask: what transformers' ``sdpa_attention_forward`` does for an additive mask
    and ``is_causal=False``, without its branches for other cases (a decoding step runs this once per layer and
    token). Shapes ``(B, H, L, D)``; returns ``(B, q, H, D)``.

    Grouped KV heads: one query per row (decoding) puts each KV head's query heads side by side as its queries,
    the mask's rows with them (no copy of the cache, as transformers' ``pack_gqa``); otherwise the KV heads are
    repeated. Also unlike transformers' function on Ascend NPUs, the float mask is never turned into a boolean one
    (which would drop the bias). ``softcap`` is refused, as transformers' sdpa refuses it.
    """
    if softcap is not None:
        raise ValueError(
            "sdpa cannot soft-cap attention scores (this model sets attn_logit_softcapping): use "
            "model.set_attn_implementation('eager') or 'flex_attention'."
        )
    batch, heads, q_len, _ = query.shape
    groups = heads // key.shape[1]
    # one decoding query: each KV head's query heads as its rows (transformers' pack_gqa). Traced: one graph for
    # every query count, so the KV heads are repeated
    packed = groups > 1 and not is_exporting() and q_len == 1
    if packed:
        query = query.reshape(batch, heads // groups, groups, query.shape[-1])
        attention_mask = attention_mask.reshape(attention_mask.shape[0], heads // groups, groups, -1)
    elif groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    if packed:
        output = output.reshape(batch, heads, q_len, value.shape[-1])
    return output.transpose(1, 2).contiguous(), None
