"""ALiBi attention for transformers v5's attention interface, for every backend in one place.

A patched model's config reports ``config._attn_implementation == "alibi_<backend>"`` (see
``config.py``), so transformers dispatches each attention layer to the function registered here
under that name. The function finds the layer's :class:`AlibiBias` (``module.alibi``), builds the
bias, merges it with the mask transformers made, and calls the backend. A layer without an
``AlibiBias`` (cross-attention) runs the backend unchanged: no position bias, as in T5.

Registering new names is all that happens at import: no transformers function is replaced, so
models that were not patched are untouched.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .slopes import BIAS_KINDS, CAUSAL, LEARNED, NONSYMMETRIC, SYMMETRIC, alibi_bias, get_slopes

PREFIX = "alibi_"

# How the sdpa backend applies the bias (see ``choose_path``): "folded" puts the causal bias into an
# extra q/k channel and keeps SDPA's causal kernel (no L x L tensor); "bias" builds the bias tensor
# and hands SDPA one float mask. "auto" takes "folded" wherever it is exact.
AUTO, FOLDED, BIAS = "auto", "folded", "bias"
PATHS = (AUTO, FOLDED, BIAS)
# Below this many queries (decoding, small chunks) "auto" takes the bias path: its tensor is only
# H x q x kv there, while the fold would copy the whole K/V cache once more per layer and step.
FOLD_MIN_QUERIES = 32
# Forces a path for every AlibiBias whose own ``path`` is left at "auto" (e.g. HF_ALIBI_PATH=bias).
PATH_ENV = "HF_ALIBI_PATH"


class AlibiBias(nn.Module):
    """Per-layer ALiBi state: which bias form, how many heads, and the learned slopes if any.

    The fixed slopes are not buffers: they are recomputed in float32 per device, so that
    ``model.half()`` can never round them and a state dict is the same with or without ALiBi.
    Only the ``learned`` form owns parameters (``slopes_left`` / ``slopes_right``, before the
    ``-sigmoid``), which are saved with the model's weights.

    ``path`` picks how the sdpa backend applies the bias: ``"auto"`` (default; the environment
    variable ``HF_ALIBI_PATH`` can override it), ``"folded"`` or ``"bias"``; see :func:`choose_path`.
    ``last_path`` records the path the latest call took ("folded", "bias", "flex" or "flash").
    """

    def __init__(self, kind: str, num_heads: int, path: str = AUTO):
        super().__init__()
        if kind not in BIAS_KINDS:
            raise ValueError(f"Unknown ALiBi bias kind {kind!r}; expected one of {BIAS_KINDS}.")
        self.kind = kind
        self.num_heads = num_heads
        self.path = path
        self.last_path: str | None = None
        if kind == LEARNED:
            self.slopes_left = nn.Parameter(torch.empty(num_heads))
            self.slopes_right = nn.Parameter(torch.empty(num_heads))
            self.reset_parameters()
        self._slopes_by_device: dict[torch.device, torch.Tensor] = {}

    def reset_parameters(self) -> None:
        """The seed's initialisation of the learned slopes: normal(-2, 1) before the -sigmoid."""
        if self.kind == LEARNED:
            with torch.no_grad():
                self.slopes_left.normal_(-2.0, 1.0)
                self.slopes_right.normal_(-2.0, 1.0)

    def fixed_slopes(self, device: torch.device) -> torch.Tensor:
        slopes = self._slopes_by_device.get(device)
        if slopes is None:
            slopes = self._slopes_by_device[device] = get_slopes(self.num_heads, device=device)
        return slopes

    def forward(self, q_len: int, kv_len: int, device: torch.device, masked_value: float) -> torch.Tensor:
        """The bias with this layer's own masking (causal, nonsymmetric), fp32 ``(1, H, q, kv)``."""
        if self.kind == LEARNED:
            left, right = self.learned_slopes()
            return alibi_bias(LEARNED, q_len, kv_len, left, slopes_right=right, masked_value=masked_value)
        if self.kind == CAUSAL and q_len == 1:  # a decoding step: every key is in the past
            distance = torch.arange(kv_len - 1, -1, -1, device=device, dtype=torch.float32)  # i - j
            return (self.fixed_slopes(device)[:, None] * -distance).view(1, self.num_heads, 1, kv_len)
        return alibi_bias(self.kind, q_len, kv_len, self.fixed_slopes(device), masked_value=masked_value)

    @property
    def path(self) -> str:
        return self._path

    @path.setter
    def path(self, value: str) -> None:
        if value not in PATHS:
            raise ValueError(f"ALiBi path must be one of {PATHS}, got {value!r}.")
        self._path = value

    def learned_slopes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned form's (left, right) slopes, fp32 and negative, with their gradients."""
        return -torch.sigmoid(self.slopes_left.float()), -torch.sigmoid(self.slopes_right.float())

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, num_heads={self.num_heads}, path={self.path!r}"


