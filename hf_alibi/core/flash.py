"""flash-attn: its own ALiBi (fp32 ``alibi_slopes``), causal and symmetric; and the flash layout (padding and packed
rows as variable-length sequences) that the flash kernels of the table share."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .compat import flash_padding_helpers
from .forward import AlibiForward
from .kernels import kernel_refusal
from .packing import cumulative_lengths, same_document
from .slopes import CAUSAL


def flash_kernels(device: torch.device) -> tuple:
    """flash-attn's ``(flash_attn_func, flash_attn_varlen_func)`` for tensors on ``device``; a one-line error
    where flash-attn is missing or ``device`` is not CUDA (it has no other kernels). The one place that
    finds the kernels: the tests put a CPU stand-in written from flash-attn's documented contract here."""
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise ImportError(
            "attn_implementation='flash_attention_2' with ALiBi needs flash-attn >= 2.4 (pip install flash-attn) "
            "and a CUDA GPU; otherwise use model.set_attn_implementation('sdpa')."
        ) from error
    if device.type != "cuda":
        raise RuntimeError("flash-attn runs on CUDA only: use model.set_attn_implementation('sdpa') on this device.")
    return flash_attn_func, flash_attn_varlen_func


def in_flash_layout(
    dense: Callable,
    varlen: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask,
    documents,
    kwargs: dict,
) -> torch.Tensor:
    """A flash kernel run on transformers' flash arguments, ``(B, q, H, D)``: ``dense(q, k, v)`` on whole rows, or
    ``varlen(q, k, v, cu_q, cu_k, max_q, max_k)`` (flash-attn's positional order) with one sequence per row's real
    tokens (``attention_mask``: transformers' 2D padding mask) or per document of a packed row (``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` where the caller gives them, else ``documents``, :func:`packing.document_starts`). q, k, v are
    ``(B, L, H, D)``. Shared by the flash kernels of the table (flash-attn 2, FlashAttention-4)."""
    upad_input, unpad_input, pad_input = flash_padding_helpers()
    batch, q_len = q.shape[:2]
    cu_given = kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None
    if attention_mask is None and (documents is not None or cu_given):  # a packed row: one sequence a document
        if cu_given:  # DataCollatorWithFlattening(return_flash_attn_kwargs=True) and TRL give them
            cu_q, cu_k = (kwargs[f"cu_seq_lens_{side}"].to(device=q.device, dtype=torch.int32) for side in "qk")
            max_q, max_k = (int(cu.diff().max()) for cu in (cu_q, cu_k))
        else:
            same_document(documents, q_len, k.shape[1])  # checks the lengths
            cu_q, max_q = cumulative_lengths(documents.to(q.device), batch)
            cu_k, max_k = cu_q, max_q
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]  # (B * L, H, D)
        return varlen(*flat, cu_q, cu_k, max_q, max_k).reshape(batch, q_len, *q.shape[2:])
    if attention_mask is None:
        return dense(q, k, v)
    q, k, v, indices, (cu_q, cu_k), (max_q, max_k) = upad_input(q, k, v, attention_mask, q_len, unpad_input)
    return pad_input(varlen(q, k, v, cu_q, cu_k, max_q, max_k), indices, batch, q_len)


def flash_alibi_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    forward: AlibiForward | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """ALiBi with flash-attn >= 2.4's ``alibi_slopes`` (bias ``-m |i + Lk - Lq - j|``, fp16/bf16, CUDA).

    ``attention_mask`` is transformers' 2D padding mask for flash attention (or ``None``); padded
    batches go through ``flash_attn_varlen_func``, and so do packed rows (one sequence per document:
    ``cu_seq_lens_q``/``cu_seq_lens_k`` where the caller gives them, else from the documents of ``forward``, the
    forward this call belongs to).
    Only the causal and symmetric forms exist there.
    ``sliding_window`` becomes flash-attn's ``window_size`` and ``softcap`` its ``softcap`` (applied
    before the bias, as on the other paths).
    """
    alibi = module.alibi
    alibi.check_heads(query)
    reason = kernel_refusal("flash_attention_2", alibi, key.shape[2])
    if reason is not None:
        raise NotImplementedError(reason)
    flash_attn_func, flash_attn_varlen_func = flash_kernels(query.device)
    if not module.training:
        dropout = 0.0
    causal = alibi.kind == CAUSAL
    slopes = alibi.fixed_slopes(query.device)  # fp32, as flash-attn requires
    half = query.dtype if query.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    q, k, v = (t.transpose(1, 2).to(half) for t in (query, key, value))  # (B, L, H, D)
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, alibi_slopes=slopes)
    if sliding_window is not None:
        options["window_size"] = (sliding_window - 1, sliding_window - 1)  # as transformers' flash path
    if softcap is not None:
        options["softcap"] = softcap
    documents = None if forward is None else forward.documents
    dense = partial(flash_attn_func, **options)
    varlen = partial(flash_attn_varlen_func, **options)
    output = in_flash_layout(dense, varlen, q, k, v, attention_mask, documents, kwargs)
    alibi.last_path = "flash"
    return output.to(query.dtype), None
