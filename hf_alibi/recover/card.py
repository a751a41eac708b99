"""The model card section that says how a checkpoint was recovered."""

from __future__ import annotations

import math
import os

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


def write_recovery_card(folder: str | os.PathLike, result: RecoveryResult) -> None:
    """Append :func:`recovery_card_section` to ``folder``/README.md (the converted checkpoint's card) and
    remove the card's note that a converted model must be fine-tuned first (this one was).

    >>> result.student.save_pretrained("recovered"); write_recovery_card("recovered", result)
    """
    from pathlib import Path

    path = Path(folder) / "README.md"
    card = path.read_text() if path.exists() else ""
    note_start = card.find("Note: converting does not train.")
    if note_start >= 0:
        note_end = card.find("\n\n", note_start)
        card = card[:note_start] + (
            "Note: this checkpoint was recovered after conversion (see *Recovery* below)."
            + (card[note_end:] if note_end >= 0 else "\n")
        )
    path.write_text(card.rstrip("\n") + "\n" + recovery_card_section(result))