def set_attention_path(model: nn.Module, path: str) -> nn.Module:
    """Set how every ALiBi layer of ``model`` applies its bias on the sdpa backend.

    ``"auto"`` (default) folds causal fp32 attention into SDPA's causal kernel where that is exact
    and takes the bias tensor elsewhere; ``"folded"`` forces the fold (an error where it would be
    wrong); ``"bias"`` always builds the bias tensor. ``HF_ALIBI_PATH`` sets the same for layers
    left at ``"auto"``.

    >>> hf_alibi.set_attention_path(model, "bias")  # doctest: +SKIP
    """
    if path not in PATHS:
        raise ValueError(f"ALiBi path must be one of {PATHS}, got {path!r}.")
    layers = [m for m in model.modules() if isinstance(m, AlibiBias)]
    if not layers:
        raise ValueError("This model has no ALiBi layers: convert it with hf_alibi.patch_model first.")
    for layer in layers:
        layer.path = path
    return model


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
    return merged.to(dtype)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with an additive mask; softmax in float32. Shapes ``(B, H, L, D)``."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, H, q, kv)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, q, H, D)
    return output, weights


def _unsupported_backend(name: str) -> Callable:
    def forward(*args, **kwargs):
        raise NotImplementedError(
            f"hf_alibi has no ALiBi path for attn_implementation={name!r} yet. "
            f"Use one of {sorted(BACKENDS) + sorted(NATIVE_BACKENDS)}: model.set_attn_implementation('sdpa')."
        )

    return forward


# ---------------------------------------------------------------------------------------------
# The bias path: one float mask per forward, shared by every layer.


class _SharedMask:
    """The merged mask of the fixed-slope forms, built once per forward and reused by every layer.

    Every layer of a model has the same heads and fixed slopes, and transformers hands all of its
    layers the same mask object, so the merged mask (bias + padding + causality) only depends on
    (kind, heads, q_len, kv_len, device, dtype) and on that mask object. One entry is kept: the
    latest. It is dropped when the converted model's forward ends (``release_shared_masks``, a
    forward hook that ``ArchitectureSpec.apply`` installs), so it never outlives the forward it was
    made for. The learned form is never shared: its slopes differ per layer and carry gradients.
    """

    def __init__(self):
        # (key, transformers' mask it was made from, merged mask): one tuple, replaced whole, so a
        # reader in another thread never pairs one entry's key with another's tensor
        self.entry: tuple | None = None
        self.builds = 0  # how many masks were built (tests count them)

    @property
    def merged(self) -> torch.Tensor | None:
        entry = self.entry
        return None if entry is None else entry[2]

    def get(self, alibi: AlibiBias, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None):
        dtype, device, q_len = query.dtype, query.device, query.shape[2]
        # inference-mode tensors cannot be saved for backward: never hand one to a grad-mode call
        key = (alibi.kind, alibi.num_heads, q_len, kv_len, device, dtype, torch.is_inference_mode_enabled())
        entry = self.entry
        if entry is not None and entry[0] == key and entry[1] is attention_mask:
            return entry[2]
        bias = alibi(q_len, kv_len, device, torch.finfo(dtype).min)  # (1, H, q, kv) fp32
        merged = merge_bias_and_mask(bias, attention_mask, dtype)
        self.builds += 1
        self.entry = (key, attention_mask, merged)
        return merged

    def clear(self) -> None:
        self.entry = None


SHARED_MASK = _SharedMask()


def release_shared_masks(*_args, **_kwargs) -> None:
    """Drop the mask shared by the layers of the forward that just ended (a forward hook)."""
    SHARED_MASK.clear()


