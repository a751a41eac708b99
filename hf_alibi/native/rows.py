"""A model type trained with ALiBi as plain data (no torch): the rows of ``patches/native.py``, read by
:func:`hf_alibi.native.patch_native`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
        return self.alibi_flag is None or bool(config_value(config, self.alibi_flag))


def config_value(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value
