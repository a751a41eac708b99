"""What kind of model a teacher is (its position table and length: :mod:`hf_alibi.convert.positions`)."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..convert.registry import get_architecture
from ..core.config import get_settings
from ..core.names import is_alibi
from .settings import HIDDEN_LAYERS  # noqa: F401  (re-exported: declared beside the hidden_layers setting)

CAUSAL_MODEL, ENCODER_MODEL, SEQ2SEQ_MODEL = "causal", "encoder", "seq2seq"
MODEL_KINDS = (CAUSAL_MODEL, ENCODER_MODEL, SEQ2SEQ_MODEL)


def model_kind(model: PreTrainedModel) -> str:
    """``"causal"`` (decoder-only, or BERT with ``is_decoder``), ``"encoder"`` or ``"seq2seq"``.

    >>> model_kind(GPT2LMHeadModel(GPT2Config()))
    'causal'
    """
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return SEQ2SEQ_MODEL
    base_type = get_settings(config).base_model_type if is_alibi(model) else config.model_type
    if get_architecture(base_type).bidirectional and not getattr(config, "is_decoder", False):
        return ENCODER_MODEL
    return CAUSAL_MODEL
