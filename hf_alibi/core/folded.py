"""The folded path: the causal bias without an L x L tensor, in SDPA's causal kernel, any float dtype.

Two constructions of the same thing (see :func:`folded_causal_attention`):

* "row": on CPU, the causal kernel itself adds a (1, H, 1, kv) fp32 row ``m_h (j - c)`` to the fp32
  scores (torch's CPU flash kernel takes ``is_causal`` and a broadcast mask at once): head size and
  q, k, v untouched, no copies; fp32, fp64, bf16 and fp16 alike.
* "channel": any SDPA kernel: q gets channels of 1, k the bias as channels (fp32: one channel; bf16 /
  fp16: three half-precision parts whose sum is the fp32 channel), head size padded to a multiple of 8.
* "cudnn": the channel construction on cuDNN's attention (CUDA, half precision), values unpadded: a q/k head of 72
  with values of 64, where SDPA's flash kernel runs every head of 72 in its 96-wide variant.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .compat import cpu_flash_attention, cpu_flash_attention_shares_kv_heads, repeat_kv
from .slopes import CAUSAL, BiasSpec, KeyRounding, offsets, row_positions, sink_keys

ROW, CHANNEL, CUDNN = "row", "channel", "cudnn"
FOLD_CONSTRUCTIONS = (ROW, CHANNEL, CUDNN)
# Forces a construction where it can run (e.g. HF_ALIBI_FOLD=channel: the benchmark's fold on SDPA's flash kernel)
FOLD_ENV = "HF_ALIBI_FOLD"
# the widest q/k head cuDNN's attention takes on every GPU it runs on (Ampere and later)
CUDNN_MAX_HEAD = 128
HALF_DTYPES = (torch.float16, torch.bfloat16)
# half-precision parts of the channel: 3 x 8 bits (bf16) or 3 x 11 bits (fp16) >= fp32's 24 bits
HALF_PARTS = 3
# fp16's largest finite value is 65504: the key channel is kept at or below 2^14 by moving a power of
# two onto the query channels (products of a power of two stay exact).
FP16_CHANNEL_LIMIT = 2.0**14
# the head size fast kernels accept (CUDA flash / memory-efficient: a multiple of 8)
HEAD_MULTIPLE = 8
# cuDNN's attention first; the memory-efficient and math kernels (which also take narrower values) where it declines
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_CPU_FLASH = cpu_flash_attention()
_CPU_FLASH_GQA = cpu_flash_attention_shares_kv_heads()


def _half_accumulates_in_fp32() -> bool:
    """SDPA's kernels accumulate q.k of bf16/fp16 inputs in fp32, unless the user let the math
    backend reduce in half precision (``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``)."""
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    return allowed is None or not allowed()


def folded_unavailable(alibi, query: torch.Tensor, attention_mask, kwargs: dict) -> str | None:
    """Why the folded path cannot run this call exactly, or ``None`` when it can."""
    if alibi.kind != CAUSAL:
        return f"the {alibi.kind!r} bias is not causal (the fold needs softmax to ignore a per-query constant)"
    if query.dtype not in (torch.float32, torch.float64, *HALF_DTYPES):
        return f"{query.dtype} is not a float dtype the fold knows (float32, float64, bfloat16, float16)"
    if query.dtype in HALF_DTYPES:
        if query.device.type not in ("cpu", "cuda"):
            return f"half-precision attention on {query.device.type!r} is not known to accumulate q.k in fp32"
        if not _half_accumulates_in_fp32():
            return "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True) lets SDPA round scores to half"
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        return f"the attention mask is a {type(attention_mask).__name__}, not a tensor"
    if kwargs.get("position_bias") is not None:
        return "the layer passes its own position_bias"
    if kwargs.get("softcap") is not None:
        return "the layer soft-caps its scores (sdpa cannot)"
    if kwargs.get("cache") is not None:
        return "a paged cache is in use"
    return None


def cudnn_fold_available(query: torch.Tensor, attention_mask, dropout: float, channels: int = HALF_PARTS) -> bool:
    """Whether the cuDNN construction can run: CUDA, bf16 or fp16, causal without a mask, no dropout, cuDNN's
    attention enabled in this torch, and the q/k head with the fold's ``channels`` at most :data:`CUDNN_MAX_HEAD`."""
    return (
        query.device.type == "cuda"
        and query.dtype in HALF_DTYPES
        and attention_mask is None
        and dropout == 0.0
        and getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)()
        and query.shape[-1] + channels <= CUDNN_MAX_HEAD
    )


