"""The Trainer that distils a frozen teacher into the student."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer

from .kinds import CAUSAL_MODEL, HIDDEN_LAYERS, SEQ2SEQ_MODEL, model_kind
from .losses import distillation_loss
from .warm_start import PositionWarmStart


def loss_is_per_batch_mean(trainer) -> None:
    """Tell a ``Trainer`` whose ``compute_loss`` returns a per-batch mean (not a sum over the
    ``num_items_in_batch`` of the accumulated batches) to divide it by the gradient accumulation steps.

    ``Trainer.training_step`` divides when ``loss_is_scaled_for_ga`` (a class attribute of later 5.x
    releases; ``None`` = decide) is False, else, like the releases before it, when not
    ``model_accepts_loss_kwargs and num_items_in_batch is not None`` and there is no ``compute_loss_func``.
    Setting both makes every 5.x divide; ``model_accepts_loss_kwargs`` False also stops the Trainer from
    counting the batch's items for a loss that does not use them. Checked on transformers 5.19.0, 5.23.0, 5.24.0."""
    trainer.model_accepts_loss_kwargs = False
    if hasattr(type(trainer), "loss_is_scaled_for_ga"):
        trainer.loss_is_scaled_for_ga = False


class DistillationTrainer(Trainer):
    """A ``Trainer`` whose loss is the student's distance to a frozen teacher (:func:`distillation_loss`),
    optionally mixed with the student's own LM / MLM loss (``lm_weight``; needs ``labels`` in the batch).

    The teacher is kept in eval mode, without gradients (``requires_grad_(False)``, forward under
    ``torch.no_grad``), on the student's device and in its dtype. Its weights never change.

    Example:
        >>> teacher = GPT2LMHeadModel(config); student = hf_alibi.patch_model(copy.deepcopy(teacher))
        >>> trainer = DistillationTrainer(model=student, teacher=teacher, args=args, train_dataset=blocks)
        >>> trainer.train()
    """

    def __init__(
        self,
        *args,
        teacher: PreTrainedModel,
        kind: str | None = None,
        lm_weight: float = 0.0,
        temperature: float = 1.0,
        hidden_layers: str = "last",
        warm_start_steps: int = 0,
        attention_only_steps: int = 0,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not 0.0 <= lm_weight <= 1.0:
            raise ValueError(f"lm_weight must be between 0 and 1 (the share of the LM loss), got {lm_weight}.")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if hidden_layers not in HIDDEN_LAYERS:
            raise ValueError(f"hidden_layers must be one of {HIDDEN_LAYERS}, got {hidden_layers!r}.")
        student = self.accelerator.unwrap_model(self.model)
        self.kind = kind or model_kind(teacher)
        self.lm_weight = float(lm_weight)
        self.temperature = float(temperature)
        self.hidden_layers = hidden_layers
        loss_is_per_batch_mean(self)  # so the Trainer divides it by the accumulation steps
        parameter = next(student.parameters())
        self.teacher = teacher.to(device=parameter.device, dtype=parameter.dtype).eval().requires_grad_(False)
        self.attention_only_steps = int(attention_only_steps)
        self.warm_start = PositionWarmStart(student, teacher, warm_start_steps) if warm_start_steps > 0 else None
        self._frozen: list[nn.Parameter] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if self.kind == SEQ2SEQ_MODEL and "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = _shift_right(self.teacher, inputs["input_ids"])
        hidden = self.kind != CAUSAL_MODEL or getattr(self.teacher, "get_output_embeddings", lambda: None)() is None
        self.teacher.eval()
        with torch.no_grad():
            teacher_outputs = self.teacher(**inputs, output_hidden_states=hidden)
        student_outputs = model(**inputs, labels=labels, output_hidden_states=hidden)
        loss = distillation_loss(
            student_outputs,
            teacher_outputs,
            self.kind,
            inputs.get("attention_mask"),
            self.temperature,
            self.hidden_layers,
        )
        if self.lm_weight > 0:
            if labels is None or getattr(student_outputs, "loss", None) is None:
                raise ValueError("lm_weight > 0 needs labels in the batch (the LM / MLM targets).")
            loss = (1 - self.lm_weight) * loss + self.lm_weight * student_outputs.loss
        return (loss, student_outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step
        if self.warm_start is not None:
            self.warm_start.set_step(step)
        if self.attention_only_steps:
            self._set_attention_only(model, step < self.attention_only_steps)
        return super().training_step(model, inputs, num_items_in_batch)

    def _set_attention_only(self, model, on: bool) -> None:
        if on and not self._frozen:
            for name, parameter in self.accelerator.unwrap_model(model).named_parameters():
                lowered = name.lower()
                if parameter.requires_grad and not any(k in lowered for k in ("attn", "attention", "alibi")):
                    parameter.requires_grad_(False)
                    self._frozen.append(parameter)
        elif not on and self._frozen:
            for parameter in self._frozen:
                parameter.requires_grad_(True)
            self._frozen = []

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.warm_start is not None:
                self.warm_start.remove()
            self._set_attention_only(self.model, False)


def _shift_right(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    start = model.config.decoder_start_token_id
    start = model.config.pad_token_id if start is None else start
    shifted = ids.new_full(ids.shape, start)
    shifted[:, 1:] = ids[:, :-1]
    return shifted
