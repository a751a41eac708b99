"""FlexAttention: the bias as a ``score_mod`` computed from the slopes, no bias tensor."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .compat import compiled_flex_attention, repeat_kv
from .denormals import flushed
from .forward import AlibiForward
from .kernels import window_refusal
from .packing import same_document
from .slopes import CAUSAL, LEARNED, NONSYMMETRIC, is_sink, offsets, row_positions


def alibi_score_mod(
    alibi, q_len: int, kv_len: int, device: torch.device, softcap: float | None = None, rows: tuple = (None, None)
) -> Callable:
    """FlexAttention ``score_mod`` adding the layer's bias; queries are the last ``q_len`` positions.

    Disallowed pairs (causal future keys, the nonsymmetric form's other side) get ``-inf``; the
    mask transformers made (a ``BlockMask``) handles padding. ``softcap`` caps the score before the
    bias is added, as the eager path does (see ``dense.eager_attention_forward``). With sinks, the
    first ``alibi.sinks`` real keys of each row get no bias (row starts and the sequence's end as ``rows``: the
    forward's, ``AlibiForward.rows``; positions as ``slopes.relative_distance``).
    """
    kind, sinks, rounding = alibi.kind, alibi.sinks, alibi.rounding
    starts, end = rows
    query_offset, key_offset = offsets(q_len, kv_len, end)
    starts = torch.zeros(1, dtype=torch.long, device=device) if starts is None else starts.to(device)
    first_row = starts.shape[0] == 1  # one start for every row

    def capped(score):
        return score if softcap is None else torch.tanh(score / softcap) * softcap

    per_key = starts.dim() == 2  # a packed row: each key's document start

    def exempt(bias, b, key):  # sinks: bias 0 on the first `sinks` real keys of row b (of each document)
        if not sinks:
            return bias
        row = starts[0] if first_row else starts[b]
        start = row[key] if per_key else row
        return torch.where(is_sink(key, start, sinks), 0.0, bias)

    if kind == LEARNED:
        left, right = alibi.learned_slopes()
        left, right = left.to(device), right.to(device)

        def learned_mod(score, b, h, q_idx, kv_idx):
            key = kv_idx + key_offset
            distance = (q_idx + query_offset - key).to(torch.float32)
            bias = torch.where(distance >= 0, left[h] * distance, -right[h] * distance)
            return capped(score) + exempt(bias, b, key)

        return learned_mod
    slopes = alibi.fixed_slopes(device)
    half = alibi.num_heads // 2
    if rounding is not None:  # causal (KeyRounding): t(p_j) - t(p_i), positions from the row's (document's) start
        query_pos, key_pos = row_positions(q_len, kv_len, starts, end, device=device)  # (B|1, q), (B|1, kv)
        keys, queries = rounding.terms(slopes, key_pos), rounding.terms(slopes, query_pos)  # (H, B|1, kv), (H, B|1, q)
        one_row = keys.shape[1] == 1

        def rounded_mod(score, b, h, q_idx, kv_idx):
            row = 0 if one_row else b
            distance = q_idx + query_offset - (kv_idx + key_offset)
            biased = capped(score) + keys[h, row, kv_idx] - queries[h, row, q_idx]
            return torch.where(distance >= 0, biased, -float("inf"))

        return rounded_mod

    def fixed_mod(score, b, h, q_idx, kv_idx):
        key = kv_idx + key_offset
        distance = (q_idx + query_offset - key).to(torch.float32)
        biased = capped(score) + exempt(-slopes[h] * distance.abs(), b, key)
        if kind == CAUSAL:
            biased = torch.where(distance >= 0, biased, -float("inf"))
        elif kind == NONSYMMETRIC:
            allowed = torch.where(h < half, distance >= 0, distance <= 0)
            biased = torch.where(allowed, biased, -float("inf"))
        return biased

    return fixed_mod


def flex_alibi_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    forward: AlibiForward | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """ALiBi with FlexAttention: transformers' ``BlockMask`` for padding, the bias as a ``score_mod``. ``forward``
    is the forward this call belongs to (its rows and documents; ``None``: none recorded).

    On CPU, FlexAttention (torch 2.13) runs forward only: training there raises. Shapes as SDPA.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    alibi = module.alibi
    if dropout > 0:
        raise ValueError("flex_attention has no attention dropout: set the model's attention dropout to 0.")
    alibi.check_heads(query)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *alibi.parameters()))
    if query.device.type == "cpu" and needs_grad:
        raise NotImplementedError(
            "FlexAttention has no backward pass on CPU (torch 2.13): train with "
            "model.set_attn_implementation('sdpa') there, or run this under torch.no_grad()."
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    reason = window_refusal(alibi, kv_len, "flex_attention")
    if reason is not None:
        raise NotImplementedError(reason)
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    forward = AlibiForward() if forward is None else forward
    score_mod = alibi_score_mod(alibi, q_len, kv_len, query.device, softcap=softcap, rows=forward.rows(alibi))
    if isinstance(attention_mask, torch.Tensor):  # a 4D mask (bool or additive) instead of a BlockMask
        extra = attention_mask[:, :, :, :kv_len]
        extra = torch.where(extra, 0.0, -float("inf")) if extra.dtype == torch.bool else extra.float()
        inner = score_mod

        def score_mod(score, b, h, q_idx, kv_idx):
            return inner(score, b, h, q_idx, kv_idx) + extra[b, 0, q_idx, kv_idx]

    documents = forward.documents
    if documents is not None:  # a packed row: each query sees the keys of its own document only
        same_document(documents, q_len, kv_len)  # checks the lengths
        documents, inner_mod = documents.to(query.device), score_mod
        row = (lambda b: documents[0]) if documents.shape[0] == 1 else (lambda b: documents[b])

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(row(b)[q_idx] == row(b)[kv_idx], inner_mod(score, b, h, q_idx, kv_idx), -float("inf"))

    if key.shape[1] != query.shape[1]:
        key, value = repeat_kv(key, query.shape[1] // key.shape[1]), repeat_kv(value, query.shape[1] // key.shape[1])
    # on CPU the eager implementation: torch.compile there needs a C++ toolchain
    run = flex_attention if query.device.type == "cpu" else compiled_flex_attention(module.training)
    alibi.last_path = "flex"
    with flushed(query):  # the CPU kernel's far-key weights are subnormal (denormals.py); forward only there
        output = run(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling)
    return output.transpose(1, 2).contiguous(), None
