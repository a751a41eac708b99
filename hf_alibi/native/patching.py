"""The check and the patch of a model trained with ALiBi (:func:`check_native`, :func:`patch_native`)."""

from __future__ import annotations

import copy

from torch import nn
from transformers import PreTrainedModel

from ..core.bias import AlibiBias
from ..core.compat import attn_implementation, store_attn_implementation
from ..core.config import rebind_config
from ..core.forward import ForwardSetup, SharedByLayers, hook_base
from ..core.partitions import whole_shape
from ..core.slopes import CAUSAL, KeyRounding
from ..core.strategies import find_modules
from .attention import NativeAlibiAttention, boolean_causal_mask, native_slopes
from .model import (
    _attention_class,
    _model_class,
    _record_base_attentions,
)
from .rows import NativeArchitecture, config_value


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
        if config_value(config, field) not in (value, None if field == row.kv_heads else value):
            raise ValueError(
                f"hf_alibi runs {row.model_type} with ALiBi as falcon-rw has it ({field}={value!r}); this model has "
                f"{field}={config_value(config, field)!r}, a layout it does not match. Use transformers' attention."
            )
    for _, _, attention in find_modules(model.base_model, row.attention):
        width = whole_shape(getattr(attention, row.qkv).weight)[0]  # a ZeRO-3 partition's too
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
    if attn_implementation(config) in (None, "eager") and not config.output_attentions:
        store_attn_implementation(config, "sdpa")
    return model
