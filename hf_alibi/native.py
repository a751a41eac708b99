"""Models trained with ALiBi (BLOOM, MPT, Falcon-RW), run on hf_alibi's attention paths.

transformers runs these three on their own attention code: eager only, a ``(B*H, q, kv)`` score tensor per layer,
MPT's bias built at ``max_seq_len`` (longer inputs crash). Nothing of them is converted here: every weight, the
config and its ``model_type`` stay as they are (``save_pretrained`` writes the original format). Only each
self-attention module changes, on this instance: its class becomes a subclass whose forward splits the fused QKV in
the model's layout, updates the cache and calls transformers' attention interface (``alibi_<backend>``), with an
:class:`~hf_alibi.core.bias.AlibiBias` carrying the model's own slopes. What differs between the three is data, a
:class:`NativeArchitecture` row (``hf_alibi.patches.native``): where the fused QKV is and how it is laid out, which
slopes, and whether the bias is added before the scaling (Falcon), which scales the slopes.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .core.batching import LAYER_ARGUMENTS, make_manager
from .core.bias import AlibiBias
from .core.compat import CACHE_ARGUMENTS, block_mask_free_generate_masks, cache_argument, is_exporting
from .core.config import rebind_config
from .core.forward import (
    KEYWORD,
    CheckpointsInForward,
    ForwardSetup,
    SharedByLayers,
    bound_arguments,
    call_forward,
    forward_of,
    hook_base,
)
from .core.kernels import PADDING, kernel, kernel_refusal
from .core.mask import attends
from .core.names import RUNNING_BACKENDS, alibi_name, check_backend
from .core.slopes import CAUSAL, KeyRounding, get_slopes_list, mpt_slopes_list
from .core.strategies import find_modules

NATIVE = "native"  # the strategy name of these rows: nothing is converted
PER_HEAD, BLOCKS = "per_head", "blocks"  # fused QKV as (H, 3, d) per token (BLOOM, Falcon) or (3, H, d) (MPT)
PAPER, MPT = "paper", "mpt"  # slope formulas: the paper's (any head count), MPT's (bias max, its own order)


@dataclass(frozen=True)
class NativeArchitecture:
    """A model type trained with ALiBi, as plain data read by :func:`patch_native`.

    Paths start at the base model; attribute names are those of the model's self-attention module.

    >>> NativeArchitecture("bloom", "h.*.self_attention", "query_key_value", "dense").layout
    'per_head'
    """

    model_type: str
    attention: str  # the self-attention modules ("*": every layer)
    qkv: str  # the fused q, k, v projection
    output: str  # the output projection
    layout: str = PER_HEAD
    slopes: str = PAPER
    bias_max: str | None = None  # MPT: the config field of its bias max (the slopes' exponent)
    scaling: str = "inv_norm_factor"  # the module's scale of q.k
    dropout: str = "attention_dropout"  # the module's attention dropout (an nn.Dropout or its probability)
    cache: str = "layer_past"  # the forward's cache argument (one of compat.CACHE_ARGUMENTS: the release's name)
    clip: str | None = None  # MPT: the module's clip_qkv (clamps the fused QKV when set)
    residual: bool = False  # BLOOM: the module adds its output, dropped out by hidden_dropout, to ``residual``
    bias_before_scaling: bool = False  # Falcon: (q.k + bias) * scale, so the slopes are scaled too
    slope_dtype: str | None = None  # Falcon: the torch dtype its code rounds the slopes to ("bfloat16")
    key_rounding: str | None = None  # Falcon: the dtype its code rounds each key's bias to ("bfloat16"; KeyRounding)
    alibi_flag: str | None = None  # the config field that says the model uses ALiBi (None: always)
    requires: tuple[tuple[str, Any], ...] = ()  # config fields whose other values this row cannot match
    kv_heads: str | None = None  # Falcon: a config field that must be None or the head count (no grouped K/V)
    # Falcon builds a (B, H, q, kv) float mask from its own bias when this base-model attribute is true: turned off
    base_bias_switch: str | None = None
    # The base model is handed hf_alibi's 4D boolean mask (:func:`boolean_causal_mask`): MPT casts transformers' mask
    # to bool (sdpa's None crashes there), Falcon always materialises it (the fold then cannot use its fastest form)
    boolean_mask: bool = False
    strategy: str = NATIVE

    def uses_alibi(self, config) -> bool:
        """Whether a model of ``config`` (a config or its dict) was trained with ALiBi (``alibi_flag``)."""
        return self.alibi_flag is None or bool(_config_value(config, self.alibi_flag))


def _config_value(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


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
        slopes = mpt_slopes_list(heads, float(_config_value(config, row.bias_max)))
    else:
        slopes = get_slopes_list(heads)
    if row.slope_dtype is not None:  # Falcon rounds its slopes to bf16 (exact for 8 or fewer heads, not for 32)
        # on the CPU whatever the default device: under `with torch.device("meta")` a tensor holds no values to read
        slopes = torch.tensor(slopes, device="cpu").to(getattr(torch, row.slope_dtype)).double().tolist()
    return [s * scaling for s in slopes] if row.bias_before_scaling else slopes


def check_native(model: PreTrainedModel, row: NativeArchitecture) -> None:
    """One-line ``ValueError`` where ``model`` is not a model the row can run exactly (nothing changed)."""
    config = model.config
    if is_native(model):
        raise ValueError(
            f"This {row.model_type} model already runs on hf_alibi's attention (patch_model was called on it); "
            "patch_model changes a model once."
        )
    if not row.uses_alibi(config):
        raise ValueError(
            f"This {row.model_type} model has {row.alibi_flag}=False: it was not trained with ALiBi, and hf_alibi "
            f"runs only the ALiBi variant of {row.model_type}. Run it with transformers' own attention."
        )
    heads = config.num_attention_heads
    wanted = [*row.requires, *([(row.kv_heads, heads)] if row.kv_heads else [])]
    for field, value in wanted:
        if _config_value(config, field) not in (value, None if field == row.kv_heads else value):
            raise ValueError(
                f"hf_alibi runs {row.model_type} with ALiBi as falcon-rw has it ({field}={value!r}); this model has "
                f"{field}={_config_value(config, field)!r}, a layout it does not match. Use transformers' attention."
            )
    for _, _, attention in find_modules(model.base_model, row.attention):
        width = getattr(attention, row.qkv).weight.shape[0]
        if width != 3 * heads * attention.head_dim:
            raise ValueError(
                f"{type(attention).__name__} projects q, k, v to {width} features, not 3 x {heads} heads x "
                f"{attention.head_dim}: hf_alibi's {row.model_type} row does not fit this model."
            )


def is_native(model: nn.Module) -> bool:
    """True when ``model`` (a model trained with ALiBi) runs on hf_alibi's attention (:func:`patch_native`)."""
    return any(isinstance(module, NativeAlibiAttention) for module in model.modules())


