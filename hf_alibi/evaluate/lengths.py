"""Test long: perplexity of a causal LM at many lengths, with both of fairseq's ``eval-lm`` protocols.

The text is one token stream ``t_0 .. t_{N-1}``; the targets are ``t_1 .. t_{N-1}``, each scored
exactly once, at every length, so perplexities at different lengths are over the same tokens.
A window of length L feeds the model ``t_a .. t_{a+L-1}`` and predicts ``t_{a+1} .. t_{a+L}``.

- ``nonoverlapping`` (the paper's main tables): windows start at 0, L, 2L, ...; the target at offset
  k of its window has k + 1 tokens of context (1 .. L).
- ``sliding`` (fairseq ``--context-window``): the first window scores all its targets; each next
  window moves ``stride`` tokens on and scores only its last ``stride`` targets, so every target
  after the first window sees at least ``L - stride + 1`` tokens of context (L when stride = 1).

A model that cannot run at a length (learned absolute positions past their table) is reported with
an ``error`` entry for that length instead of a perplexity; the other lengths still run.

Example:
    >>> results = evaluate_lengths(model, {"validation": ids}, lengths=[256, 512, 1024])
    >>> print(format_table(results)); plot_results(results, "ppl_vs_length.png")
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..convert.positions import position_limit

PROTOCOLS = ("nonoverlapping", "sliding")


def progress(items, desc: str):
    """``items`` with a progress bar on stderr that shows only once the loop has run a second (tqdm's ``delay``),
    so quick loops print nothing; ``HF_ALIBI_PROGRESS=0`` turns the bars off."""
    import os

    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, delay=1.0, leave=False, disable=os.environ.get("HF_ALIBI_PROGRESS") == "0")


def score_windows(num_tokens: int, length: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """The windows ``(start, end, score_from)``: inputs ``ids[start:end]``; the input at position p
    predicts ``ids[p + 1]``, scored when ``p >= score_from``. ``stride=None``: non-overlapping."""
    if length < 1:
        raise ValueError(f"evaluation length must be >= 1, got {length}.")
    targets = num_tokens - 1
    if targets < 1:
        raise ValueError(f"need at least 2 tokens to score one, got {num_tokens}.")
    if stride is None:
        return [(a, min(a + length, targets), a) for a in range(0, targets, length)]
    if not 1 <= stride <= length:
        raise ValueError(f"eval stride must be between 1 and the evaluation length {length}, got {stride}.")
    windows = [(0, min(length, targets), 0)]
    scored = windows[0][1]
    while scored < targets:
        end = min(scored + stride, targets)
        windows.append((max(0, end - length), end, scored))
        scored = end
    return windows


def _dist():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@torch.no_grad()
def evaluate_perplexity(
    model: nn.Module, ids: torch.Tensor, length: int, stride: int | None = None, batch_size: int = 4
) -> dict[str, float]:
    """Perplexity of ``model`` on the 1-d token stream ``ids`` with windows of ``length`` (see the
    module docstring; ``stride=None`` is non-overlapping). Returns ``loss`` (mean NLL, nats),
    ``perplexity``, ``tokens`` scored and ``windows``. Under ``torch.distributed`` the windows are
    shared between the ranks and the sums all-reduced: every rank gets the same figures."""
    ids = torch.as_tensor(ids).reshape(-1)
    windows = score_windows(ids.numel(), length, stride)
    rank, world = _dist()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)  # nll, tokens
    # Windows of equal size go together in batches (all but the first and last few are full size).
    mine = windows[rank::world]
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for window in mine:
        groups.setdefault(window[1] - window[0], []).append(window)
    batches = [group[i : i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]
    try:
        for chunk in progress(batches, f"length {length}"):
            inputs = torch.stack([ids[a:e] for a, e, _ in chunk]).to(device)  # (b, size)
            targets = torch.stack([ids[a + 1 : e + 1] for a, e, _ in chunk]).to(device)
            positions = torch.stack([torch.arange(a, e) for a, e, _ in chunk]).to(device)
            scored = positions >= torch.tensor([s for _, _, s in chunk], device=device)[:, None]
            logits = model(input_ids=inputs).logits.float()  # (b, size, vocab)
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            sums[0] += nll[scored].double().sum().cpu()
            sums[1] += scored.sum().cpu()
    finally:
        model.train(was_training)
    if world > 1:
        torch.distributed.all_reduce(sums)
    loss = (sums[0] / sums[1]).item()
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(sums[1]), "windows": len(windows)}


def evaluate_lengths(
    model: nn.Module,
    splits: dict[str, torch.Tensor],
    lengths: Sequence[int],
    stride: int | None = None,
    batch_size: int = 4,
    protocols: Sequence[str] = PROTOCOLS,
) -> dict:
    """Evaluate every split at every length with each protocol.

    ``stride`` is the sliding window's step (clamped to each length); None means half of each length.
    Returns a JSON-ready dict:
    ``{"lengths", "stride", "splits": {split: {"tokens", protocol: {str(length): figures}}}}``
    where figures are :func:`evaluate_perplexity`'s, or ``{"error": why}`` for a length the model
    cannot run at.
    """
    unknown = set(protocols) - set(PROTOCOLS)
    if unknown:
        raise ValueError(f"unknown protocols {sorted(unknown)}; choose from {PROTOCOLS}.")
    lengths = [int(n) for n in lengths]
    limit = position_limit(model)
    results: dict = {"lengths": lengths, "stride": stride, "position_limit": limit, "splits": {}}
    for split, ids in splits.items():
        ids = torch.as_tensor(ids).reshape(-1)
        entry: dict = {"tokens": int(ids.numel())}
        for protocol in protocols:
            entry[protocol] = {}
            for length in lengths:
                if limit is not None and length > limit:
                    entry[protocol][str(length)] = {
                        "error": f"cannot run: length {length} > the model's {limit} learned positions"
                    }
                    continue
                step = None if protocol == "nonoverlapping" else min(stride or max(1, length // 2), length)
                entry[protocol][str(length)] = evaluate_perplexity(model, ids, length, step, batch_size)
        results["splits"][split] = entry
    return results


def _cell(figures: dict, base: dict | None) -> tuple[str, str]:
    if "perplexity" not in figures:
        return "n/a", "n/a"
    ratio = f"{figures['perplexity'] / base['perplexity']:.3f}" if base and "perplexity" in base else "n/a"
    return f"{figures['perplexity']:.3f}", ratio


def format_table(results: dict) -> str:
    """A text table: per split and length, perplexity and ppl(length)/ppl(first length), both protocols."""
    lines = []
    first = str(results["lengths"][0])
    for split, entry in results["splits"].items():
        protocols = [p for p in PROTOCOLS if p in entry]
        header = f"{split} ({entry['tokens']} tokens)"
        cols = "".join(f" | {p + ' ppl':>18} | {'ratio':>6}" for p in protocols)
        lines += [header, f"{'length':>7}{cols}"]
        errors = []
        for length in results["lengths"]:
            row = f"{length:>7}"
            for p in protocols:
                figures = entry[p][str(length)]
                ppl, ratio = _cell(figures, entry[p][first])
                row += f" | {ppl:>18} | {ratio:>6}"
                if "error" in figures and figures["error"] not in errors:
                    errors.append(figures["error"])
            lines.append(row)
        lines += [f"  n/a: {e}" for e in errors] + [""]
    stride = results.get("stride")
    lines.append(f"ratio = ppl(length) / ppl({first}); sliding stride = {stride or 'length // 2'}")
    return "\n".join(lines)


def plot_results(results: dict, path: str, title: str | None = None) -> str:
    """Save a PNG of perplexity against evaluation length (log2 x axis), one line per split and protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for split, entry in results["splits"].items():
        for protocol, style in zip(PROTOCOLS, ("-o", "--s")):
            if protocol not in entry:
                continue
            points = [(n, entry[protocol][str(n)].get("perplexity")) for n in results["lengths"]]
            points = [(n, p) for n, p in points if p is not None]
            if points:
                ax.plot(*zip(*points), style, label=f"{split}, {protocol}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["lengths"], [str(n) for n in results["lengths"]])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title or "Perplexity against evaluation length")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
