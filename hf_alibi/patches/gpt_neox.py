"""GPT-NeoX: drop the rotary embedding from every layer, give self-attention the causal bias.

The narrowest point is ``GPTNeoXModel.rotary_emb``: it makes the ``(cos, sin)`` pair that every
layer's ``apply_rotary_pos_emb`` applies to the first ``cos.shape[-1]`` dimensions of q and k.
:class:`NoRotaryEmbedding` returns a pair with zero dimensions, so no dimension is rotated, for
any ``rotary_pct`` / ``partial_rotary_factor``, with parallel or sequential residuals alike.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from ..attention import AlibiBias
from ..config import AlibiSettings
from ..registry import ArchitectureSpec, register_architecture
from ..slopes import CAUSAL


class NoRotaryEmbedding(nn.Module):
    """Stands where a rotary embedding was: ``(cos, sin)`` of width 0, so nothing is rotated.

    It has no buffers sized by ``max_position_embeddings``, so inputs of any length run.
    """

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        empty = x.new_empty((*position_ids.shape, 0))  # (B, L, 0)
        return empty, empty


def convert(model: transformers.PreTrainedModel, settings: AlibiSettings) -> None:
    base = model.base_model  # GPTNeoXModel
    base.rotary_emb = NoRotaryEmbedding()
    for layer in base.layers:
        layer.attention.rotary_ndims = 0  # informative only: the width comes from rotary_emb's output
        layer.attention.alibi = AlibiBias(CAUSAL, settings.heads)


SPEC = register_architecture(
    ArchitectureSpec(
        model_type="gpt_neox",
        convert=convert,
        # The rotary fields (rope_parameters) stay: they are needed to build the original
        # layers, and they size nothing. max_position_embeddings is the one length limit.
        removed_config_fields=("max_position_embeddings",),
    )
)
