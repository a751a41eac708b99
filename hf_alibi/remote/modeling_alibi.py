"""ALiBi models for transformers, for loading with ``trust_remote_code=True`` without hf_alibi installed.

hf_alibi copies this file into every checkpoint it writes, next to a config.json whose ``auto_map``
points here. It imports only torch and transformers, registers nothing but
new names, and does what hf_alibi's conversion does, so that reading it is enough to trust it:

* ``Alibi<Class>`` subclasses transformers' own ``<Class>`` (``AlibiGPT2LMHeadModel`` of
  ``GPT2LMHeadModel``). Its ``__init__`` builds the original model, then removes its position path and
  gives every self-attention layer an :class:`AlibiBias` (see ``CONVERTERS``).
* ``Alibi<Config>`` subclasses the original config; it carries ``alibi`` (the settings) and reports
  ``_attn_implementation == "alibi_remote_<backend>"``, so attention runs through the functions
  registered below under those names. They add the layer's bias to transformers' mask (float mask,
  "eager" or "sdpa"); a layer without ``.alibi`` (cross-attention) gets no bias.

The bias: head ``h`` adds ``-m_h * d(i, j)`` to the score of query ``i`` and key ``j``, with the paper's
slopes ``m_h`` (Press, Smith and Lewis, "Train Short, Test Long", 2021). Only the "learned" encoder
variant has weights (``alibi.slopes_left`` / ``alibi.slopes_right``), loaded from the checkpoint.
"""

from __future__ import annotations

import copy
import math

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

# ---------------------------------------------------------------------------------------------- slopes, bias

CAUSAL, SYMMETRIC, NONSYMMETRIC, LEARNED = "causal", "symmetric", "nonsymmetric", "learned"


def get_slopes(n_heads: int) -> torch.Tensor:
    """The paper's slopes in head order (fairseq's ``get_slopes``), float32, shape ``(n_heads,)``."""

    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(kind, q_len, kv_len, slopes, slopes_right=None, masked_value=None):
    """float32 bias ``(1, H, q_len, kv_len)``; the queries are the last ``q_len`` of ``kv_len`` positions."""
    masked_value = torch.finfo(torch.float32).min if masked_value is None else masked_value
    query_pos = torch.arange(kv_len - q_len, kv_len, device=slopes.device, dtype=torch.float32)
    key_pos = torch.arange(kv_len, device=slopes.device, dtype=torch.float32)
    distance = query_pos[:, None] - key_pos[None, :]  # (q, kv): i - j
    slopes = slopes.float()[:, None, None]  # (H, 1, 1)
    if kind == LEARNED:  # slopes are already negative: -sigmoid(parameter)
        right = slopes_right.float()[:, None, None]
        return torch.where(distance >= 0, slopes * distance, right * -distance).unsqueeze(0)
    bias = -slopes * distance.abs()  # (H, q, kv)
    if kind == CAUSAL:
        bias = bias.masked_fill(distance < 0, masked_value)
    elif kind == NONSYMMETRIC:  # first half of the heads sees the left only, second half the right only
        sees_left = torch.arange(bias.shape[0], device=bias.device)[:, None, None] < bias.shape[0] // 2
        bias = bias.masked_fill(~torch.where(sees_left, distance >= 0, distance <= 0), masked_value)
    return bias.unsqueeze(0)


class AlibiBias(nn.Module):
    """One self-attention layer's ALiBi: its kind and head count, and the learned slopes if any."""

    def __init__(self, kind: str, num_heads: int):
        super().__init__()
        self.kind, self.num_heads = kind, num_heads
        if kind == LEARNED:
            self.slopes_left = nn.Parameter(torch.empty(num_heads).normal_(-2.0, 1.0))
            self.slopes_right = nn.Parameter(torch.empty(num_heads).normal_(-2.0, 1.0))

    def forward(self, q_len, kv_len, device, masked_value):
        if self.kind == LEARNED:
            left, right = -torch.sigmoid(self.slopes_left.float()), -torch.sigmoid(self.slopes_right.float())
            return alibi_bias(LEARNED, q_len, kv_len, left, right, masked_value)
        return alibi_bias(self.kind, q_len, kv_len, get_slopes(self.num_heads).to(device), None, masked_value)


class NoPositionEmbedding(nn.Module):
    """Stands where a learned position table was: adds a 0-dim zero, whatever the positions."""

    def forward(self, position_ids=None, *args, **kwargs):
        device = position_ids.device if isinstance(position_ids, torch.Tensor) else None
        return torch.zeros((), device=device)


# ---------------------------------------------------------------------------------------------- attention

