"""A CPU stand-in for FlashAttention-4's ``flash_attn.cute.flash_attn_func`` and ``flash_attn_varlen_func``, written
from their documented contract (flash-attn-4 4.0.0b36: ``flash_attn/cute/interface.py``, ``softmax.py``'s
``apply_score_mod_inner`` and ``utils.compute_softmax_scale_log2``; its tests' ``score_mod_definitions.py``), not
from hf_alibi:

- q ``(B, Sq, H, D)``, k ``(B, Sk, Hk, D)``, v ``(B, Sk, Hk, Dv)`` with ``H % Hk == 0``; fp16 or bf16; returns
  ``(out, lse)``, ``out`` ``(B, Sq, H, Dv)`` in the input dtype.
- ``softmax_scale`` (default ``D ** -0.5``) multiplies ``q k^T`` *before* ``score_mod`` (a score_mod sees scaled
  scores); then ``score_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors)``, with ``q_idx`` and
  ``kv_idx`` counted from 0 within the sequence (in varlen, within each sequence: the global index is
  ``q_idx + seqlen_info.offset_q``); then the causal mask, aligned to the bottom right (query ``i`` sees keys
  ``j <= i + Sk - Sq``), and ``window_size = (left, right)`` (``None`` unbounded) around that diagonal.
- ``softcap`` and ``score_mod`` cannot be used together; with gradients, ``score_mod_bwd`` is required.
- varlen: q ``(total_q, H, D)``, k/v ``(total_k, Hk, D)``, ``cu_seqlens_q`` / ``cu_seqlens_k`` int32, each sequence
  attended on its own.
- A query row that sees no key outputs zeros.

Computed in float64 (the score_mod is evaluated on float64 scores: the stand-in checks the arguments and the
arithmetic, not FA4's fp32 rounding), differentiable through torch's autograd.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

CALLS: list[dict] = []  # each call's entry point and options (tests check what hf_alibi passed)


def _check(q, k, v, softcap, score_mod, score_mod_bwd):
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("FlashAttention-4 supports fp16 and bf16 only")
    if q.shape[-2] % k.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if softcap and score_mod is not None:
        raise AssertionError("softcap and score_mod cannot be used together")
    if score_mod is not None and score_mod_bwd is None and any(t.requires_grad for t in (q, k, v)):
        raise AssertionError("score_mod_bwd is required when score_mod is provided")


def _one(q, k, v, b, scale, causal, window_size, score_mod, aux_tensors, offset_q, offset_k):
    """One sequence: q ``(Sq, H, D)``, k/v ``(Sk, Hk, D)`` -> ``(Sq, H, Dv)`` float64 and lse ``(H, Sq)``."""
    sq, heads, _ = q.shape
    sk = k.shape[0]
    group = heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_idx = torch.arange(sq)[:, None]
    kv_idx = torch.arange(sk)[None, :]
    if score_mod is not None:
        info = SimpleNamespace(offset_q=offset_q, offset_k=offset_k, seqlen_q=sq, seqlen_k=sk)
        aux = None if aux_tensors is None else [t.double() for t in aux_tensors]
        scores = torch.stack(
            [score_mod(scores[h], torch.tensor(b), torch.tensor(h), q_idx, kv_idx, info, aux) for h in range(heads)]
        )
    diagonal = q_idx + sk - sq
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= kv_idx <= diagonal
    left, right = window_size
    if left is not None and left >= 0:
        allowed &= kv_idx >= diagonal - left
    if right is not None and right >= 0:
        allowed &= kv_idx <= diagonal + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", weights, v), lse


def flash_attn_func(
    q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, window_size=(None, None),
    learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
    score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None, **rest,
):  # fmt: skip
    CALLS.append(dict(entry="flash_attn_func", causal=causal, window_size=window_size, aux_tensors=aux_tensors))
    _check(q, k, v, softcap, score_mod, score_mod_bwd)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs, lses = [], []
    for b in range(q.shape[0]):
        out, lse = _one(q[b], k[b], v[b], b, scale, causal, tuple(window_size), score_mod, aux_tensors, 0, 0)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


def flash_attn_varlen_func(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
    seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
    score_mod=None, score_mod_bwd=None, mask_mod=None, block_sparse_tensors=None, aux_tensors=None, aux_scalars=None,
    **rest,
):  # fmt: skip
    CALLS.append(dict(entry="flash_attn_varlen_func", causal=causal, window_size=window_size, aux_tensors=aux_tensors))
    _check(q, k, v, softcap, score_mod, score_mod_bwd)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have dtype int32")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    pieces = []
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        out, _ = _one(
            q[q0:q1], k[k0:k1], v[k0:k1], b, scale, causal, tuple(window_size), score_mod, aux_tensors, q0, k0
        )
        pieces.append(out)
    rest_rows = q.shape[0] - int(cu_seqlens_q[-1])  # rows past the last sequence: zeros
    pieces.append(torch.zeros(rest_rows, q.shape[1], v.shape[-1], dtype=torch.float64))
    return torch.cat(pieces).to(q.dtype), None
