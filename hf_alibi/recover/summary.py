"""What a recovery did, as the model card's section (the card itself is :mod:`hf_alibi.hub.card`)."""

from __future__ import annotations

import math
import os

from ..hub.card import write_model_card
from .api import RecoveryResult


def recovery_card_section(result: RecoveryResult) -> str:
    """The model card section that says how a checkpoint was recovered (steps, tokens, length, agreement)."""
    info, first, last = result.info, result.history[0], result.final
    rows = [
        ("teacher (original)", info["teacher"]),
        ("loss", info["loss"]),
        ("steps x batch x length", f"{info['steps']} x {info['batch_size']} x {info['length']}"),
        ("tokens seen", f"{info['tokens']} ({info['epochs']} epochs of {info['train_tokens_available']})"),
        ("learning rate", info["learning_rate"]),
        ("conversion preset", info.get("preset", "paper")),
        ("slopes", info.get("slopes", "the preset's")),
        ("trained weights", f"LoRA rank {info['lora_rank']}, merged" if info.get("lora_rank") else "all"),
        ("warm start / attention-only steps", f"{info['warm_start_steps']} / {info['attention_only_steps']}"),
        ("held-out tokens", info["eval_tokens"]),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    figures = "\n".join(
        f"| {key} | {_fmt(first.get(key))} | {_fmt(last.get(key))} |" for key in last if key not in ("step", "tokens")
    )
    return f"""
## Recovery (self-distillation from the original)

Converted with hf_alibi and then trained to give the original model's outputs without its position
embeddings (`hf_alibi.recover`), on unlabeled text at the original length {info["length"]}.

| setting | value |
|---|---|
{table}

Agreement with the original on the held-out text, before and after (`kl`: per token, KL(teacher ‖ student);
`ppl_kx` / `cosine_kx`: the recovered model at k x the original length):

| figure | converted, not trained | recovered |
|---|---|---|
{figures}
"""


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def write_recovery_card(folder: str | os.PathLike, result: RecoveryResult, base_model: str | None = None) -> None:
    """Write ``folder``/README.md again as the card of a recovered checkpoint: the converted checkpoint's card,
    written from its settings, with :func:`recovery_card_section` (``base_model``: the Hub id it came from).

    >>> result.student.save_pretrained("recovered"); write_recovery_card("recovered", result)
    """
    write_model_card(folder, result.student.config, base_model, overwrite=True, recovery=recovery_card_section(result))