def bias_mask(alibi: AlibiBias, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None):
    """Bias + transformers' mask as one additive float mask in the query's dtype, ``(1 or B, H, q, kv)``."""
    if alibi.kind == LEARNED:
        bias = alibi(query.shape[2], kv_len, query.device, torch.finfo(query.dtype).min)
        return merge_bias_and_mask(bias, attention_mask, query.dtype)
    return SHARED_MASK.get(alibi, query, kv_len, attention_mask)


# ---------------------------------------------------------------------------------------------
# The folded path: the causal bias without an L x L tensor, in SDPA's causal kernel, any float dtype.
#
# Two constructions of the same thing (see ``folded_causal_attention``):
# "row": on CPU, the causal kernel itself adds a (1, H, 1, kv) fp32 row ``m_h (j - c)`` to the fp32
#   scores (torch's CPU flash kernel takes ``is_causal`` and a broadcast mask at once): head size and
#   q, k, v untouched, no copies; fp32, fp64, bf16 and fp16 alike.
# "channel": any SDPA kernel: q gets channels of 1, k the bias as channels (fp32: one channel; bf16 /
#   fp16: three half-precision parts whose sum is the fp32 channel), head size padded to a multiple of 8.

ROW, CHANNEL = "row", "channel"
FOLD_CONSTRUCTIONS = (ROW, CHANNEL)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# half-precision parts of the channel: 3 x 8 bits (bf16) or 3 x 11 bits (fp16) >= fp32's 24 bits
HALF_PARTS = 3
# fp16's largest finite value is 65504: the key channel is kept at or below 2^14 by moving a power of
# two onto the query channels (products of a power of two stay exact).
FP16_CHANNEL_LIMIT = 2.0**14
# the head size fast kernels accept (CUDA flash / memory-efficient: a multiple of 8)
HEAD_MULTIPLE = 8
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_GQA = torch.__version__ >= "2.5"  # grouped KV heads in that kernel (forward and backward)


def _half_accumulates_in_fp32() -> bool:
    """SDPA's kernels accumulate q.k of bf16/fp16 inputs in fp32, unless the user let the math
    backend reduce in half precision (``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``)."""
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    return allowed is None or not allowed()


def folded_unavailable(alibi: AlibiBias, query: torch.Tensor, attention_mask, kwargs: dict) -> str | None:
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
    if kwargs.get("cache") is not None:
        return "a paged cache is in use"
    return None


