"""Train short: composer's ``train_sequence_length_scaling`` as a batch transform for the Trainer.

A batch of shape ``(batch, L)`` becomes ``(batch / s, L * s)`` before each training step: the same
tokens per step, in sequences ``s`` times as long (``s < 1``: shorter, the ALiBi recipe, e.g. 0.25).
Each row of the input is cut into consecutive pieces (``s < 1``) or consecutive rows are joined
(``s > 1``), so every token stays next to the tokens it followed. ``s = 1`` changes nothing.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8)}
    >>> scale_sequence_length(batch, 0.25)["input_ids"].shape
    torch.Size([8, 2])
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
from transformers import Trainer, default_data_collator


def scaled_shape(batch_size: int, length: int, scaling: float) -> tuple[int, int]:
    """``(batch / s, L * s)``, or a ``ValueError`` that says which values would work."""
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise ValueError(f"train_sequence_length_scaling must be a number > 0 (e.g. 0.25 or 1), got {scaling!r}.")
    s = Fraction(scaling).limit_denominator(1 << 16)
    if abs(float(s) - scaling) > 1e-9 * scaling:
        raise ValueError(f"train_sequence_length_scaling={scaling!r} is not a simple fraction; use e.g. 0.25 or 0.5.")
    new_length, new_batch = length * s, batch_size / s
    if new_length.denominator != 1 or new_batch.denominator != 1 or new_length < 1 or new_batch < 1:
        raise ValueError(
            f"train_sequence_length_scaling={scaling} cannot reshape a batch of shape ({batch_size}, {length}): "
            f"(batch / s, L * s) = ({float(new_batch):g}, {float(new_length):g}) must be whole numbers >= 1. "
            f"Choose a block_size that L * s divides into whole tokens, and a per-device batch size divisible by s."
        )
    return int(new_batch), int(new_length)


def scale_sequence_length(batch: dict[str, Any], scaling: float) -> dict[str, Any]:
    """Reshape every ``(batch, L)`` tensor of ``batch`` (input_ids, labels, attention_mask, ...) to
    ``(batch / s, L * s)``; see the module docstring. Other entries are left as they are."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2}
    if "input_ids" not in tensors:
        raise ValueError(f"train_sequence_length_scaling needs a 2-d 'input_ids' tensor; batch has {sorted(batch)}.")
    shape = tensors["input_ids"].shape
    mismatched = [k for k, v in tensors.items() if v.shape != shape]
    if mismatched:
        raise ValueError(f"train_sequence_length_scaling: {mismatched} do not have input_ids' shape {tuple(shape)}.")
    new_shape = scaled_shape(shape[0], shape[1], scaling)
    if new_shape == tuple(shape):
        return batch
    out = dict(batch)
    for key, value in tensors.items():
        # (B, L) -> (B*L,) in row order -> (B/s, L*s): consecutive tokens stay consecutive
        out[key] = value.reshape(new_shape)
    return out


class SequenceLengthScalingCollator:
    """Wraps a collator (default: transformers' ``default_data_collator``) and reshapes its batches."""

    def __init__(self, scaling: float, collator: Callable | None = None):
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
            raise ValueError(f"train_sequence_length_scaling must be a number > 0 (e.g. 0.25 or 1), got {scaling!r}.")
        self.scaling = scaling
        self.collator = collator or default_data_collator

    def __call__(self, features):
        return scale_sequence_length(self.collator(features), self.scaling)


class LengthScalingTrainer(Trainer):
    """A ``Trainer`` that applies ``train_sequence_length_scaling`` to its training batches only:
    evaluation batches keep the length they were made at. The reshape happens in the collator, before
    the Trainer counts the batch's predicted tokens, so loss normalisation sees the real count."""

    def __init__(self, *args, train_sequence_length_scaling: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_sequence_length_scaling = train_sequence_length_scaling
        SequenceLengthScalingCollator(train_sequence_length_scaling)  # validates s up front

    def get_train_dataloader(self):
        if self.train_sequence_length_scaling == 1:
            return super().get_train_dataloader()
        collator = self.data_collator
        self.data_collator = SequenceLengthScalingCollator(self.train_sequence_length_scaling, collator)
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator
