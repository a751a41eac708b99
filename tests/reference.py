"""Independent references for the tests: explicit loops and hand-written attention.

Nothing here imports hf_alibi's math: the slopes follow fairseq's recursive ``get_slopes``, the bias
is built element by element, and attention is softmax(QK^T * scale + bias) V written out.
"""

from __future__ import annotations

import math

import torch

NEG = float("-inf")


def fairseq_slopes(n: int) -> list[float]:
    """fairseq's get_slopes (ofirpress/attention_with_linear_biases), verbatim in structure."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + fairseq_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def explicit_bias(kind: str, slopes: list[float], q_len: int, kv_len: int, right: list[float] | None = None):
    """(H, q, kv) float64 bias written with loops; masked entries are -inf."""
    n = len(slopes)
    out = torch.zeros(n, q_len, kv_len, dtype=torch.float64)
    offset = kv_len - q_len
    for h in range(n):
        for r in range(q_len):
            i = r + offset
            for j in range(kv_len):
                d = i - j
                if kind == "learned":
                    out[h, r, j] = slopes[h] * d if d >= 0 else right[h] * (-d)
                    continue
                value = -slopes[h] * abs(d)
                if kind == "causal" and j > i:
                    value = NEG
                if kind == "nonsymmetric" and ((h < n // 2 and j > i) or (h >= n // 2 and j < i)):
                    value = NEG
                out[h, r, j] = value
    return out


def reference_attention(q, k, v, bias, scaling, key_padding=None):
    """softmax(q k^T * scaling + bias) v in float64; q (B, H, q, D), bias (H, q, kv) or (B, H, q, kv).

    ``key_padding`` (B, kv) bool, True = real token: padded keys get -inf.
    """
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scaling + bias
    if key_padding is not None:
        scores = scores.masked_fill(~key_padding[:, None, None, :], NEG)
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v.double())


def gpt2_reference_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a converted GPT-2 computed by hand: no wpe, attention with -m|i-j| (float64 attention).

    Uses the model's LayerNorms, projections and MLPs as plain functions; the attention and the
    absence of position embeddings are what is checked.
    """
    base = model.base_model
    n_head = model.config.n_head
    slopes = fairseq_slopes(n_head)
    hidden = base.wte(input_ids)
    batch, length, width = hidden.shape
    head_dim = width // n_head
    bias = explicit_bias("causal", slopes, length, length)
    for layer_idx, block in enumerate(base.h):
        attn = block.attn
        x = block.ln_1(hidden)
        q, k, v = attn.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, n_head, head_dim).transpose(1, 2) for t in (q, k, v))
        scaling = head_dim**-0.5 if model.config.scale_attn_weights else 1.0
        if model.config.scale_attn_by_inverse_layer_idx:
            scaling /= float(layer_idx + 1)
        out = reference_attention(q, k, v, bias, scaling).to(hidden.dtype)
        out = out.transpose(1, 2).reshape(batch, length, width)
        hidden = hidden + attn.c_proj(out)
        hidden = hidden + block.mlp(block.ln_2(hidden))
    hidden = base.ln_f(hidden)
    return model.lm_head(hidden)
