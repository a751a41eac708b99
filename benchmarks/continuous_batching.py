"""Continuous batching throughput: a converted Llama's tokens/s in ``generate_batch`` against the original's.

Two copies of one Llama (same weights): the original (RoPE, transformers' sdpa under continuous batching, which
builds its own block-diagonal mask) and the converted one (hf_alibi's paged path on alibi_sdpa: the bias and the
per-request mask built once per forward and layer kind). Both get the same ``ContinuousBatchingConfig`` (a cache
sized for the workload, so that neither spends its time filling an oversized mask) and the same requests (prompt
lengths spread over ``--prompt`` tokens), greedy. Tokens/s = generated tokens / wall time of one ``generate_batch``
call (manager set-up included), interleaved (each model once per round), median of ``--repeats`` rounds after one
warm-up round, fp32, ``--threads`` threads.

    python benchmarks/continuous_batching.py                 # 4 layers, width 128, 16 requests x 64 new tokens
    python benchmarks/continuous_batching.py --requests 32 --new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(args, alibi: bool) -> torch.nn.Module:
    from builders import build_model

    import hf_alibi

    model = build_model(
        "llama", layers=args.layers, heads=args.heads, width=args.width, positions=args.prompt, vocab=1000,
        dropout=False, num_key_value_heads=max(1, args.heads // 2), intermediate_size=4 * args.width,
    ).eval()  # fmt: skip
    return hf_alibi.patch_model(model) if alibi else model


def requests(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.linspace(args.prompt // 4, args.prompt, args.requests).long().tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def run(model, prompts, args) -> float:
    """Generated tokens per second of one generate_batch call."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    tokens_per_request = args.prompt + args.new_tokens
    config = ContinuousBatchingConfig(
        page_size=64, num_blocks=-(-args.requests * tokens_per_request // 64) + args.requests,
        max_batch_tokens=args.batch_tokens, max_requests_per_batch=args.requests,
    )  # fmt: skip
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=config)
    elapsed = time.perf_counter() - start
    generated = [len(o.generated_tokens) for o in outputs.values() if o.error is None]
    if len(generated) != len(prompts) or set(generated) != {args.new_tokens}:
        raise RuntimeError(f"generate_batch did not answer every request in full: {generated}")
    return sum(generated) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128, help="the longest prompt; the others spread down to 1/4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=256, help="ContinuousBatchingConfig.max_batch_tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()
    models = {"original": build(args, alibi=False), "alibi": build(args, alibi=True)}
    prompts = requests(args)
    for model in models.values():  # warm-up round, not counted
        run(model, prompts, args)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            rates[name].append(run(model, prompts, args))
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"llama {args.layers} layers, width {args.width}, {args.heads} heads; {args.requests} requests "
        f"({min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens) x {args.new_tokens} new tokens; "
        f"max_batch_tokens {args.batch_tokens}; {args.threads} thread(s); median of {args.repeats}"
    )
    for name in models:
        print(f"{name:>9}: {median[name]:8.1f} tokens/s  ({', '.join(f'{r:.1f}' for r in rates[name])})")
    print(f"ratio alibi / original: {median['alibi'] / median['original']:.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