def fold_construction(query: torch.Tensor, attention_mask, dropout: float = 0.0) -> str:
    """``"row"`` where torch's CPU flash kernel can add the bias row itself (CPU, no mask from
    transformers, no dropout: that kernel has none), else ``"channel"``."""
    if query.device.type == "cpu" and attention_mask is None and dropout == 0.0 and _CPU_FLASH is not None:
        return ROW
    return CHANNEL


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
    parts, rest = [], channel
    for _ in range(HALF_PARTS):
        part = rest.to(dtype)
        parts.append(part)
        rest = rest - part.to(exact)
    return torch.stack(parts, dim=-1), power


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

    transformers' mask is used as it is: ``None`` (pure causal: ``is_causal``, with the keys cut to
    the queries exactly as transformers' sdpa does, whose ``None`` means top-left alignment) or a
    boolean / additive mask that already holds causality and padding for any cache offset.
    Shapes ``(B, H, L, D)``; returns ``(B, q, H, D)`` like transformers' backends.
    """
    batch, heads, q_len, head_dim = query.shape
    if scaling is None:
        scaling = head_dim**-0.5
    if construction is None:
        construction = fold_construction(query, attention_mask, dropout)
    if construction not in FOLD_CONSTRUCTIONS:
        raise ValueError(f"fold construction must be one of {FOLD_CONSTRUCTIONS}, got {construction!r}")
    is_causal = attention_mask is None and q_len > 1
    if is_causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    kv_len = key.shape[2]
    if construction == ROW:
        if key.shape[1] != heads and not _CPU_FLASH_GQA:  # torch >= 2.5 shares KV heads in the kernel itself
            key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
        exact = torch.promote_types(query.dtype, torch.float32)
        positions = torch.arange(kv_len, device=query.device, dtype=exact) - (kv_len - 1) / 2
        row = (slopes.to(exact)[:, None] * positions).view(1, heads, 1, kv_len)  # fp32 (fp64 for fp64)
        if attention_mask is not None:  # not the default choice (an L x L merge), but correct
            if attention_mask.dtype == torch.bool:
                row = torch.where(attention_mask, row, -float("inf"))
            else:
                row = row + attention_mask.to(exact)
        output, _ = _CPU_FLASH(query, key, value, dropout, is_causal, attn_mask=row, scale=scaling)
        return output.transpose(1, 2).contiguous(), None
    if key.shape[1] != heads:  # grouped KV heads: the channel differs per query head
        key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
    channels, power = _fold_channels(slopes, kv_len, scaling, query.dtype)  # (H, kv, n)
    n = channels.shape[-1]
    padded = head_dim + n
    if query.dtype in HALF_DTYPES or query.device.type != "cpu":
        padded = -(-padded // HEAD_MULTIPLE) * HEAD_MULTIPLE
    zeros = padded - head_dim - n
    q_extra = [query.new_full((), power).expand(batch, heads, q_len, n)]
    k_extra = [channels[None].expand(batch, heads, kv_len, n)]
    if zeros:
        q_extra.append(query.new_zeros(()).expand(batch, heads, q_len, zeros))
        k_extra.append(key.new_zeros(()).expand(batch, heads, kv_len, zeros))
    query = torch.cat([query, *q_extra], dim=-1)  # (B, H, q, D')
    key = torch.cat([key, *k_extra], dim=-1)
    value = nn.functional.pad(value, (0, padded - head_dim))
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
    )  # (B, H, q, D')
    return output[..., :head_dim].transpose(1, 2).contiguous(), None


def choose_path(alibi: AlibiBias, backend: str, query: torch.Tensor, attention_mask, kwargs: dict) -> str:
    """The path this call takes: ``"folded"`` where it is exact and pays, else ``"bias"``.

    "auto" folds causal sdpa attention of at least ``FOLD_MIN_QUERIES`` queries in fp32, fp64,
    bf16 and fp16 (half precision on CPU and CUDA, where SDPA accumulates q.k in fp32), with or
    without a padding mask, at any cache offset; decoding steps and small chunks take the bias path
    (an H x q x kv tensor, cheaper there than copying K and V). Measured on CPU (README,
    Performance): the fold (row construction) costs 0.96 to 1.04 of the unpatched model's training
    step in bf16 and fp32 where the bias path costs up to 2x; with a mask (channel construction) it
    is below the bias path from 256 queries and within noise of it at 32 to 128; it never builds an
    L x L tensor. CUDA is chosen by construction, not yet measured (``benchmarks/gpu.py``).

    ``alibi.path`` (or ``HF_ALIBI_PATH`` when it is ``"auto"``) forces one; forcing ``"folded"``
    where it would be wrong raises instead of computing something else.
    """
    wanted = alibi.path
    if wanted == AUTO:
        wanted = os.environ.get(PATH_ENV, AUTO) or AUTO
        if wanted not in PATHS:
            raise ValueError(f"{PATH_ENV}={wanted!r}; expected one of {PATHS}.")
    if wanted == BIAS or (wanted == AUTO and query.shape[2] < FOLD_MIN_QUERIES):
        return BIAS  # a few queries (decoding): the bias is small there, and this is the hot loop
    if backend != "sdpa":
        reason = f"only the sdpa backend has it, not {backend!r}"
    else:
        reason = folded_unavailable(alibi, query, attention_mask, kwargs)
    if reason is None:
        return FOLDED
    if wanted == FOLDED:
        raise ValueError(
            f"The folded ALiBi path was forced but cannot run here: {reason}. "
            f"Set layer.alibi.path (or {PATH_ENV}) to 'auto' or 'bias'."
        )
    return BIAS


def make_alibi_attention(backend_name: str, backend: Callable) -> Callable:
    """Wrap a mask-taking backend so that it applies the layer's ALiBi bias."""

    def alibi_attention_forward(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs,
    ):
        alibi: AlibiBias | None = getattr(module, "alibi", None)
        if alibi is None:  # cross-attention: no position bias
            return backend(module, query, key, value, attention_mask, **kwargs)
        _check_heads(alibi, query)
        path = choose_path(alibi, backend_name, query, attention_mask, kwargs)
        alibi.last_path = path
        if path == FOLDED:
            return folded_causal_attention(
                module, query, key, value, attention_mask, alibi.fixed_slopes(query.device),
                dropout=kwargs.get("dropout", 0.0), scaling=kwargs.get("scaling"),
            )  # fmt: skip
        q_len = query.shape[2]
        if backend_name == "sdpa" and alibi.kind == CAUSAL and attention_mask is None and 1 < q_len < key.shape[2]:
            # transformers' sdpa gives no mask here only when top-left alignment is right (prefill
            # into an empty static cache) and then cuts the keys to the queries: do the same.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        mask = bias_mask(alibi, query, key.shape[2], attention_mask)
        kwargs.pop("is_causal", None)  # causality is in the mask now
        kwargs.pop("position_bias", None)
        return backend(module, query, key, value, mask, is_causal=False, **kwargs)

    return alibi_attention_forward