PREFIX = "alibi_remote_"  # distinct from hf_alibi's "alibi_" names: loading this never replaces hf_alibi's


def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain attention with an additive mask, softmax in float32. Shapes ``(B, H, L, D)``."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def with_alibi(backend):
    def attention_forward(module, query, key, value, attention_mask, **kwargs):
        alibi = getattr(module, "alibi", None)
        if alibi is None:  # cross-attention: no position bias
            return backend(module, query, key, value, attention_mask, **kwargs)
        masked_value = torch.finfo(query.dtype).min
        mask = alibi(query.shape[2], key.shape[2], query.device, masked_value)  # (1, H, q, kv) float32
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            mask = torch.where(attention_mask, mask, masked_value)
        elif attention_mask is not None:  # clamped: a positive bias never revives a masked key
            mask = (mask + attention_mask.float()).clamp_min(masked_value)
        kwargs.pop("is_causal", None)  # causality is in the mask now
        kwargs.pop("position_bias", None)
        return backend(module, query, key, value, mask.to(query.dtype), is_causal=False, **kwargs)

    return attention_forward


BACKENDS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward}
for _name, _backend in BACKENDS.items():
    AttentionInterface.register(PREFIX + _name, with_alibi(_backend))
    AttentionMaskInterface.register(PREFIX + _name, AttentionMaskInterface._global_mapping[_name])


# ---------------------------------------------------------------------------------------------- conversion
# One function per architecture; each mirrors hf_alibi/patches/<model_type>.py.


def convert_gpt2(model, settings):
    base = model.base_model  # GPT2Model
    base.wpe = NoPositionEmbedding()
    for block in base.h:
        block.attn.alibi = AlibiBias(CAUSAL, settings["heads"])


class NoRotaryEmbedding(nn.Module):
    """Stands where GPT-NeoX's rotary embedding was: ``(cos, sin)`` of width 0, so nothing is rotated."""

    def forward(self, x, position_ids):
        empty = x.new_empty((*position_ids.shape, 0))  # (B, L, 0)
        return empty, empty


def convert_gpt_neox(model, settings):
    base = model.base_model  # GPTNeoXModel
    base.rotary_emb = NoRotaryEmbedding()
    for layer in base.layers:
        layer.attention.rotary_ndims = 0
        layer.attention.alibi = AlibiBias(CAUSAL, settings["heads"])


def _default_token_types(module, args, kwargs):
    # BERT's default token types are read from a buffer of max_position_embeddings: zeros of any length instead.
    if kwargs.get("token_type_ids") is None:
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        shape, device = (ids.shape, ids.device) if ids is not None else (embeds.shape[:-1], embeds.device)
        kwargs["token_type_ids"] = torch.zeros(shape, dtype=torch.long, device=device)
    return args, kwargs


def convert_bert(model, settings):
    base = model.base_model  # BertModel
    base.embeddings.position_embeddings = NoPositionEmbedding()
    base.embeddings.register_forward_pre_hook(_default_token_types, with_kwargs=True)
    for layer in base.encoder.layer:
        attention = layer.attention.self
        kind = CAUSAL if attention.is_causal else settings["encoder_variant"]  # BERT as a decoder: causal
        attention.alibi = AlibiBias(kind, settings["heads"])


T5_REMOVED = ("relative_attention_num_buckets", "relative_attention_max_distance")


def convert_t5(model, settings):
    base = model.base_model  # T5ForConditionalGeneration itself, or the T5Model / T5EncoderModel inside
    for stack in (getattr(base, "encoder", None), getattr(base, "decoder", None)):
        if stack is None:
            continue
        old = stack.config
        if old is not model.config:  # each stack holds a config copy: it gets an ALiBi copy of its own
            new = copy.deepcopy(old)
            new.__class__ = type(model.config)
            new.alibi = dict(model.config.alibi)
            for name in T5_REMOVED:
                setattr(new, name, None)
            for module in stack.modules():
                if getattr(module, "config", None) is old:
                    module.config = new
        kind = CAUSAL if stack.is_decoder else settings["encoder_variant"]
        for block in stack.block:
            attention = block.layer[0].SelfAttention  # cross-attention (layer[1]) gets no bias
            if attention.has_relative_attention_bias:
                del attention.relative_attention_bias
                attention.has_relative_attention_bias = False
            attention.alibi = AlibiBias(kind, settings["heads"])


