"""T5: drop the learned relative attention bias; ALiBi in self-attention, nothing in cross-attention.

T5 computes ``relative_attention_bias`` in the first block of each stack and hands the result
(``position_bias``) on to the later blocks. Without that table, T5's own code makes the bias a
tensor of zeros, and hf_alibi's attention drops ``position_bias`` in self-attention layers, so the
ALiBi bias is the only position signal: the encoder's self-attention gets the ``encoder_variant``
bias, the decoder's the causal one, cross-attention none (its ``position_bias`` is T5's zeros).
T5's ``scaling=1.0`` (no ``1/sqrt(d)``) passes through unchanged.

T5's encoder and decoder stacks hold copies of the model's config; each gets an ALiBi copy of its
own here, since transformers reads the attention implementation from the stack's config.
"""

from __future__ import annotations

import transformers
from torch import nn

from ..attention import AlibiBias
from ..config import AlibiSettings, alibi_config_copy, rebind_config
from ..registry import ArchitectureSpec, register_architecture
from ..slopes import CAUSAL

REMOVED_FIELDS = ("relative_attention_num_buckets", "relative_attention_max_distance")


def _give_alibi_config(stack: nn.Module, model_config) -> None:
    old = stack.config
    if old is model_config:  # T5EncoderModel shares the model's config
        return
    rebind_config(stack, old, alibi_config_copy(old, "t5", REMOVED_FIELDS, model_config.alibi))


def convert(model: transformers.PreTrainedModel, settings: AlibiSettings) -> None:
    base = model.base_model  # T5ForConditionalGeneration itself, or the T5Model / T5EncoderModel inside
    stacks = [stack for stack in (getattr(base, "encoder", None), getattr(base, "decoder", None)) if stack is not None]
    for stack in stacks:
        _give_alibi_config(stack, model.config)
        kind = CAUSAL if stack.is_decoder else settings.encoder_variant
        for block in stack.block:
            attention = block.layer[0].SelfAttention
            if attention.has_relative_attention_bias:
                del attention.relative_attention_bias
                attention.has_relative_attention_bias = False
            attention.alibi = AlibiBias(kind, settings.heads)


SPEC = register_architecture(
    ArchitectureSpec(
        model_type="t5",
        convert=convert,
        bidirectional=True,
        causal=True,
        removed_config_fields=REMOVED_FIELDS,
    )
)