def _check_heads(alibi: AlibiBias, query: torch.Tensor) -> None:
    if query.shape[1] != alibi.num_heads:
        raise ValueError(f"ALiBi was set up for {alibi.num_heads} heads but this layer computes {query.shape[1]}.")


# ---------------------------------------------------------------------------------------------
# FlexAttention: the bias as a score_mod computed from the slopes, no bias tensor.


def alibi_score_mod(alibi: AlibiBias, q_len: int, kv_len: int, device: torch.device) -> Callable:
    """FlexAttention ``score_mod`` adding the layer's bias; queries are the last ``q_len`` positions.

    Disallowed pairs (causal future keys, the nonsymmetric form's other side) get ``-inf``; the
    mask transformers made (a ``BlockMask``) handles padding.
    """
    offset = kv_len - q_len
    kind = alibi.kind
    if kind == LEARNED:
        left, right = alibi.learned_slopes()
        left, right = left.to(device), right.to(device)

        def learned_mod(score, b, h, q_idx, kv_idx):
            distance = (q_idx + offset - kv_idx).to(torch.float32)
            return score + torch.where(distance >= 0, left[h] * distance, -right[h] * distance)

        return learned_mod
    slopes = alibi.fixed_slopes(device)
    half = alibi.num_heads // 2

    def fixed_mod(score, b, h, q_idx, kv_idx):
        distance = (q_idx + offset - kv_idx).to(torch.float32)
        biased = score - slopes[h] * distance.abs()
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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """ALiBi with FlexAttention: transformers' ``BlockMask`` for padding, the bias as a ``score_mod``.

    On CPU, FlexAttention (torch 2.13) runs forward only: training there raises. Shapes as SDPA.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if dropout > 0:
        raise ValueError("flex_attention has no attention dropout: set the model's attention dropout to 0.")
    alibi: AlibiBias | None = getattr(module, "alibi", None)
    if alibi is None:
        from transformers.integrations.flex_attention import flex_attention_forward

        return flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    _check_heads(alibi, query)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *alibi.parameters()))
    if query.device.type == "cpu" and needs_grad:
        raise NotImplementedError(
            "FlexAttention has no backward pass on CPU (torch 2.13): train with "
            "model.set_attn_implementation('sdpa') there, or run this under torch.no_grad()."
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    score_mod = alibi_score_mod(alibi, q_len, kv_len, query.device)
    if isinstance(attention_mask, torch.Tensor):  # a 4D mask (bool or additive) instead of a BlockMask
        extra = attention_mask[:, :, :, :kv_len]
        extra = torch.where(extra, 0.0, -float("inf")) if extra.dtype == torch.bool else extra.float()
        inner = score_mod

        def score_mod(score, b, h, q_idx, kv_idx):
            return inner(score, b, h, q_idx, kv_idx) + extra[b, 0, q_idx, kv_idx]

    if key.shape[1] != query.shape[1]:
        key, value = repeat_kv(key, query.shape[1] // key.shape[1]), repeat_kv(value, query.shape[1] // key.shape[1])
    if query.device.type == "cpu":
        run = flex_attention  # the eager implementation: torch.compile on CPU needs a C++ toolchain
    else:
        from transformers.integrations.flex_attention import WrappedFlexAttention

        run = WrappedFlexAttention(module.training)()
    alibi.last_path = "flex"
    output = run(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------------------------
# flash-attn: its own ALiBi (fp32 ``alibi_slopes``), causal and symmetric.


def flash_alibi_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """ALiBi with flash-attn >= 2.4's ``alibi_slopes`` (bias ``-m |i + Lk - Lq - j|``, fp16/bf16, CUDA).

    ``attention_mask`` is transformers' 2D padding mask for flash attention (or ``None``); padded
    batches go through ``flash_attn_varlen_func``. Only the causal and symmetric forms exist there.
    """
    alibi: AlibiBias | None = getattr(module, "alibi", None)
    if alibi is None:
        from transformers.integrations.flash_attention import flash_attention_forward

        return flash_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    _check_heads(alibi, query)
    if alibi.kind not in (CAUSAL, SYMMETRIC):
        raise NotImplementedError(
            f"flash-attn's ALiBi has no {alibi.kind!r} form (only causal and symmetric): "
            "use model.set_attn_implementation('sdpa')."
        )
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise ImportError(
            "attn_implementation='flash_attention_2' with ALiBi needs flash-attn >= 2.4 (pip install flash-attn) "
            "and a CUDA GPU; otherwise use model.set_attn_implementation('sdpa')."
        ) from error
    if query.device.type != "cuda":
        raise RuntimeError("flash-attn runs on CUDA only: use model.set_attn_implementation('sdpa') on this device.")
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input, _upad_input

    if not module.training:
        dropout = 0.0
    causal = alibi.kind == CAUSAL
    slopes = alibi.fixed_slopes(query.device)  # fp32, as flash-attn requires
    half = query.dtype if query.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    q, k, v = (t.transpose(1, 2).to(half) for t in (query, key, value))  # (B, L, H, D)
    batch, q_len = q.shape[:2]
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, alibi_slopes=slopes)
    if attention_mask is None:
        output = flash_attn_func(q, k, v, **options)
    else:
        q, k, v, indices, (cu_q, cu_k), (max_q, max_k) = _upad_input(q, k, v, attention_mask, q_len, _unpad_input)
        output = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
        output = _pad_input(output, indices, batch, q_len)
    alibi.last_path = "flash"
    return output.to(query.dtype), None


# backend name -> (attention function, mask function); the attention function receives the
# merged float mask (bias + padding + causality) and never needs to know about ALiBi.
BACKENDS: dict[str, tuple[Callable, Callable]] = {
    "eager": (eager_attention_forward, AttentionMaskInterface._global_mapping["eager"]),
    "sdpa": (sdpa_attention_forward, AttentionMaskInterface._global_mapping["sdpa"]),
}
# backends that apply the bias themselves, from the slopes (no bias tensor), with transformers'
# own mask function for that backend.
NATIVE_BACKENDS: dict[str, Callable] = {
    "flex_attention": flex_alibi_attention,
    "flash_attention_2": flash_alibi_attention,
}
# transformers' names that hf_alibi knows of but cannot run with ALiBi yet: a clear error
# instead of transformers' "not a valid attention implementation".
UNSUPPORTED_BACKENDS = ("flash_attention_3", "flash_attention_4")


def alibi_name(backend: str | None) -> str | None:
    """``"sdpa"`` -> ``"alibi_sdpa"``; already prefixed names and ``None`` pass through."""
    if backend is None or backend.startswith(PREFIX):
        return backend
    return PREFIX + backend


def base_name(name: str | None) -> str | None:
    """``"alibi_sdpa"`` -> ``"sdpa"``."""
    if name is None:
        return None
    return name.removeprefix(PREFIX)


def register_backends() -> None:
    """Add ``alibi_<backend>`` to transformers' attention and mask interfaces (idempotent)."""
    for name, (attention, mask) in BACKENDS.items():
        AttentionInterface.register(alibi_name(name), make_alibi_attention(name, attention))
        AttentionMaskInterface.register(alibi_name(name), mask)
    for name, attention in NATIVE_BACKENDS.items():
        AttentionInterface.register(alibi_name(name), attention)
    for name in UNSUPPORTED_BACKENDS:
        if alibi_name(name) not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(alibi_name(name), _unsupported_backend(name))
    for name in (*NATIVE_BACKENDS, *UNSUPPORTED_BACKENDS):
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)
        if mask is not None and alibi_name(name) not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(alibi_name(name), mask)
