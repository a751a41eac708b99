"""Passkey retrieval: a 5-digit number hidden at a depth of filler text, read back by greedy decoding.

The prompt is ``length`` tokens: filler ("The grass is green. ..."), the needle at ``depth`` (0: the start, 1: the
end), then the question; the answer counts as a hit when the first 5-digit number in 8 greedy tokens is the key.

Example:
    >>> passkey_hits(model, tokenizer, 4096, depths=(0.1, 0.5, 0.9))
    (3, 3)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .inputs import DEPTHS
from .lengths import progress

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = " What is the pass key? The pass key is"
NEW_TOKENS = 8


def needle(key: int) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


def passkey_prompt(encode: Callable[[str], list[int]], length: int, depth: float, key: int) -> list[int]:
    """``length`` tokens: filler with the needle at ``depth`` (0: start, 1: end), then the question.
    ``encode``: text to ids without special tokens. A ``ValueError`` when ``length`` cannot hold the needle and the
    question.

    >>> len(passkey_prompt(lambda s: list(s.encode()), 400, 0.5, 12345))
    400
    """
    hidden, question = encode(needle(key)), encode(QUESTION)
    body = length - len(hidden) - len(question)
    if body < 1:
        raise ValueError(
            f"passkey length {length} is too short for the prompt ({len(hidden) + len(question)} tokens): "
            "give a longer length."
        )
    filler = encode(FILLER)
    filler = filler * (body // len(filler) + 1)
    cut = int(body * depth)
    return filler[:cut] + hidden + filler[cut:body] + question


def prompt_tokens(encode: Callable[[str], list[int]]) -> int:
    """The fewest tokens a passkey prompt takes (needle and question)."""
    return len(encode(needle(99999))) + len(encode(QUESTION)) + 1


def keys(length: int, depths: Sequence[float], seed: int = 0) -> list[int]:
    """The key hidden at each depth of a prompt of ``length`` (the same for every model)."""
    rng = random.Random(seed + length)
    return [rng.randint(10000, 99999) for _ in depths]


def found_key(answer: str) -> str | None:
    """The first 5-digit number in a decoded answer (spaces removed: some tokenizers split digits)."""
    found = re.findall(r"\d{5}", answer.replace(" ", ""))
    return found[0] if found else None


@torch.no_grad()
def passkey_hits(
    model: nn.Module,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    length: int,
    depths: Sequence[float] = DEPTHS,
    seed: int = 0,
) -> tuple[int, int]:
    """Hits out of ``len(depths)`` at ``length``: greedy decoding of :data:`NEW_TOKENS` after each prompt.

    >>> passkey_hits(model, encode, decode, 1024)
    (3, 3)
    """
    device = next(model.parameters()).device
    pad = getattr(model.config, "pad_token_id", None)
    pad = pad if pad is not None else (getattr(model.config, "eos_token_id", None) or 0)
    pad = pad[0] if isinstance(pad, list) else pad
    hits = 0
    for depth, key in progress(list(zip(depths, keys(length, depths, seed))), f"passkey {length}"):
        x = torch.tensor([passkey_prompt(encode, length, depth, key)], device=device)
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad
        )
        hits += found_key(decode(out[0, x.shape[1] :].tolist())) == str(key)
    return hits, len(depths)
