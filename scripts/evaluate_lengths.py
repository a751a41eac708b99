#!/usr/bin/env python
"""Evaluate a saved causal-LM checkpoint at many lengths, both fairseq protocols.

    python scripts/evaluate_lengths.py out/alibi --lengths 128,256,512,1024 --max_tokens 32768

Text: the embedded corpus's validation and test splits (default), or ``--text_file`` (a local text
file, one split). The checkpoint's own tokenizer is used (run_clm.py saves it with the model).
Writes ``--output`` (JSON, default <checkpoint>/eval_lengths.json) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
from itertools import chain
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_alibi  # noqa: F401  (registers the ALiBi model types, so ALiBi checkpoints load)
from hf_alibi.evaluate import evaluate_lengths, format_table, plot_results
from hf_alibi.train.data import embedded_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--lengths", required=True, help="comma-separated, e.g. 256,512,1024,2048")
    parser.add_argument("--stride", type=int, default=None, help="sliding-window step; default length // 2")
    parser.add_argument("--max_tokens", type=int, default=None, help="evaluate the first N tokens of each split")
    parser.add_argument("--text_file", default=None, help="local text to evaluate instead of the embedded corpus")
    parser.add_argument("--tokenizer", default=None, help="default: the checkpoint's")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    lengths = [int(n) for n in args.lengths.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    if args.text_file:
        texts = {"text": [Path(args.text_file).read_text(encoding="utf-8")]}
    else:
        corpus = embedded_corpus()
        texts = {split: list(corpus[split]["text"]) for split in ("validation", "test")}
    splits = {}
    for split, docs in texts.items():
        ids = torch.tensor(list(chain(*tokenizer(docs)["input_ids"])), dtype=torch.long)
        splits[split] = ids[: args.max_tokens] if args.max_tokens else ids
    results = evaluate_lengths(model, splits, lengths, args.stride, args.batch_size)
    results.update(checkpoint=args.checkpoint, model_type=model.config.model_type)
    output = Path(args.output or Path(args.checkpoint) / "eval_lengths.json")
    output.write_text(json.dumps(results, indent=2, sort_keys=True))
    png = plot_results(results, str(output.with_suffix(".png")), f"{args.checkpoint} ({model.config.model_type})")
    print(format_table(results))
    print(f"figures: {output}\nplot: {png}")


if __name__ == "__main__":
    main()
