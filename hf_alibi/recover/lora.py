"""Parameter-efficient recovery: LoRA adapters on the student's projections, merged at the end."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

# Kept trainable besides the adapters: the learned encoder slopes (encoder_variant="learned") are ALiBi's own.
TRAINABLE_NAMES = ("alibi",)


def add_lora(student: PreTrainedModel, rank: int, alpha: float | None = None):
    """The student wrapped with LoRA adapters of rank ``rank`` on the linear projections of its numbered
    blocks (attention and MLP; heads and embeddings left out); only the adapters (and learned slopes) train.

    >>> model = add_lora(student, rank=8); trainer = DistillationTrainer(model=model, ...); trainer.train()
    >>> student = merge_lora(model)   # a plain converted model again, the adapters folded into its weights
    """
    from peft import LoraConfig, get_peft_model

    targets = projections(student)
    if not targets:
        raise ValueError(
            f"{type(student).__name__} has no linear projections in numbered blocks for LoRA: use lora_rank=0."
        )
    conv1d = any(type(m).__name__ == "Conv1D" for m in student.modules())  # GPT-2 stores (in, out)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank if alpha is None else alpha, lora_dropout=0.0, target_modules=targets,
        fan_in_fan_out=conv1d,
    )  # fmt: skip
    model = get_peft_model(student, config)
    for name, parameter in model.named_parameters():
        if any(k in name for k in TRAINABLE_NAMES):
            parameter.requires_grad_(True)
    return model


def projections(model: nn.Module) -> list[str]:
    """Names of the linear layers (``nn.Linear``, GPT-2's ``Conv1D``) inside numbered blocks (``layers.3.``)."""
    return [
        name
        for name, module in model.named_modules()
        if type(module).__name__ in ("Linear", "Conv1D") and any(part.isdigit() for part in name.split("."))
    ]


def merge_lora(model) -> PreTrainedModel:
    """The base model with the adapters merged into its weights (what ``save_pretrained`` writes as a normal
    converted checkpoint); a model without adapters is returned as it is."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model