def fold_construction(query: torch.Tensor, attention_mask, dropout: float = 0.0, sinks: int = 0) -> str:
    """``"row"`` where torch's CPU flash kernel can add the bias row itself (CPU, no mask from
    transformers, no dropout: that kernel has none, no sinks: their term depends on the query);
    ``"cudnn"`` on CUDA in half precision where cuDNN's attention can run (:func:`cudnn_fold_available`): it takes
    the fold's wider q/k head (64 + 3 channels, padded to 72) with values of 64, where SDPA's flash kernel pads
    every head to its 96-wide variant. Measured on an H200 (bf16, 12 layers): 0.98-0.99 of the channel
    construction's training step at 16k tokens, 1.04-1.06 of its prefill rate (docs/performance.md). Else
    ``"channel"``. ``HF_ALIBI_FOLD`` forces one where it can run."""
    forced = os.environ.get(FOLD_ENV)
    if forced:
        if forced not in FOLD_CONSTRUCTIONS:
            raise ValueError(f"{FOLD_ENV}={forced!r}; expected one of {FOLD_CONSTRUCTIONS}.")
        if forced == CHANNEL or (forced == CUDNN and cudnn_fold_available(query, attention_mask, dropout)):
            return forced
    if cudnn_fold_available(query, attention_mask, dropout):
        return CUDNN
    if (
        query.device.type == "cpu"
        and attention_mask is None
        and dropout == 0.0
        and not sinks
        and _CPU_FLASH is not None
    ):
        return ROW
    return CHANNEL