def patch_native(model: PreTrainedModel, row: NativeArchitecture) -> PreTrainedModel:
    """Run ``model``, a model trained with ALiBi, on hf_alibi's attention paths, in place (checked first by
    :func:`check_native`; ``hf_alibi.patch_model`` calls this for the native rows).

    Every weight and the config's type stay; the model switches from transformers' eager attention to ``sdpa``
    (hf_alibi's fold: no L x L tensor), unless it is set to return attention weights; a call that asks for them
    (``output_attentions=True``) runs on eager with the bias, as transformers' own code of these models. The model
    gets its own copy of its config (as a converted model does): the caller's config object is not changed, so a
    model built from it afterwards is transformers' own.

    >>> model = hf_alibi.patch_model(BloomForCausalLM(BloomConfig(n_layer=2, n_head=4)))  # doctest: +SKIP
    """
    check_native(model, row)
    config = copy.deepcopy(model.config)  # the backend is set below: on the model's own copy, not the caller's
    rebind_config(model, model.config, config)
    base = model.base_model
    attentions = [attention for _, _, attention in find_modules(base, row.attention)]
    shared = SharedByLayers()
    for attention in attentions:
        scaling = float(getattr(attention, row.scaling))
        slopes = native_slopes(row, model.config, scaling)
        rounding = None
        if row.key_rounding is not None:  # the bias per key as the model's code rounds it, before its scaling
            rounding = KeyRounding(row.key_rounding, scaling if row.bias_before_scaling else 1.0)
        heads = model.config.num_attention_heads
        attention.alibi = AlibiBias(CAUSAL, heads, shared=shared, slopes=slopes, rounding=rounding)
        if getattr(attention, "config", None) is None:  # where the backend is read (Falcon's modules hold it)
            attention.config = model.config
        attention.__class__ = _attention_class(type(attention), row)
    if row.base_bias_switch is not None:
        setattr(base, row.base_bias_switch, False)  # the bias is the attention's now
    model.__class__ = _model_class(type(model), row)
    rows = row.key_rounding is not None  # a bias rounded per key counts positions from each row's start
    model._alibi_setup = setup = ForwardSetup(shared, reads_positions=False, sinks=0, records_rows=rows)
    if row.boolean_mask:
        base.register_forward_pre_hook(boolean_causal_mask, with_kwargs=True)
    if base is not model:  # a direct call of the base; first: the rows are read from the 2D padding mask
        hook_base(base, setup, first=True)
        base.register_forward_pre_hook(_record_base_attentions, with_kwargs=True)  # after hook_base made the forward
    if config._attn_implementation in (None, "eager") and not config.output_attentions:
        config._attn_implementation_internal = "sdpa"
    return model


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
        backend = self.config._attn_implementation
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


