"""Recovery settings: checked before anything loads, and the bounded default lengths.

One place answers "is this setting valid" and "which lengths does recovery train and evaluate at", for
:func:`hf_alibi.recover.recover` and ``hf-alibi recover`` (which checks before loading the model: the
teacher's length limit comes from its config).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..patch import PRESETS

# Bounded defaults (a CPU never finishes at the original maximum x 8); every bound that bit is said
# (RecoveryLengths.notes). The measurements behind these values: docs/measurements.md.
MAX_DEFAULT_LENGTH = 512
MAX_EVAL_LENGTH = 2048
EVAL_FACTORS = (1, 2, 4, 8)

# The learning rate when none is given, by how far the conversion starts from the original; LoRA: LORA_FACTOR x
# the full rate (docs/measurements.md).
DEFAULT_LEARNING_RATES = {"causal": 1e-5, "encoder": 1e-4, "seq2seq": 1e-4, "paper": 2e-4}
LORA_FACTOR = 20.0


@dataclass(frozen=True)
class RecoveryLengths:
    """The training length, the agreement lengths (``factor x length``) and what was capped, as lines."""

    length: int
    factors: tuple[int, ...]
    notes: tuple[str, ...]


def resolve_lengths(
    original: int | None,
    length: int | None = None,
    eval_factors: Sequence[int] = EVAL_FACTORS,
    max_eval_length: int | None = MAX_EVAL_LENGTH,
) -> RecoveryLengths:
    """Training length ``length`` (default ``min(original, 512)``) and the agreement factors whose
    ``factor * length`` is at most ``max_eval_length`` (None: no cap). ``notes`` says what was capped.

    >>> resolve_lengths(8192).length, resolve_lengths(8192).factors
    (512, (1, 2, 4))
    >>> resolve_lengths(512, max_eval_length=4096).factors
    (1, 2, 4, 8)
    """
    notes = []
    if length is None:
        if not original:
            raise ValueError("The model has no position table to read its length from: pass length (CLI: --length).")
        length = min(original, MAX_DEFAULT_LENGTH)
        if length < original:
            notes.append(
                f"training length {length}: the original's {original} capped at {MAX_DEFAULT_LENGTH} "
                "(pass --length to train longer)"
            )
    kept = tuple(f for f in eval_factors if max_eval_length is None or f * length <= max_eval_length)
    dropped = [f * length for f in eval_factors if f not in kept]
    if dropped:
        notes.append(
            f"agreement at {', '.join(str(f * length) for f in kept) or 'no length'} tokens; "
            f"{', '.join(map(str, dropped))} capped by max_eval_length {max_eval_length} (--max_eval_length)"
        )
    if original and max_eval_length is not None and not any(f * length > original for f in kept):
        notes.append(
            f"no agreement past the original length {original}: it needs more than {original} tokens, over "
            f"max_eval_length {max_eval_length}"
        )
    return RecoveryLengths(length, kept, tuple(notes))


def default_learning_rate(kind: str, preset: str | None, lora_rank: int = 0) -> float:
    """The learning rate :func:`recover` uses when none is given (:data:`DEFAULT_LEARNING_RATES`).

    >>> default_learning_rate("causal", "pretrained"), default_learning_rate("causal", "pretrained", lora_rank=16)
    (1e-05, 0.0002)
    >>> default_learning_rate("encoder", None)
    0.0002
    """
    rate = DEFAULT_LEARNING_RATES["paper" if preset in (None, "paper") else kind]
    return rate * LORA_FACTOR if lora_rank else rate


def check_settings(original: int | None = None, **settings) -> None:
    """One-line ``ValueError`` for the first bad recovery setting (keyword arguments of :func:`recover`);
    ``original`` is the teacher's maximum length, which ``length`` may not pass (it could not run there).

    >>> check_settings(32, length=64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: length 64 is longer than the original model's 32 positions: the teacher cannot run there. ...
    """
    positive = ("max_steps", "batch_size", "length", "save_steps", "max_eval_length", "max_eval_tokens")
    at_least_zero = ("warm_start_steps", "attention_only_steps", "eval_every", "lora_rank", "warmup_steps", "sinks")
    for name in positive + at_least_zero:
        value = settings.get(name)
        if value is None:
            continue
        floor = 1 if name in positive else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < floor:
            raise ValueError(f"{name} must be an integer >= {floor}, got {value!r} (--{name}).")
    for name in ("learning_rate", "temperature"):
        value = settings.get(name)
        if value is not None and not (_finite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r} (--{name}).")
    for name in ("lm_weight", "weight_decay"):
        value = settings.get(name)
        if value is not None and not (_finite(value) and 0 <= value <= (1 if name == "lm_weight" else math.inf)):
            limit = "between 0 and 1 (the share of the LM loss)" if name == "lm_weight" else ">= 0"
            raise ValueError(f"{name} must be {limit}, got {value!r} (--{name}).")
    length = settings.get("length")
    if length is not None and original and length > original:
        raise ValueError(
            f"length {length} is longer than the original model's {original} positions: the teacher cannot run "
            f"there. Pass --length {original} or less (the recovered model runs longer after)."
        )
    max_eval_length = settings.get("max_eval_length")
    effective = length or (min(original, MAX_DEFAULT_LENGTH) if original else None)
    if max_eval_length is not None and effective and max_eval_length < effective:
        raise ValueError(
            f"max_eval_length {max_eval_length} is shorter than the training length {effective}: pass at least "
            f"{effective} (--max_eval_length)."
        )
    preset = settings.get("preset")
    if preset not in (None, "paper"):
        if preset not in PRESETS:
            raise ValueError(f"Unknown preset {preset!r}; known: {sorted(PRESETS)} or 'paper' (--preset).")
    if settings.get("save_steps") and not settings.get("output_dir", True):
        raise ValueError("save_steps needs output_dir (where the Trainer checkpoints go).")


def check_text_length(tokens: int, length: int, enough: bool) -> None:
    """The one error for text too short to recover at ``length`` (``tokens`` in all; ``enough``: whether it holds
    a training window and a held-out slice, as the caller splits it).

    >>> check_text_length(20, 16, enough=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: The text is too short: 20 tokens, but recovering at length 16 needs ...
    """
    if not enough:
        raise ValueError(
            f"The text is too short: {tokens} tokens, but recovering at length {length} needs at least one training "
            f"window of {length} tokens and a held-out slice of {length + 1} ({2 * length + 1} tokens in all). Pass "
            "more text, or a smaller length (--length)."
        )


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
