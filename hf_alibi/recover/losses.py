"""The distillation losses: KL of next-token distributions, MSE of hidden states, and the mix."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .kinds import CAUSAL_MODEL, HIDDEN_LAYERS, MODEL_KINDS, SEQ2SEQ_MODEL


def _last_hidden(outputs, kind: str) -> torch.Tensor:
    if kind == SEQ2SEQ_MODEL:
        return outputs.encoder_last_hidden_state
    return outputs.hidden_states[-1]


def _hidden_list(outputs, kind: str, hidden_layers: str) -> list[torch.Tensor]:
    if hidden_layers == "last":
        return [_last_hidden(outputs, kind)]
    states = outputs.encoder_hidden_states if kind == SEQ2SEQ_MODEL else outputs.hidden_states
    return list(states[1:])  # every layer's output (states[0] is the embeddings)


def _token_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` (B, L) over the tokens where ``mask`` (B, L) is 1."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def kl_next_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``KL(teacher || student)`` of the next-token distributions, per token, mean over the tokens
    ``attention_mask`` keeps; softened by ``temperature`` and scaled by its square. Computed in fp32.

    >>> kl_next_token(torch.zeros(1, 3, 5), torch.zeros(1, 3, 5)).item()
    0.0
    """
    t = float(temperature)
    log_p_teacher = F.log_softmax(teacher_logits.float() / t, dim=-1)
    log_p_student = F.log_softmax(student_logits.float() / t, dim=-1)
    per_token = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1)
    return _token_mean(per_token, attention_mask) * t * t


def hidden_state_mse(
    student_states: Sequence[torch.Tensor],
    teacher_states: Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error of hidden states (B, L, D), mean over features, tokens ``attention_mask``
    keeps, and the layers given. Computed in fp32.

    >>> hidden_state_mse([torch.ones(1, 2, 4)], [torch.zeros(1, 2, 4)]).item()
    1.0
    """
    if len(student_states) != len(teacher_states) or not student_states:
        raise ValueError(
            f"hidden_state_mse needs as many student as teacher layers (>= 1), got "
            f"{len(student_states)} and {len(teacher_states)}."
        )
    losses = [
        _token_mean((s.float() - t.float()).pow(2).mean(-1), attention_mask)
        for s, t in zip(student_states, teacher_states)
    ]
    return torch.stack(losses).mean()


def distillation_loss(
    student_outputs,
    teacher_outputs,
    kind: str,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    hidden_layers: str = "last",
) -> torch.Tensor:
    """The distillation loss of one batch (see the module docstring). The outputs need ``logits``
    (causal, seq2seq) or ``hidden_states`` (encoders; run both with ``output_hidden_states=True``).

    >>> with torch.no_grad():
    ...     t = teacher(input_ids=ids, output_hidden_states=True)
    >>> distillation_loss(student(input_ids=ids, output_hidden_states=True), t, "encoder").backward()
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"kind must be one of {MODEL_KINDS}, got {kind!r}.")
    if hidden_layers not in HIDDEN_LAYERS:
        raise ValueError(f"hidden_layers must be one of {HIDDEN_LAYERS}, got {hidden_layers!r}.")
    student_logits = getattr(student_outputs, "logits", None)
    if kind == CAUSAL_MODEL and student_logits is not None:
        return kl_next_token(student_logits, teacher_outputs.logits, attention_mask, temperature)
    hidden = hidden_state_mse(
        _hidden_list(student_outputs, kind, hidden_layers),
        _hidden_list(teacher_outputs, kind, hidden_layers),
        attention_mask,
    )
    if kind == SEQ2SEQ_MODEL and student_logits is not None:
        return hidden + kl_next_token(student_logits, teacher_outputs.logits, None, temperature)
    return hidden
