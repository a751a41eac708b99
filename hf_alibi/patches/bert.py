"""BERT (and RoBERTa, which shares its layout): drop the absolute position table.

Every self-attention layer gets the bidirectional bias of the model's ``encoder_variant``
(``-m|i-j|`` by default); a BERT built as a decoder (``is_decoder=True``, ``BertLMHeadModel``) has
causal self-attention and gets the causal bias. Cross-attention layers get no bias, as in T5.

The embeddings module keeps its ``position_ids`` / ``token_type_ids`` buffers (non-persistent, and
``_init_weights`` fills them), but nothing reads them any more: the position table is gone and the
default token types are made per input by a pre-hook, so inputs longer than
``max_position_embeddings`` run with and without ``token_type_ids``.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from ..attention import AlibiBias
from ..config import AlibiSettings
from ..registry import ArchitectureSpec, register_architecture
from ..slopes import CAUSAL
from .common import NoPositionEmbedding


def _default_token_types(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # The original default gathers from a buffer of length max_position_embeddings; all zeros, of
    # the input's shape, is the same value without the length limit.
    if kwargs.get("token_type_ids") is None:
        input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        shape, device = (
            (input_ids.shape, input_ids.device) if input_ids is not None else (embeds.shape[:-1], embeds.device)
        )
        kwargs["token_type_ids"] = torch.zeros(shape, dtype=torch.long, device=device)
    return args, kwargs


def convert(model: transformers.PreTrainedModel, settings: AlibiSettings) -> None:
    base = model.base_model  # BertModel / RobertaModel
    base.embeddings.position_embeddings = NoPositionEmbedding()
    base.embeddings.register_forward_pre_hook(_default_token_types, with_kwargs=True)
    for layer in base.encoder.layer:
        attention = layer.attention.self
        kind = CAUSAL if attention.is_causal else settings.encoder_variant
        attention.alibi = AlibiBias(kind, settings.heads)


SPEC = register_architecture(
    ArchitectureSpec(
        model_type="bert",
        convert=convert,
        bidirectional=True,
        causal=False,
        removed_config_fields=("max_position_embeddings",),
    )
)

# RoBERTa has BERT's layout (embeddings.position_embeddings, encoder.layer[i].attention.self); its
# position ids come from the input ids, and are ignored the same way.
ROBERTA_SPEC = register_architecture(
    ArchitectureSpec(
        model_type="roberta",
        convert=convert,
        bidirectional=True,
        causal=False,
        removed_config_fields=("max_position_embeddings",),
        # its position table has a padding row (padding_idx=pad_token_id), so it needs that many rows
        placeholder_size=lambda config: (config.pad_token_id or 0) + 1,
    )
)
