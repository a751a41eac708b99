"""Pieces shared by the per-architecture patches."""

from __future__ import annotations

import torch
from torch import nn


class NoPositionEmbedding(nn.Module):
    """Stands where a learned absolute position table was: adds nothing, whatever the positions.

    It has no weights and no size, so inputs of any length run, and it returns a 0-dim zero so
    that ``embeds + self.wpe(position_ids)`` keeps the embeddings' dtype and shape.
    """

    def forward(self, position_ids: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
        device = position_ids.device if isinstance(position_ids, torch.Tensor) else None
        return torch.zeros((), device=device)