# model_type -> (convert function, config fields sizing the removed position path)
CONVERTERS = {
    "bert": (convert_bert, ("max_position_embeddings",)),
    "gpt2": (convert_gpt2, ("n_positions",)),
    "gpt_neox": (convert_gpt_neox, ("max_position_embeddings",)),
    "roberta": (convert_bert, ("max_position_embeddings",)),  # BERT's layout
    "t5": (convert_t5, T5_REMOVED),
}
# What the removed fields hold while the original __init__ builds the table that is then dropped
# (default 1). RoBERTa's table has a padding row at pad_token_id, so it needs pad_token_id + 1 rows.
PLACEHOLDER_SIZES = {"roberta": lambda config: (config.pad_token_id or 0) + 1}


def _drop_position_ids(module, args, kwargs):
    # No position index any more: position ids would only reach transformers' packed-sequence detection.
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = None
    return args, kwargs


# ---------------------------------------------------------------------------------------------- classes


class AlibiConfigMixin:
    """``config.alibi`` holds the settings; attention always dispatches to ``alibi_remote_<backend>``."""

    alibi: dict | None = None
    removed_fields: tuple = ()

    def __post_init__(self, **kwargs):
        for name in self.removed_fields:  # config.json holds a marker string there: None in memory
            if isinstance(getattr(self, name, None), str):
                setattr(self, name, None)
        super().__post_init__(**kwargs)

    def to_dict(self):
        output = super().to_dict()
        for name in self.removed_fields:
            output[name] = REMOVED_FIELD_MARKER
        return output

    @property
    def _attn_implementation(self):
        backend = self._attn_implementation_internal  # may be set directly, with or without a prefix
        return backend if backend is None else PREFIX + backend.removeprefix(PREFIX).removeprefix("alibi_")

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        if isinstance(value, str):
            value = value.removeprefix(PREFIX).removeprefix("alibi_")
            if value not in BACKENDS:
                raise ValueError(
                    f"This ALiBi remote code runs attn_implementation 'eager' or 'sdpa', not {value!r}. "
                    "Load with attn_implementation='sdpa', or install hf_alibi for more backends."
                )
        PretrainedConfig._attn_implementation.fset(self, value)


REMOVED_FIELD_MARKER = (
    "removed by hf_alibi: this is an ALiBi checkpoint. `pip install hf_alibi` and `import hf_alibi` "
    "before loading it, or load it with trust_remote_code=True"
)
_CLASSES: dict[str, type] = {}


def _config_class(base_config_class: type) -> type:
    name = "Alibi" + base_config_class.__name__
    if name not in _CLASSES:
        model_type = base_config_class.model_type
        removed = CONVERTERS[model_type][1]
        namespace = {
            "model_type": "alibi_" + model_type,
            "__module__": __name__,
            "__qualname__": name,
            "__annotations__": {"alibi": dict | None, **{field: int | str | None for field in removed}},
            "alibi": None,
            "removed_fields": removed,
            **{field: None for field in removed},
        }
        cls = type(name, (AlibiConfigMixin, base_config_class), namespace)
        # The original class's strict validators demand an int in the removed fields: not here.
        cls.__validators__ = {k: v for k, v in cls.__validators__.items() if k not in removed}
        _CLASSES[name] = cls
    return _CLASSES[name]


def _model_class(base_class: type) -> type:
    name = "Alibi" + base_class.__name__
    if name not in _CLASSES:
        model_type = base_class.config_class.model_type
        convert, removed = CONVERTERS[model_type]

        def __init__(self, config, *args, **kwargs):
            saved = {field: getattr(config, field) for field in removed}
            size = PLACEHOLDER_SIZES.get(model_type, lambda config: 1)(config)
            for field in removed:  # the original __init__ still sizes the table that is then dropped
                setattr(config, field, size)
            try:
                base_class.__init__(self, config, *args, **kwargs)
            finally:
                for field, value in saved.items():
                    setattr(config, field, value)
            convert(self, config.alibi)
            self.base_model.register_forward_pre_hook(_drop_position_ids, with_kwargs=True)

        namespace = {"__init__": __init__, "config_class": _config_class(base_class.config_class)}
        namespace.update({"__module__": __name__, "__qualname__": name})
        _CLASSES[name] = type(name, (base_class,), namespace)
    return _CLASSES[name]


def __getattr__(name: str) -> type:
    """``AlibiGPT2LMHeadModel``, ``AlibiGPT2Config``, ...: made on first use from transformers' class."""
    base = getattr(transformers, name.removeprefix("Alibi"), None) if name.startswith("Alibi") else None
    model_type = getattr(base, "model_type", None) or getattr(getattr(base, "config_class", None), "model_type", None)
    if base is None or model_type not in CONVERTERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if issubclass(base, PretrainedConfig):
        return _config_class(base)
    return _model_class(base)
