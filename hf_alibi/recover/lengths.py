"""Which lengths recovery trains and evaluates at: the bounded defaults, :func:`resolve_lengths` (what was capped, as
lines) and :func:`check_text_length`, the one error for text too short. Standard library only: ``hf-alibi recover``
checks lengths before torch loads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Bounded defaults (a CPU never finishes at the original maximum x 8); every bound that bit is said
# (RecoveryLengths.notes). The measurements behind these values: docs/measurements.md.
MAX_DEFAULT_LENGTH = 512
MAX_EVAL_LENGTH = 2048
EVAL_FACTORS = (1, 2, 4, 8)


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
