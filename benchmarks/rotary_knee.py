#!/usr/bin/env python
"""What the rotary position maps cost per token: the pretrained preset (the knee), the same conversion with the
long wavelengths interpolated instead (``rotary_stretch=1, rotary_interpolation=1.5``) and the long preset (the
rotary window at half the original length), against the conversion without any (``rotary_stretch=1``): one forward
of ``--tokens`` tokens each, interleaved, median of ``--repeats``; prints each median and its ratio to the
conversion without a map. The window costs only where a call's keys pass it: give ``--tokens`` past half the
original length to see that.

    PYTHONPATH=. python benchmarks/rotary_knee.py --model /work/models/smollm2 --tokens 2048 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

import hf_alibi


def main(argv=None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/work/models/smollm2", help="a rotary causal LM checkpoint folder")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    def load(preset="pretrained", **options):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        return hf_alibi.patch_model(model, preset=preset, **options).eval()

    arms = {
        "without the knee (rotary_stretch=1)": load(rotary_stretch=1.0),
        "the preset (knee)": load(),
        "interpolated x1.5 (rotary_stretch=1)": load(rotary_stretch=1.0, rotary_interpolation=1.5),
        "the long preset (rotary window)": load("long"),
    }
    vocab = next(iter(arms.values())).config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in arms}
    with torch.no_grad():
        for model in arms.values():
            model(input_ids=ids[:, :64])  # warm up
        for _ in range(args.repeats):
            for name, model in arms.items():
                start = time.perf_counter()
                model(input_ids=ids)
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["without the knee (rotary_stretch=1)"]
    for name, median in medians.items():
        print(f"{name}: median {median:.3f} s over {args.repeats}, ratio {median / base:.3f}")
    return medians


if __name__ == "__main__":
    main()