def _attention_class(original: type, row: NativeArchitecture) -> type:
    cls = _ATTENTION_CLASSES.get((original, row))
    if cls is None:
        parameters = list(inspect.signature(original.forward).parameters.values())[2:]  # after self, hidden_states
        names = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        name = "Alibi" + original.__name__
        cls = _ATTENTION_CLASSES[(original, row)] = type(
            name,
            (NativeAlibiAttention, original),
            {
                "_native_row": row, "_native_arguments": names, "_native_original": original,
                "__reduce_ex__": _reduce_native, "__module__": __name__, "__qualname__": name,
            },
        )  # fmt: skip
    return cls


def _reduce_native(self, protocol):
    # pickle (torch.save of the whole model, deepcopy) finds the classes made here by what made them: the original
    # class and the row, both importable
    state = super(type(self), self).__reduce_ex__(protocol)[2]
    kind = "model" if isinstance(self, PreTrainedModel) else "attention"
    return _native_instance, (kind, type(self)._native_original, type(self)._native_row), state


def _native_instance(kind: str, original: type, row: NativeArchitecture):
    """An empty instance of the class :func:`_model_class` or :func:`_attention_class` makes for ``original`` and
    ``row`` (unpickling fills it)."""
    cls = (_model_class if kind == "model" else _attention_class)(original, row)
    return cls.__new__(cls)


