"""A native row's self-attention on hf_alibi's paths: its slopes, the module's forward (q, k, v from the fused
projection in the row's layout, the cache, the attention interface), and the boolean causal mask its base model is
handed."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..core.compat import CACHE_ARGUMENTS, attn_implementation, cache_argument, is_exporting
from ..core.forward import KEYWORD, bound_arguments, forward_of
from ..core.kernels import PADDING, kernel
from ..core.mask import attends
from ..core.names import alibi_name
from ..core.slopes import get_slopes_list, mpt_slopes_list
from .rows import MPT, PER_HEAD, NativeArchitecture, config_value


def native_slopes(row: NativeArchitecture, config, scaling: float) -> list[float]:
    """The slopes of a ``row`` model of ``config``, as the bias added after ``q k^T * scaling``: the row's formula,
    rounded to ``row.slope_dtype`` where the model rounds them, times ``scaling`` where the model adds its bias before
    the scaling (Falcon).

    >>> native_slopes(NativeArchitecture("falcon", "h.*.self_attention", "query_key_value", "dense",
    ...     bias_before_scaling=True), FalconConfig(num_attention_heads=4, hidden_size=16), 0.5)  # doctest: +SKIP
    [0.125, 0.03125, 0.0078125, 0.001953125]
    """
    heads = config.num_attention_heads
    if row.slopes == MPT:
        slopes = mpt_slopes_list(heads, float(config_value(config, row.bias_max)))
    else:
        slopes = get_slopes_list(heads)
    if row.slope_dtype is not None:  # Falcon rounds its slopes to bf16 (exact for 8 or fewer heads, not for 32)
        # on the CPU whatever the default device: under `with torch.device("meta")` a tensor holds no values to read
        slopes = torch.tensor(slopes, device="cpu").to(getattr(torch, row.slope_dtype)).double().tolist()
    return [s * scaling for s in slopes] if row.bias_before_scaling else slopes


def _takes_padding_mask(name: str | None) -> bool:
    # the flash kernels of the table take the 2D padding mask, not the 4D one
    row = kernel(name)
    return row is not None and row.mask == PADDING


class NativeAlibiAttention(nn.Module):
    """The forward of a native row's self-attention module, placed before the model's own class: q, k, v from the
    fused projection in the row's layout, the cache updated, the attention interface called with the row's scale
    (``ALL_ATTENTION_FUNCTIONS["alibi_<backend>"]``, the backend being the model config's), the output projected.
    Returns what the model's own module returns, ``(output, attention weights or None)``."""

    _native_row: NativeArchitecture
    _native_arguments: tuple[str, ...]  # the original forward's positional parameters after hidden_states

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        row = self._native_row
        values = {**dict(zip(self._native_arguments, args)), **kwargs}
        forward = forward_of(self.alibi, values)  # the model's blocks pass no keyword arguments: the running one
        backend = attn_implementation(self.config)
        if backend != "eager" and (values.get("output_attentions") or forward.attentions):
            backend = "eager"  # as transformers' own code of these models: the weights are asked for, eager has them
        mask = values.get("attention_mask")
        if row.boolean_mask and is_causal_mark(mask):
            mask = None  # causality is all that masks: the backends' causal case (the fold's fastest form)
        elif row.boolean_mask and mask is not None and _takes_padding_mask(backend):
            mask = mask[:, 0, -1, :]  # flash-attn takes the 2D padding mask: the boolean one's last query's row
        batch, length, _ = hidden_states.shape
        heads, head_dim = self.alibi.num_heads, self.head_dim
        fused = getattr(self, row.qkv)(hidden_states)  # (B, L, 3 H d)
        clip = getattr(self, row.clip) if row.clip else None
        if clip:
            fused = fused.clamp(min=-clip, max=clip)
        if row.layout == PER_HEAD:
            fused = fused.view(batch, length, heads, 3, head_dim)
            query, key, value = (fused[..., i, :].transpose(1, 2) for i in range(3))  # (B, H, L, d)
        else:
            query, key, value = (
                part.reshape(batch, length, heads, head_dim).transpose(1, 2) for part in fused.chunk(3, dim=-1)
            )
        arguments = {}
        paged = forward.paged
        if paged is not None:  # a continuous-batching step: the model's forward ran without the paged cache
            key, value, arguments = paged.update(key, value, self.layer_idx)
            mask = None  # the attention builds each request's mask from the arguments (batching.py)
        elif (cache := cache_argument(values) if row.cache in CACHE_ARGUMENTS else values.get(row.cache)) is not None:
            key, value = cache.update(key, value, self.layer_idx)
        dropout = getattr(self, row.dropout)
        dropout = dropout.p if isinstance(dropout, nn.Dropout) else float(dropout or 0.0)
        attention = ALL_ATTENTION_FUNCTIONS[alibi_name(backend)]
        output, weights = attention(
            self, query, key, value, mask,
            scaling=float(getattr(self, row.scaling)), dropout=dropout if self.training else 0.0, **arguments,
            **{KEYWORD: forward},
        )  # fmt: skip
        output = getattr(self, row.output)(output.reshape(batch, length, heads * head_dim))
        if row.residual:
            output = values["residual"] + F.dropout(output, p=self.hidden_dropout, training=self.training)
        return output, weights


_ATTENTION_CLASSES: dict[tuple[type, NativeArchitecture], type] = {}
_MODEL_CLASSES: dict[tuple[type, NativeArchitecture], type] = {}


def boolean_causal_mask(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The mask a native row's base model is handed (its forward pre-hook), ``(B, 1, q, kv)``, True where a query
    attends (the sdpa form every hf_alibi path takes), made from the 2D padding mask and the cache's length.

    MPT casts transformers' mask to bool (its eager mask, True where masked; sdpa's ``None``, the causal case, would
    crash) and Falcon always materialises it, so neither can say "causal only": where nothing else masks (no padding,
    no cached keys) the mask is a broadcast view of True (:func:`is_causal_mark`, no memory), which the attention reads
    as no mask (not while traced: a graph may copy the view). A 4D mask or a BlockMask passes (generate() makes one
    for a static cache). On flash too (MPT's forward would call ``.to(torch.bool)`` on flash's ``None``): the
    attention hands flash-attn the 2D padding mask read back from the boolean one.
    """
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.is_floating_point():
        # transformers' additive mask (eager's; generate() makes one for a static cache), which MPT would cast to
        # bool as "True where masked": as a boolean one, True where a query attends
        kwargs["attention_mask"] = attends(mask)
        return args, kwargs
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return args, kwargs  # made by transformers for the whole cache: 4D, or flex's BlockMask (a static cache)
    if args:  # positional input ids (the task models pass them so) bound by name, the names read once per class
        kwargs, args = bound_arguments(module, args, kwargs), ()
    tokens = kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    batch, length = tokens.shape[:2]
    past = int(cache.get_seq_length()) if cache is not None else 0
    # traced (torch.compile, export): the full mask, since a graph may materialise the view (and must not branch on
    # the mask's values)
    tracing = is_exporting()
    if not tracing and past == 0 and (mask is None or bool(mask.all())):
        kwargs["attention_mask"] = _CAUSAL_MARK.to(tokens.device).expand(batch, 1, length, length)
        return args, kwargs
    keys = torch.arange(past + length, device=tokens.device)
    allowed = keys[None, :] <= keys[past:, None]  # (q, kv): causal, the queries after the cached keys
    allowed = allowed[None, None].expand(batch, 1, length, past + length)
    if mask is not None:
        allowed = allowed & mask[:, None, None, -(past + length) :].to(torch.bool)
    kwargs["attention_mask"] = allowed
    return args, kwargs


_CAUSAL_MARK = torch.ones((), dtype=torch.bool)


def is_causal_mark(mask) -> bool:
    """Whether ``mask`` is :func:`boolean_causal_mask`'s broadcast True (every stride 0): "causal, nothing else"."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool and not any(mask.stride())
