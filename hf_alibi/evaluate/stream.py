"""Perplexity by position: one long token stream fed through the KV cache in chunks of queries, so no L x L tensor
is ever built, and the mean loss of the tokens predicted in each range of positions.

A model that extrapolates keeps its perplexity flat (or falling: more context) past the length it was trained at;
one that does not climbs there. ``position_nll`` scores ``ids[1:]`` exactly as one forward over the whole stream
would (tests/evaluate/test_compare.py checks it against that forward), at the memory of one chunk's queries against
the cache.

Example:
    >>> nll = position_nll(model, ids[:16385], chunk=1024)       # per-token NLL, 16384 values
    >>> by_position(nll, position_bounds(8192))                   # {"0-1k": ..., ..., "8k-16k": ...}
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .lengths import progress


@torch.no_grad()
def position_nll(
    model: nn.Module, ids: torch.Tensor, chunk: int = 1024, limit: int | None = None, desc: str = "by position"
) -> torch.Tensor:
    """Per-token NLL (nats, float64 on the CPU) of ``ids[1:]`` over one stream, fed ``chunk`` queries at a time
    with the KV cache. ``limit``: the model's learned positions (the stream stops there; the rest is NaN).

    >>> position_nll(model, torch.arange(100), chunk=16).shape
    torch.Size([99])
    """
    from transformers import DynamicCache

    ids = torch.as_tensor(ids).reshape(-1)
    targets = ids.numel() - 1
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll = torch.full((max(targets, 0),), math.nan, dtype=torch.float64)
    stop = targets if limit is None else min(targets, limit)
    cache = DynamicCache(config=model.config)
    # the forward's name for its KV cache: ``cache`` from transformers 5.24 on (``past_key_values`` still accepted,
    # with a warning), ``past_key_values`` before
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    try:
        for start in progress(range(0, stop, chunk), desc):
            end = min(start + chunk, stop)
            x = ids[start:end][None].to(device)  # (1, q)
            positions = torch.arange(start, end, device=device)[None]
            out = model(input_ids=x, use_cache=True, position_ids=positions, **{keyword: cache})  # cache: updated
            logits = out.logits[0].float()  # (q, vocab)
            nll[start:end] = F.cross_entropy(logits, ids[start + 1 : end + 1].to(device), reduction="none").cpu()
    finally:
        model.train(was_training)
    return nll


def position_bounds(native: int, stream: int | None = None) -> list[int]:
    """The ranges' bounds for a model of native length ``native``: 0, native/8, /4, /2, 1x, 2x, and on by doubling
    to ``stream`` (default 2x native).

    >>> position_bounds(8192)
    [0, 1024, 2048, 4096, 8192, 16384]
    """
    stream = 2 * native if stream is None else stream
    bounds = [b for b in sorted({0, *(native * k // 8 for k in (1, 2, 4, 8))}) if b < stream]
    while bounds[-1] < stream:
        bounds.append(min(2 * max(bounds[-1], 1), stream))
    return bounds


def range_name(a: int, b: int) -> str:
    """``"1k-2k"`` for 1024-2048; plain numbers otherwise."""
    return f"{short(a)}-{short(b)}"


def short(n: int) -> str:
    """``"4k"`` for 4096; plain numbers otherwise."""
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def by_position(nll: torch.Tensor, bounds: Sequence[int]) -> dict[str, float | None]:
    """Perplexity of the tokens predicted at positions [a, b) for each consecutive pair of ``bounds``; ``None``
    where the range holds no scored token (past the stream, or past a model's learned positions: NaN).

    >>> by_position(torch.zeros(8), [0, 4, 8])
    {'0-4': 1.0, '4-8': 1.0}
    """
    out: dict[str, float | None] = {}
    for a, b in zip(bounds, bounds[1:]):
        part = nll[a:b]
        part = part[~torch.isnan(part)]
        out[range_name(a, b)] = math.exp(part.double().mean().item()) if part.numel() else None
    return out