def half_parts(channel: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``channel`` (fp32 / fp64) as ``(..., n)`` in ``dtype``: n = 1, or three half parts summing to it (each
    subtraction exact in ``channel``'s dtype). The sdpa fold's channels, and vLLM's sinks channels
    (``hf_alibi/serve/vllm/sinks.py``), are made by it."""
    if dtype not in HALF_DTYPES:
        return channel.to(dtype)[..., None]
    exact = channel.dtype
    parts, rest = [], channel
    for _ in range(HALF_PARTS):
        part = rest.to(dtype)
        parts.append(part)
        rest = rest - part.to(exact)
    return torch.stack(parts, dim=-1)


def _sink_fold_channels(
    slopes: torch.Tensor, q_len: int, kv_len: int, scaling: float, dtype: torch.dtype, sinks: int, starts, end
) -> tuple[torch.Tensor, torch.Tensor]:
    """The extra query ``(1, H, q, 2n)`` and key ``(B|1, H, kv, 2n)`` channels of the fold with sinks.

    Up to the per-query constant ``m (i - c)``, which softmax ignores, the bias is ``m (p_j - c)`` on a
    key at position ``p_j`` and ``m (i - c)`` on a sink (whose true bias is 0). So q gets ``[2^e] * n``
    and the parts of ``m (i - c) / scaling / 2^e``; k gets the parts of ``m (p_j - c) / scaling / 2^e``
    (0 on sinks) and ``[2^e * is_sink_j] * n``. Positions are absolute (see ``slopes.relative_distance``:
    ``end`` places static and sliding caches), ``c`` centres the keys; n and ``e`` as the plain fold.
    """
    exact = torch.promote_types(dtype, torch.float32)
    device = slopes.device
    query_offset, key_offset = offsets(q_len, kv_len, end)
    centre = key_offset + (kv_len - 1) / 2
    key_pos = torch.arange(kv_len, device=device, dtype=exact) + (key_offset - centre)
    query_pos = torch.arange(q_len, device=device, dtype=exact) + (query_offset - centre)
    power = 1.0
    if dtype == torch.float16:  # as _fold_channels: keep |channel| <= 2^14 (fp16 ends at 65504)
        last = query_offset + q_len - 1
        largest = max(abs(key_offset - centre), abs(query_offset - centre), abs(last - centre), (kv_len - 1) / 2)
        while largest / scaling / power > FP16_CHANNEL_LIMIT:
            power *= 2.0
    slopes = slopes.to(exact)[:, None] / scaling / power  # (H, 1)
    sink = sink_keys(kv_len, sinks, starts, end, device=device)[:, :, 0, :, None]  # (B|1, 1, kv, 1)
    exempt = (slopes * key_pos)[None, :, :, None].masked_fill(sink, 0.0)[..., 0]
    key_channel = half_parts(exempt, dtype)  # (B|1, H, kv, n)
    query_channel = half_parts(slopes * query_pos, dtype)[None]  # (1, H, q, n)
    n = query_channel.shape[-1]
    heads = slopes.shape[0]
    indicator = (sink.to(dtype) * power).expand(-1, heads, kv_len, n)  # (B|1, H, kv, n)
    ones = query_channel.new_full((), power).expand(1, heads, q_len, n)
    return torch.cat([ones, query_channel], dim=-1), torch.cat([key_channel, indicator], dim=-1)


def _centred(terms: torch.Tensor) -> torch.Tensor:
    """``terms`` less the middle of their range along the keys (a constant per row and head, which softmax
    ignores): half the magnitude, so half the rounding, of the values the fold adds."""
    return terms - (terms.amax(-1, keepdim=True) + terms.amin(-1, keepdim=True)) / 2


def _rounded_fold_channels(
    slopes: torch.Tensor, rounding: KeyRounding, q_len: int, kv_len: int, scaling: float, dtype: torch.dtype, starts,
    end,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The query ``(1, H, q, n)`` and key ``(B|1, H, kv, n)`` channels of a bias rounded per key: ``t(p_j)`` (less a
    constant per row and head, to halve its magnitude) on the keys, each row's positions counted from its start."""
    exact = torch.promote_types(dtype, torch.float32)
    _, key_pos = row_positions(q_len, kv_len, starts, end, device=slopes.device)  # (B|1, kv)
    channel = _centred(rounding.terms(slopes, key_pos.to(exact)).transpose(0, 1)) / scaling  # (B|1, H, kv)
    power = 1.0
    if dtype == torch.float16:  # as _fold_channels: keep |channel| <= 2^14 (fp16 ends at 65504)
        while float(channel.abs().max()) / power > FP16_CHANNEL_LIMIT:
            power *= 2.0
        channel = channel / power
    key_channel = half_parts(channel, dtype)  # (B|1, H, kv, n)
    n = key_channel.shape[-1]
    return key_channel.new_full((), power).expand(1, slopes.shape[0], q_len, n), key_channel


def _fold_channels(
    slopes: torch.Tensor, kv_len: int, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """The key channels ``(H, kv, n)`` in ``dtype`` and the query channels' value (a power of two).

    fp32 / fp64: one channel ``m_h (j - c) / scaling``, computed in fp32 / fp64. bf16 / fp16: that
    fp32 value ``x`` (divided by ``2^e`` for fp16's range) in three parts ``hi = half(x)``,
    ``mid = half(x - hi)``, ``lo = half(x - hi - mid)`` (each subtraction exact in fp32).
    """
    exact = torch.promote_types(dtype, torch.float32)  # fp32 slopes, fp64 stays fp64
    positions = torch.arange(kv_len, device=slopes.device, dtype=exact) - (kv_len - 1) / 2
    channel = slopes.to(exact)[:, None] * positions / scaling  # (H, kv)
    if dtype not in HALF_DTYPES:
        return channel.to(dtype)[..., None], 1.0
    power = 1.0
    if dtype == torch.float16:  # ALiBi slopes are <= 1: |channel| <= (kv - 1) / 2 / scaling
        while (kv_len - 1) / 2 / scaling / power > FP16_CHANNEL_LIMIT:
            power *= 2.0
        channel = channel / power  # exact: a power of two
    return half_parts(channel, dtype), power


def folded_causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    slopes: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    construction: str | None = None,
    bias: BiasSpec | None = None,
    rows: tuple = (None, None),
) -> tuple[torch.Tensor, None]:
    """Causal ALiBi through SDPA's causal kernel with no L x L tensor, in fp32, fp64, bf16 or fp16.

    The causal bias ``-m_h (i - j)`` equals ``b_j = m_h (j - c)`` up to a per-query constant, which
    softmax ignores (``c = (kv - 1) / 2`` centres the positions to halve ``|b|``, hence its rounding).
    ``construction`` (default: :func:`fold_construction`) says how ``b`` reaches the scores:

    ``"row"`` (CPU): torch's CPU flash kernel runs with ``is_causal`` and ``b`` as a ``(1, H, 1, kv)``
    fp32 mask row, broadcast over queries, added to its fp32 scores. q, k, v and the head size are
    untouched. Error: the fp32 rounding of ``b`` and of the sum, at most ``2u |b|`` per score
    (``u = 2^-24``) beyond the kernel's own; ``|b| <= m_h (kv - 1) / 2``.

    ``"channel"`` (any device, any SDPA kernel): q gets channels of ``2^e`` and k channels whose sum
    is ``x_j = b_j / scaling / 2^e``; SDPA's ``q' k'^T * scaling`` is ``q k^T * scaling + b_j``. v is
    padded with zeros and the output drops them; the head size is padded to a multiple of 8 (the
    fast kernels' requirement). fp32 / fp64: one channel ``x`` (``e = 0``). bf16 / fp16: ``x`` in
    fp32 split into three parts ``hi = half(x)``, ``mid = half(x - hi)``, ``lo = half(x - hi - mid)``;
    ``e > 0`` only for fp16, so that ``|x| <= 2^14`` (fp16 ends at 65504).

    Error bound of the half-precision channel (``u = 2^-24``, ``p`` = 8 bits for bf16, 11 for fp16):
    ``x`` is ``b / scaling / 2^e`` rounded once to fp32 (``<= u |x|``); each part leaves a remainder at
    most ``2^-p`` of the last, so ``|x - hi - mid - lo| <= 2^-3p |x|``, which is ``<= u |x|`` for bf16
    and ``2^-33 |x|`` for fp16 (plus fp16's subnormal step ``2^-25``); each part times ``2^e`` is
    exact in fp32, and the kernels accumulate ``q.k`` in fp32 (SDPA's math backend too, unless
    ``allow_fp16_bf16_reduction_math_sdp`` is set, which ``folded_unavailable`` refuses). So the bias
    reaching a score is ``b_j`` within ``2u |b_j|`` plus the kernel's fp32 rounding of a sum of
    magnitude ``|q.k| * scaling + |b_j|`` (at most ``(D' + 3) u`` of that, ``D'`` the padded head
    size; a few ``u`` in practice). A score error ``d`` moves the output by at most ``2 d max|v|``.
    With ``|b| <= m_h (kv - 1) / 2``: for m = 0.5 at 32k keys, ``|b| <= 8192`` and ``u |b| = 5e-4``,
    below bf16's own rounding of q, k, v and the probabilities (``2^-8 = 4e-3``); fp16's
    (``2^-11 = 5e-4``) is of the same size there.

    ``"cudnn"`` (CUDA, half precision, no mask): the channel construction with values left at their width, run by
    cuDNN's attention (``SDPBackend.CUDNN_ATTENTION``, which takes q/k heads wider than v's); the same error bound.

    ``bias``: the layer's bias as one value (:class:`~hf_alibi.core.slopes.BiasSpec`; ``None``: the plain causal bias
    of ``slopes``), of which the fold reads the sinks and the rounding; ``rows``: ``(starts, end)``, the forward's
    (``AlibiForward.rows``), where each row's real tokens start (``(B,)`` or ``None``) and the sequence's true end
    (which places queries and keys of static and sliding caches).

    Sinks (channel and cudnn constructions only): the first ``bias.sinks`` real keys of each row get bias 0; two
    channel groups instead of one, see :func:`_sink_fold_channels`.

    Rounding (a bias rounded per key, :class:`~hf_alibi.core.slopes.KeyRounding`): ``b_j`` is its ``t(p_j)``,
    each row's positions counted from ``starts``, on either construction (the row: no mask, so no padding).

    transformers' mask is used as it is: ``None`` (pure causal: ``is_causal``, with the keys cut to
    the queries exactly as transformers' sdpa does, whose ``None`` means top-left alignment) or a
    boolean / additive mask that already holds causality and padding for any cache offset.
    Shapes ``(B, H, L, D)``; returns ``(B, q, H, D)`` like transformers' backends.
    """
    batch, heads, q_len, head_dim = query.shape
    sinks, rounding = (0, None) if bias is None else (bias.sinks, bias.rounding)
    starts, end = rows
    if scaling is None:
        scaling = head_dim**-0.5
    if construction is None:
        construction = fold_construction(query, attention_mask, dropout, sinks)
    if construction not in FOLD_CONSTRUCTIONS or (sinks and construction == ROW):
        raise ValueError(
            f"fold construction must be one of {FOLD_CONSTRUCTIONS} ('channel' with sinks), got {construction!r}"
        )
    # the length first, as transformers' sdpa does: under torch.compile's dynamic shapes (a second length) q_len is
    # symbolic, `and` then guards on it and returns the plain bool after it (SDPA takes no SymBool)
    is_causal = q_len > 1 and attention_mask is None
    if is_causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        end = q_len  # top-left alignment: the queries are the first q_len positions
    kv_len = key.shape[2]
    if construction == ROW:
        if key.shape[1] != heads and not _CPU_FLASH_GQA:  # torch >= 2.5 shares KV heads in the kernel itself
            key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
        exact = torch.promote_types(query.dtype, torch.float32)
        positions = torch.arange(kv_len, device=query.device, dtype=exact)
        if rounding is None:
            row = slopes.to(exact)[:, None] * (positions - (kv_len - 1) / 2)  # fp32 (fp64 for fp64)
        else:  # no mask: no padding, every row's keys start at 0
            row = _centred(rounding.terms(slopes, positions))
        row = row.view(1, heads, 1, kv_len)
        if attention_mask is not None:  # not the default choice (an L x L merge), but correct
            if attention_mask.dtype == torch.bool:
                row = torch.where(attention_mask, row, -float("inf"))
            else:
                row = row + attention_mask.to(exact)
        output, _ = _CPU_FLASH(query, key, value, dropout, is_causal, attn_mask=row, scale=scaling)
        return output.transpose(1, 2).contiguous(), None
    if key.shape[1] != heads:  # grouped KV heads: the channel differs per query head
        key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
    if sinks:
        q_channels, k_channels = _sink_fold_channels(
            slopes, q_len, kv_len, scaling, query.dtype, sinks, starts, end
        )  # (1, H, q, n), (B|1, H, kv, n)
    elif rounding is not None:
        q_channels, k_channels = _rounded_fold_channels(
            slopes, rounding, q_len, kv_len, scaling, query.dtype, starts, end
        )  # (1, H, q, n), (B|1, H, kv, n)
    else:
        channels, power = _fold_channels(slopes, kv_len, scaling, query.dtype)  # (H, kv, n)
        q_channels, k_channels = query.new_full((), power).expand(1, heads, q_len, channels.shape[-1]), channels[None]
    n = q_channels.shape[-1]
    padded = head_dim + n
    if query.dtype in HALF_DTYPES or query.device.type != "cpu":
        padded = -(-padded // HEAD_MULTIPLE) * HEAD_MULTIPLE
    zeros = padded - head_dim - n
    q_extra = [q_channels.expand(batch, heads, q_len, n)]
    k_extra = [k_channels.expand(batch, heads, kv_len, n)]
    if zeros:
        q_extra.append(query.new_zeros(()).expand(batch, heads, q_len, zeros))
        k_extra.append(key.new_zeros(()).expand(batch, heads, kv_len, zeros))
    query = torch.cat([query, *q_extra], dim=-1)  # (B, H, q, D')
    key = torch.cat([key, *k_extra], dim=-1)
    if construction == CUDNN:  # cuDNN takes values narrower than q and k: no padding, no copy, no slicing
        with sdpa_kernel(CUDNN_FIRST, set_priority=True):
            output = nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
            )  # (B, H, q, D)
        return output.transpose(1, 2).contiguous(), None
    value = nn.functional.pad(value, (0, padded - head_dim))
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
    )  # (B, H, q, D')
    return output[..., :head_dim].transpose(1, 2).contiguous(), None
