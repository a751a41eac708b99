"""A CPU stand-in for flash-attn 2's ``flash_attn_func`` and ``flash_attn_varlen_func``, written from their
documented contract (flash_attn/flash_attn_interface.py docstrings, flash-attn >= 2.6), not from hf_alibi:

- q ``(B, Sq, H, D)``, k and v ``(B, Sk, Hk, D)`` with ``H % Hk == 0`` (MQA / GQA); fp16 or bf16 only; the
  output ``(B, Sq, H, D)`` in the input dtype.
- ``softmax_scale`` (default ``D ** -0.5``) scales ``q k^T``; ``softcap > 0`` caps it: ``softcap * tanh(s / softcap)``.
- ``alibi_slopes`` fp32 ``(H,)`` or ``(B, H)``: "a bias of ``-alibi_slope * |i + seqlen_k - seqlen_q - j|`` is added
  to the attention score of query i and key j" (after the cap: the kernel divides the slope by the softmax scale).
- ``causal``: "the causal mask is aligned to the bottom right corner of the attention matrix": query ``i`` sees
  keys ``j <= i + Sk - Sq``.
- ``window_size = (left, right)``, ``-1`` unbounded: query ``i`` sees keys in
  ``[i + Sk - Sq - left, i + Sk - Sq + right]`` inclusive.
- A query row that sees no key outputs zeros.
- varlen: q ``(total_q, H, D)``, k and v ``(total_k, Hk, D)``; sequence ``b`` is rows ``cu_seqlens_q[b]`` to
  ``cu_seqlens_q[b + 1]`` (int32), each attended as its own batch entry; ``alibi_slopes`` ``(H,)`` or ``(B, H)``.

Dropout is not modelled (the tests run without it). Computed in float64.
"""

from __future__ import annotations

import torch

CALLS: list[str] = []  # which entry points ran, in order (tests check the path taken)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("FlashAttention only supports fp16 and bf16 data type")
    if q.shape[-2] % k.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if dropout_p:
        raise NotImplementedError("the stand-in models no dropout")


def _one(q, k, v, scale, causal, window_size, softcap, slopes):
    """One sequence: q ``(Sq, H, D)``, k/v ``(Sk, Hk, D)``, slopes ``(H,)`` or None -> ``(Sq, H, D)`` float64."""
    sq, heads, dim = q.shape
    sk = k.shape[0]
    group = heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    shifted = i + sk - sq  # the query's place among the keys (bottom-right alignment)
    if slopes is not None:
        scores = scores - slopes.double()[:, None, None] * (shifted - j).abs()
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= j <= shifted
    left, right = window_size
    if left >= 0:
        allowed &= j >= shifted - left
    if right >= 0:
        allowed &= j <= shifted + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
    return torch.einsum("hqk,khd->qhd", weights, v)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):  # fmt: skip
    CALLS.append("flash_attn_func")
    _check(q, k, v, dropout_p)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = []
    for b in range(q.shape[0]):
        slopes = None if alibi_slopes is None else (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
        out.append(_one(q[b], k[b], v[b], scale, causal, tuple(window_size), softcap, slopes))
    return torch.stack(out).to(q.dtype)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    CALLS.append("flash_attn_varlen_func")
    _check(q, k, v, dropout_p)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have dtype int32")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        slopes = None if alibi_slopes is None else (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
        out[q0:q1] = _one(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal, tuple(window_size), softcap, slopes)
    return out.to(q.dtype)
