"""GPT-2: drop ``wpe``, give every self-attention layer the causal bias.

Cross-attention layers (``add_cross_attention=True``) get no bias, as in T5.
"""

from __future__ import annotations

import transformers

from ..attention import AlibiBias
from ..config import AlibiSettings
from ..registry import ArchitectureSpec, register_architecture
from ..slopes import CAUSAL
from .common import NoPositionEmbedding


def convert(model: transformers.PreTrainedModel, settings: AlibiSettings) -> None:
    base = model.base_model  # GPT2Model
    base.wpe = NoPositionEmbedding()
    for block in base.h:
        block.attn.alibi = AlibiBias(CAUSAL, settings.heads)


SPEC = register_architecture(
    ArchitectureSpec(
        model_type="gpt2",
        convert=convert,
        removed_config_fields=("n_positions",),
        extra_classes=(transformers.GPT2DoubleHeadsModel,),
    )
)
