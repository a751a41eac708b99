"""What kind of model a teacher is, and where its learned position table is."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from .. import checkpoints
from ..core.config import get_settings
from ..patch import is_alibi_model
from ..registry import get_architecture

CAUSAL, ENCODER, SEQ2SEQ = "causal", "encoder", "seq2seq"
KINDS = (CAUSAL, ENCODER, SEQ2SEQ)
HIDDEN_LAYERS = ("last", "all")
POSITION_TABLES = ("wpe", "position_embeddings")


def model_kind(model: PreTrainedModel) -> str:
    """``"causal"`` (decoder-only, or BERT with ``is_decoder``), ``"encoder"`` or ``"seq2seq"``.

    >>> model_kind(GPT2LMHeadModel(GPT2Config()))
    'causal'
    """
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return SEQ2SEQ
    base_type = get_settings(config).base_model_type if is_alibi_model(model) else config.model_type
    if get_architecture(base_type).bidirectional and not getattr(config, "is_decoder", False):
        return ENCODER
    return CAUSAL


def position_table(model: nn.Module) -> tuple[nn.Embedding, int] | None:
    """The learned absolute position table of ``model`` and the index of position 0 in it, or None."""
    base = getattr(model, "base_model", model)
    for name, module in base.named_modules():
        if name.split(".")[-1] in POSITION_TABLES and isinstance(module, nn.Embedding):
            length = checkpoints.original_length(model.config)  # RoBERTa counts from padding_idx + 1
            return module, module.num_embeddings - length if length else 0
    return None


def original_length(model: PreTrainedModel) -> int | None:
    """The longest input the original model was built for (:func:`hf_alibi.checkpoints.original_length`
    of its config: GPT-2 ``n_positions``, ``max_position_embeddings``, RoBERTa's less its offset), else
    None (T5: pass ``length``).

    >>> original_length(GPT2LMHeadModel(GPT2Config(n_positions=128)))
    128
    """
    return checkpoints.original_length(model.config)
