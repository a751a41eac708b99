"""``compare``'s results as a terminal table (each figure and its ratio to the first model's) and as a plot
(perplexity against length and against position, each model's native or trained length marked). Both read only the
results dict that compare.json holds, so the plot and the table show the same figures.

Example:
    >>> print(format_comparison(results))
    >>> plot_comparison(results, "compare.png")
"""

from __future__ import annotations

import os
from typing import Any

NOT_RUN = "n/a"


def table_rows(results: dict[str, Any]) -> list[tuple[str, list[float | str | None]]]:
    """The table's rows: a measure's name and one value per model (a float, ``"hits/of"``, or None: not run)."""
    models = results["models"]
    rows: list[tuple[str, list]] = []
    for protocol in results["protocols"]:
        for length in results["lengths"]:
            cells = [m["perplexity"][protocol][str(length)].get("perplexity") for m in models]
            rows.append((f"ppl@{length} {protocol}", cells))
    for name in _ranges(results):
        rows.append((f"ppl positions {name}", [(m.get("by_position") or {}).get(name) for m in models]))
    for length in results["passkey"]["lengths"]:
        cells = []
        for m in models:
            entry = m["passkey"][str(length)]
            cells.append(f"{entry['hits']}/{entry['of']}" if "hits" in entry else None)
        rows.append((f"passkey@{length}", cells))
    rows.append(("native length", [m["native"] for m in models]))
    return rows


def _ranges(results: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for m in results["models"]:
        names += [n for n in m.get("by_position") or {} if n not in names]
    return names


def _value(value) -> str:
    if value is None:
        return NOT_RUN
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _ratio(value, base) -> str:
    if isinstance(value, float) and isinstance(base, float) and base:
        return f"{value / base:.3f}"
    return ""


def format_comparison(results: dict[str, Any]) -> str:
    """One table: a row per measure, per model its figure and (perplexities) the ratio to the first model's; then
    why each ``n/a`` is one.

    >>> print(format_comparison(results))  # doctest: +SKIP
    measure                       original     pretrained  ratio
    ppl@256 nonoverlapping          18.976         19.056  1.004
    """
    models = results["models"]
    labels = [m["label"] for m in models]
    widths = [max(len(label), 9) for label in labels]
    head = f"{'measure':<30}" + "".join(
        f" {label:>{w}}" + ("" if i == 0 else "  ratio") for i, (label, w) in enumerate(zip(labels, widths))
    )
    lines = [head]
    for name, cells in table_rows(results):
        line = f"{name:<30}"
        for i, (cell, w) in enumerate(zip(cells, widths)):
            line += f" {_value(cell):>{w}}" + ("" if i == 0 else f"  {_ratio(cell, cells[0]):>5}")
        lines.append(line.rstrip())
    why = []
    for m in models:
        for protocol in results["protocols"]:
            for length in results["lengths"]:
                error = m["perplexity"][protocol][str(length)].get("error")
                if error:
                    why.append(f"  n/a: {m['label']} at {length}: {error}")
        if m.get("by_position_error"):
            why.append(f"  n/a: {m['label']} by position: {m['by_position_error']}")
        for length, entry in m["passkey"].items():
            if "error" in entry:
                why.append(f"  n/a: {m['label']} passkey@{length}: {entry['error']}")
    text = results["text"]
    lines += list(dict.fromkeys(why)) + [
        f"ratio = figure / {labels[0]}'s; windows over the first {text['evaluated']} of {text['tokens']} tokens of "
        f"{text['source']}; by position over {_stream(results['position'])}; passkey hits / depths "
        f"{results['passkey']['depths']}; "
        f"{results['device']}, {results['dtype']}"
    ]
    return "\n".join(lines)


def _stream(position: dict[str, Any]) -> str:
    said = f"{position['tokens']} tokens (KV cache, chunks of {position['chunk']})"
    if position["tokens"] < position["wanted"]:
        said += f", not the {position['wanted']} asked (2x native by default): raise --max-tokens to reach them"
    return said


def draw(results: dict[str, Any]):
    """The figure: perplexity against length (left; log2 axis, one line per model and protocol) and against
    position (right; each range's perplexity at its end), each model's native length a dotted line in its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_position = any(m.get("by_position") for m in results["models"])
    fig, axes = plt.subplots(1, 2 if has_position else 1, figsize=(11 if has_position else 6.4, 4.2), squeeze=False)
    by_length, by_pos = axes[0][0], axes[0][1] if has_position else None
    bounds = results["position"]["bounds"]
    for i, m in enumerate(results["models"]):
        color = f"C{i}"
        for protocol, style in zip(results["protocols"], ("-o", "--s")):
            points = [(n, m["perplexity"][protocol][str(n)].get("perplexity")) for n in results["lengths"]]
            points = [(n, p) for n, p in points if p is not None]
            if points:
                by_length.plot(*zip(*points), style, color=color, label=f"{m['label']} ({protocol})")
        if by_pos is not None and m.get("by_position"):
            ends = dict(zip(_ranges(results), bounds[1:]))
            points = [(ends[name], p) for name, p in m["by_position"].items() if p is not None]
            if points:
                by_pos.plot(*zip(*points), "-o", color=color, label=m["label"])
        for ax in (by_length, by_pos):
            if ax is not None and m["native"]:
                ax.axvline(m["native"], color=color, linestyle=":", alpha=0.8)
    by_length.set_xscale("log", base=2)
    by_length.set_xticks(results["lengths"], [str(n) for n in results["lengths"]])
    by_length.set_xlabel("evaluation length (tokens); dotted: native length")
    by_length.set_ylabel("perplexity")
    by_length.set_title("Perplexity against length")
    if by_pos is not None:
        by_pos.set_xscale("log", base=2)
        by_pos.set_xticks(bounds[1:], [str(n) for n in bounds[1:]])
        by_pos.set_xlabel("position in the stream (range end, tokens)")
        by_pos.set_title("Perplexity by position (KV cache)")
    for ax in (by_length, by_pos):
        if ax is not None:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_comparison(results: dict[str, Any], path: str | os.PathLike) -> str:
    """Save :func:`draw`'s figure as a PNG at ``path``; returns the path."""
    import matplotlib.pyplot as plt

    fig = draw(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
