"""The warm-start lever: the original position table, faded out over the first steps."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..convert.positions import position_table
from ..core.config import get_settings
from ..core.partitions import whole_weights


class PositionWarmStart:
    """The warm-start lever: the original learned position table (a frozen copy) added to the student's
    input embeddings with a weight that falls linearly from 1 to 0 over ``steps`` steps; removed after.

    Only for models with a learned absolute position table (GPT-2, BERT, RoBERTa, OPT); a ``ValueError`` else.
    Inputs are taken to start at position 0 (training blocks, no left padding).
    """

    def __init__(self, student: PreTrainedModel, teacher: PreTrainedModel, steps: int):
        table = position_table(teacher)
        if table is None:
            raise ValueError(
                f"warm_start_steps needs a learned position table; {teacher.config.model_type} has none "
                "(rotary or relative positions). Use warm_start_steps=0."
            )
        kept = get_settings(student.config).table_max_wavelength
        if kept is not None:
            raise ValueError(
                "warm_start_steps would add the position table a second time: the student keeps it "
                f"(table_max_wavelength={kept:g}). Use warm_start_steps=0, or convert with table_max_wavelength=0."
            )
        module, self.offset = table
        with whole_weights(module, "warm_start_steps"):  # a ZeRO-3 partition gathered (core/partitions.py)
            self.weight = module.weight.detach().clone()
        self.steps = int(steps)
        self.alpha = 1.0
        self.handle = student.get_input_embeddings().register_forward_hook(self._hook)

    def set_step(self, step: int) -> None:
        self.alpha = max(0.0, 1.0 - step / self.steps)

    def _hook(self, module, args, output):
        if self.alpha <= 0 or self.handle is None:
            return output
        length = output.shape[-2]
        table = self.weight[self.offset : self.offset + length].to(output.device, output.dtype)
        if table.shape[0] < length:  # past the original table: no position signal there
            table = torch.cat([table, table.new_zeros(length - table.shape[0], table.shape[1])])
        return output + self.alpha * table

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
