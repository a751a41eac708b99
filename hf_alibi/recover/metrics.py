"""How close the student is to the teacher: KL, perplexities and embedding cosines at 1x..8x."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..evaluate.lengths import evaluate_perplexity
from .blocks import NO_FRAME, Frame, frame_rows, frame_size
from .kinds import CAUSAL_MODEL, model_kind
from .losses import kl_next_token


def _forward_hidden(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    if getattr(model.config, "is_encoder_decoder", False):
        return model.get_encoder()(input_ids=ids).last_hidden_state
    return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


@torch.no_grad()
def mean_pooled(model: PreTrainedModel, ids: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Mean over tokens of the last hidden state, (N, D) fp32, for the (N, L) token ids ``ids``.

    >>> mean_pooled(bert, torch.randint(0, 100, (4, 32))).shape
    torch.Size([4, 32])
    """
    model.eval()
    device = next(model.parameters()).device
    out = [
        _forward_hidden(model, ids[i : i + batch_size].to(device)).float().mean(1).cpu()
        for i in range(0, len(ids), batch_size)
    ]
    return torch.cat(out)


def _windows(stream: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    n = stream.numel() // length
    if limit is not None:
        n = min(n, limit)
    return stream[: n * length].view(n, length)


@torch.no_grad()
def embedding_cosine(
    student: PreTrainedModel,
    teacher: PreTrainedModel,
    stream: torch.Tensor,
    length: int,
    factor: int = 1,
    frame: Frame = NO_FRAME,
) -> float | None:
    """Mean cosine between the student's mean-pooled embedding of each window of ``factor * length``
    tokens of ``stream`` and the teacher's, which at ``factor > 1`` is the mean of its mean-pooled
    embeddings of the window's ``factor`` pieces of ``length`` tokens (it cannot read past ``length``).
    With a ``frame`` (:func:`~hf_alibi.recover.blocks.special_frame`: ``[CLS] ... [SEP]``), every input
    either model reads is framed: the student's window holds the text of the teacher's ``factor`` pieces.
    None when ``stream`` is shorter than one window.

    >>> embedding_cosine(student_bert, original_bert, held_out_ids, length=128, factor=4)
    0.97
    """
    piece = length - frame_size(frame)  # the text of one of the teacher's inputs
    windows = _windows(stream, piece * factor)
    if len(windows) == 0:
        return None
    student_emb = mean_pooled(student, frame_rows(windows, frame))
    teacher_emb = mean_pooled(teacher, frame_rows(windows.reshape(-1, piece), frame))
    teacher_emb = teacher_emb.view(len(windows), factor, -1).mean(1)
    return F.cosine_similarity(student_emb, teacher_emb, dim=-1).mean().item()


@torch.no_grad()
def next_token_kl(
    student: PreTrainedModel, teacher: PreTrainedModel, stream: torch.Tensor, length: int, batch_size: int = 8
) -> float | None:
    """Mean per-token ``KL(teacher || student)`` of the next-token distributions over the windows of
    ``length`` tokens of ``stream`` (non-overlapping); None when ``stream`` is shorter than one window.

    >>> next_token_kl(student_gpt2, original_gpt2, held_out_ids, length=1024)
    0.04
    """
    windows = _windows(stream, length)
    if len(windows) == 0:
        return None
    student.eval()
    teacher.eval()
    device = next(student.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = windows[i : i + batch_size].to(device)
        kl = kl_next_token(student(input_ids=ids).logits, teacher(input_ids=ids).logits)
        total += kl.item() * ids.numel()
        count += ids.numel()
    return total / count


def agreement(
    student: PreTrainedModel,
    teacher: PreTrainedModel,
    stream: torch.Tensor,
    length: int,
    factors: Sequence[int] = (1, 2, 4, 8),
    kind: str | None = None,
    frame: Frame = NO_FRAME,
) -> dict[str, Any]:
    """How close the student is to the teacher on the held-out token stream ``stream``.

    Causal LMs: ``kl`` (teacher || student, per token) and both perplexities at ``length``, and the
    student's perplexity at ``factor * length`` (``ppl_<k>x``, non-overlapping windows).
    Encoders / seq2seq: ``cosine`` of mean-pooled embeddings at ``length``, and ``cosine_<k>x`` for the
    student at ``factor * length`` against the teacher's mean over the pieces. Lengths the stream is
    too short for are left out. ``frame``: the special tokens around each encoder input
    (:func:`embedding_cosine`).

    >>> agreement(student, teacher, held_out_ids, length=128)["kl"]
    0.012
    """
    kind = kind or model_kind(teacher)
    stream = torch.as_tensor(stream).reshape(-1)
    was_training = student.training
    result: dict[str, Any] = {}
    try:
        if kind == CAUSAL_MODEL and student.get_output_embeddings() is not None:
            result["kl"] = next_token_kl(student, teacher, stream, length)
            result["teacher_ppl"] = evaluate_perplexity(teacher, stream[: _usable(stream, length)], length)[
                "perplexity"
            ]
            for factor in factors:
                n = _usable(stream, length * factor)
                if n:
                    ppl = evaluate_perplexity(student, stream[:n], length * factor)["perplexity"]
                    result["ppl" if factor == 1 else f"ppl_{factor}x"] = ppl
        else:
            for factor in factors:
                value = embedding_cosine(student, teacher, stream, length, factor, frame)
                if value is not None:
                    result["cosine" if factor == 1 else f"cosine_{factor}x"] = value
    finally:
        student.train(was_training)
    return result


def _usable(stream: torch.Tensor, length: int) -> int:
    """Tokens of ``stream`` covered by whole windows of ``length`` (plus one target), 0 if none."""
    n = (stream.numel() - 1) // length * length
    return n + 1 if n else 0


def format_agreement(figures: dict[str, Any]) -> str:
    """One line: ``kl 0.0123 | ppl 45.6 (teacher 45.1) | 2x 44.9 | ...`` or ``cosine 0.981 | 2x 0.97 ...``."""
    if "kl" in figures:
        parts = [f"kl {figures['kl']:.4f}"]
        if "ppl" in figures:
            parts.append(f"ppl {figures['ppl']:.2f} (teacher {figures['teacher_ppl']:.2f})")
        parts += [f"{k[4:]} {v:.2f}" for k, v in figures.items() if k.startswith("ppl_")]
    else:
        parts = [f"cosine {figures['cosine']:.4f}"] if "cosine" in figures else []
        parts += [f"{k[7:]} {v:.4f}" for k, v in figures.items() if k.startswith("cosine_")]
    return " | ".join(parts)