def _model_class(original: type, row: NativeArchitecture) -> type:
    # The model's own name, so that save_pretrained writes the original ``architectures``; transformers' flags let
    # set_attn_implementation reach every backend hf_alibi has a path for (the module's source reads as eager only).
    cls = _MODEL_CLASSES.get((original, row))
    if cls is not None:
        return cls

    @functools.wraps(original.forward)  # the original's signature (transformers and the Trainer inspect it)
    def forward(self, *args, **kwargs):
        # in the class, not a hook: PEFT's AdaLoRA calls model.forward past any hook. Position ids that restart
        # (a packed row) are recorded for this forward, so every path keeps the documents apart
        def prepare(forward, args, kwargs):
            if forward is not None and forward.paged is not None:
                kwargs = without_paged_cache(kwargs)
            if forward is not None:
                record_attentions(self, forward, args, kwargs)
            if row.boolean_mask and self.base_model is self:  # else the base's pre-hook does it
                args, kwargs = boolean_causal_mask(self, args, kwargs)
            return args, kwargs

        # the blocks drop keyword arguments: the attention reads the running forward (core/forward.py)
        return call_forward(self._alibi_setup, self, super(cls, self).forward, args, kwargs, prepare)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        for name in attn_implementation.values() if isinstance(attn_implementation, dict) else [attn_implementation]:
            if isinstance(name, str):
                check_backend(name, what_runs(self))
                # before the model is switched: what the kernel would refuse (the kernel table's row)
                reason = kernel_refusal(name, next(m for m in self.modules() if isinstance(m, AlibiBias)))
                if reason is not None:
                    raise ValueError(reason)
        return super(cls, self).set_attn_implementation(attn_implementation, *args, **kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        # generate_batch, its context manager and transformers serve's continuous batching start here: the manager
        # that keeps the backend (sdpa or eager) and runs the bias through the paged cache (batching.py)
        return make_manager(self, generation_config, continuous_batching_config, workload_hints)

    # generate() with a static cache on flex, where the release cannot take flex's mask made in advance
    masks_for_generate = block_mask_free_generate_masks()
    extra = {} if masks_for_generate is None else {"create_masks_for_generate": masks_for_generate}
    cls = _MODEL_CLASSES[(original, row)] = type(
        original.__name__,
        (CheckpointsInForward, original),
        {
            **extra,
            "forward": forward,
            "set_attn_implementation": set_attn_implementation,
            "init_continuous_batching": init_continuous_batching,
            "_supports_sdpa": True,
            "_supports_flex_attn": True,
            "_supports_flash_attn": row.key_rounding is None,
            "_can_set_attn_implementation_cached_value": True,
            # engines that run transformers models through their own attention function would drop the bias
            "_supports_attention_backend": False,
            "_native_original": original,
            "_native_row": row,
            "__reduce_ex__": _reduce_native,
            "__module__": __name__,
            "__qualname__": original.__name__,
        },
    )
    return cls


def record_attentions(model: nn.Module, forward, args: tuple, kwargs: dict) -> None:
    """Whether the call of ``model`` (the model or its base) asks for attention weights (its ``output_attentions``,
    else its config's), recorded on its :class:`~hf_alibi.core.forward.AlibiForward`: MPT's blocks do not tell their
    attention, which reads it there."""
    wanted = bound_arguments(model, args, kwargs).get("output_attentions")
    forward.attentions = bool(model.config.output_attentions if wanted is None else wanted)


def _record_base_attentions(base: nn.Module, args: tuple, kwargs: dict) -> None:
    # a base model called directly (past its task head): its pre-hook put the forward in its keyword arguments
    if (forward := kwargs.get(KEYWORD)) is not None:
        record_attentions(base, forward, args, kwargs)


# transformers' flag on a model class for each backend with an ALiBi path (eager: every model)
_SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
}


def what_runs(model: PreTrainedModel) -> str:
    """What a patched native ``model`` runs with, from the flags its class sets (Falcon's rounded bias: no flash), as
    the end of :func:`~hf_alibi.core.names.check_backend`'s refusal."""
    backends = [
        name for name in RUNNING_BACKENDS if name not in _SUPPORT_FLAGS or getattr(model, _SUPPORT_FLAGS[name])
    ]
    return (
        f"this {model._native_row.model_type} model (trained with ALiBi, run on hf_alibi's attention by patch_model) "
        f"runs with attn_implementation {', '.join(repr(name) for name in backends)}"
    )


def without_paged_cache(kwargs: dict) -> dict:
    """A continuous-batching forward's arguments as transformers' own forward of a native row can take them: no
    cache (it would ask the paged cache for a length it has not), no per-layer mask (the attention makes its own) and
    none of the layers' arguments (their :class:`~hf_alibi.core.batching.PagedBatch`, recorded for this forward,
    holds them). Each self-attention writes its keys and values to the paged cache itself."""
    dropped = {"cache", "past_key_values", "attention_mask", "is_causal", *LAYER_ARGUMENTS}
    return {**{k: v for k, v in kwargs.items() if k not in dropped}, "use_cache": False}


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
