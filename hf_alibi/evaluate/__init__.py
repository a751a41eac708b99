"""Test long: what a model keeps, measured. One wing, which ``hf-alibi compare``, ``scripts/run_clm.py``, the
notebooks and the benchmarks all call:

- :mod:`~hf_alibi.evaluate.lengths`: perplexity at many lengths, both of fairseq's ``eval-lm`` protocols;
- :mod:`~hf_alibi.evaluate.stream`: perplexity by position along one long stream, through the KV cache in chunks;
- :mod:`~hf_alibi.evaluate.passkey`: passkey retrieval at given lengths and depths;
- :mod:`~hf_alibi.evaluate.inputs`: what is checked before any model loads (no torch: the command line asks it);
- :mod:`~hf_alibi.evaluate.comparison` (:func:`compare`): all of it for several models on the same tokens, with
  :mod:`~hf_alibi.evaluate.report`'s table, plot and JSON.

Names resolve on first use (PEP 562), so the command line imports :mod:`~hf_alibi.evaluate.inputs` without torch.

Example:
    >>> from hf_alibi.evaluate import compare
    >>> results = compare(["my-llama", "my-llama-alibi"], lengths=[256, 1024], out="cmp")  # doctest: +SKIP
"""

from __future__ import annotations

from .._lazy import lazy_names

_HOMES = {
    "PROTOCOLS": "lengths",
    "evaluate_lengths": "lengths",
    "evaluate_perplexity": "lengths",
    "format_table": "lengths",
    "plot_results": "lengths",
    "score_windows": "lengths",
    "by_position": "stream",
    "position_bounds": "stream",
    "position_nll": "stream",
    "passkey_hits": "passkey",
    "passkey_prompt": "passkey",
    "CompareError": "inputs",
    "compare": "comparison",
    "measure_model": "comparison",
    "format_comparison": "report",
    "plot_comparison": "report",
}

__all__ = sorted(_HOMES)


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
