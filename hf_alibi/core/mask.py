"""The bias path: the ALiBi bias merged with transformers' mask into one float mask, shared by the layers of a
forward (kept in its :class:`forward.AlibiForward`), and the decoding rows kept per slopes and device."""

from __future__ import annotations

import torch

from .compat import is_exporting
from .packing import same_document
from .slopes import CAUSAL, LEARNED, alibi_bias


def attends(mask: torch.Tensor) -> torch.Tensor:
    """transformers' 4D mask as a boolean one, True where a query attends: a boolean mask as it is, an additive one
    where it is above half its dtype's lowest value (masked entries are ``finfo(dtype).min``, kept ones 0)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def merge_bias_and_mask(bias: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One additive float mask in ``dtype`` from the fp32 bias and transformers' mask.

    ``attention_mask`` is what transformers' mask interface made: ``None``, a boolean mask
    (True = attend) or an additive float mask whose masked entries are ``finfo(dtype).min``.
    Masked entries come out as exactly ``finfo(dtype).min``: the sum is clamped, so a positive
    bias can never bring a masked key back, and a fully masked row stays finite.
    """
    masked_value = torch.finfo(dtype).min
    if attention_mask is None:
        merged = bias
    elif attention_mask.dtype == torch.bool:
        merged = torch.where(attention_mask, bias, masked_value)
    else:
        merged = (bias + attention_mask.float()).clamp_min(masked_value)
    return merged if merged.dtype == dtype else merged.to(dtype)  # the no-op .to is a call a decoding step skips


def separate_documents(
    mask: torch.Tensor | None, starts: torch.Tensor, q_len: int, kv_len: int, causal: bool, dtype: torch.dtype
) -> torch.Tensor:
    """``mask`` (``None``, boolean or additive in ``dtype``) with every query kept to the keys of its own
    document (``starts``: :func:`packing.document_starts`), and causal where ``causal`` (a ``None`` mask
    meant causality). Boolean unless ``mask`` is additive; masked entries of an additive one are ``finfo.min``.
    """
    allowed = same_document(starts, q_len, kv_len)  # (B|1, 1, q, kv)
    if causal:
        allowed = allowed & torch.ones(q_len, kv_len, dtype=torch.bool, device=starts.device).tril()
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return allowed & mask
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def shared_mask(forward, alibi, query: torch.Tensor, kv_len: int, attention_mask) -> torch.Tensor | None:
    """The merged mask an earlier layer of this forward made for a call like this one (the same bias, path setting,
    shapes and transformers' mask), else ``None``. Only the bias path keeps one, so a hit means that layer chose it,
    and this one would too (decoding steps: the layers after the first run without choosing again). Never while
    traced (nothing is kept then)."""
    if alibi.sharing is None or not forward.masks or is_exporting():
        return None
    hit = forward.masks.get((_key(alibi, query, kv_len), id(attention_mask)))
    return None if hit is None else hit[1]


DECODING_ROW = 1024  # the first decoding row's keys (then doubled as needed)


def decoding_row(alibi, kv_len: int, device: torch.device) -> torch.Tensor:
    """A decoding step's causal bias (``alibi``'s fixed slopes), fp32 ``(1, H, 1, kv_len)``: the last ``kv_len`` keys
    of one row kept per slopes and device (``alibi.shared.decoding_rows``, shared by the model's layers and threads,
    replaced whole), a view: no bias built per step. The row is :func:`slopes.alibi_bias` for one query over its keys;
    its last ``kv_len`` are the same values."""
    rows = alibi.shared.decoding_rows
    row = rows.get((alibi.slope_values, device))
    if row is None or row.shape[-1] < kv_len:
        size = max(kv_len, 2 * row.shape[-1] if row is not None else DECODING_ROW)
        with torch.inference_mode(False):  # an inference tensor could not be saved for a later grad-mode backward
            row = alibi_bias(CAUSAL, 1, size, alibi.fixed_slopes(device))
        rows[(alibi.slope_values, device)] = row
    return row[..., row.shape[-1] - kv_len :]


def _key(alibi, query: torch.Tensor, kv_len: int) -> tuple:
    # What a merged mask depends on besides transformers' mask: layers share one where they share the form, slopes
    # and path setting (``alibi.sharing``; a layer forced elsewhere chooses on its own) and the query's shape, device
    # and dtype. Inference-mode tensors cannot be saved for backward: never hand one to a grad-mode call.
    return (alibi.sharing, query.shape, kv_len, query.device, query.dtype, torch.is_inference_mode_enabled())


def _merged(forward, alibi, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    dtype, q_len = query.dtype, query.shape[2]
    starts, end = forward.rows(alibi)
    bias = alibi(q_len, kv_len, query.device, torch.finfo(dtype).min, starts=starts, end=end)  # (1|B, H, q, kv) fp32
    merged = merge_bias_and_mask(bias, attention_mask, dtype)
    if forward.documents is not None:  # a packed row: each query sees its own document (the bias holds causality)
        merged = separate_documents(merged, forward.documents, q_len, kv_len, False, dtype)
    return merged


def bias_mask(forward, alibi, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Bias + transformers' mask (+ a packed row's documents) as one additive float mask in the query's dtype,
    ``(1 or B, H, q, kv)``.

    Kept in ``forward`` (a :class:`forward.AlibiForward`) for the layers after this one; built here per layer for
    the learned form (its own slopes) and while torch.compile / torch.export traces (the compiler's
    common-subexpression pass merges the identical per-layer builds again).
    """
    if alibi.kind == LEARNED or is_exporting():
        return _merged(forward, alibi, query, kv_len, attention_mask)
    key = _key(alibi, query, kv_len)
    return forward.cached(key, attention_mask, _merged, forward, alibi, query, kv_len, attention_mask)


def packed_causal_mask(forward, query: torch.Tensor, kv_len: int, attention_mask) -> torch.Tensor | None:
    """The fold's mask: transformers' mask, or in a packed row (``forward.documents``) that mask kept causal inside
    each document (boolean, or additive where transformers' is); kept in ``forward`` for its other layers."""
    starts = forward.documents
    if starts is None:
        return attention_mask
    q_len, dtype = query.shape[2], query.dtype
    if is_exporting():
        return separate_documents(attention_mask, starts, q_len, kv_len, True, dtype)
    key = ("documents", q_len, kv_len, query.device, dtype, torch.is_inference_mode_enabled())
    return forward.cached(key, attention_mask, separate_documents, attention_mask, starts, q_len, kv_len, True, dtype)
