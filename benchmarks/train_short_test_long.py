#!/usr/bin/env python
"""Train short, test long: ALiBi GPT-2 against learned positions (GPT-2) and rotary (GPT-NeoX).

Mode ``extrapolation`` (default): on the same data, token batches and seed, trains
  (a) ALiBi GPT-2, (b) unpatched GPT-2 (learned positions, n_positions = L), (c) unpatched GPT-NeoX
  (rotary), (d) ALiBi Llama and (e) unpatched Llama (rotary; the same Llama built from the same seed,
  converted or not), all at length L, then evaluates each at L, 2L, 4L, 8L on the embedded corpus's
  validation split, both protocols, and prints ppl(kL) / ppl(L) side by side. ``--arms`` picks a subset.
Mode ``train-short``: ALiBi trained at L/4 (``train_sequence_length_scaling = 0.25``: the same
  batches of L-token blocks, reshaped) against unpatched GPT-2 trained at L. Both are evaluated at L
  every ``--eval_every`` steps; prints the training wall-clock (evaluation excluded) and the peak memory
  each needed to reach the unpatched model's final perplexity at L, and their ratio.

Each arm trains in its own process (so its peak RSS is its own), one after the other. The machine
may be shared: wall-clock ratios are only as good as the machine's quiet.

    python benchmarks/train_short_test_long.py --mode extrapolation --length 64 --steps 600
    python benchmarks/train_short_test_long.py --mode train-short --length 128 --steps 600
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import time
from itertools import chain

import torch
from builders import build_model

import hf_alibi
from hf_alibi.evaluate import evaluate_lengths, evaluate_perplexity
from hf_alibi.train.data import embedded_corpus, embedded_tokenizer
from hf_alibi.train.length_scaling import scale_sequence_length

EXTRAPOLATION_ARMS = ("alibi_gpt2", "gpt2", "gpt_neox", "alibi_llama", "llama")


def load_tokens(args):
    corpus = embedded_corpus()
    tokenizer = embedded_tokenizer(corpus, args.vocab_size)
    streams = {}
    for split, limit in (("train", args.train_tokens), ("validation", args.eval_tokens)):
        ids, total = [], 0
        for text in corpus[split]["text"]:
            piece = tokenizer(text)["input_ids"]
            ids.append(piece)
            total += len(piece)
            if total >= limit:
                break
        streams[split] = torch.tensor(list(chain(*ids))[:limit], dtype=torch.long)
    return streams, len(tokenizer)


def build(arch: str, args, vocab: int, length: int):
    shape = dict(layers=args.layers, heads=args.heads, width=args.width, positions=length, vocab=vocab, seed=args.seed)
    common = dict(bos_token_id=0, eos_token_id=0)
    if arch in ("alibi_gpt2", "gpt2"):
        model = build_model("gpt2", **shape, **common)
    elif arch == "gpt_neox":
        model = build_model(
            "gpt_neox", **shape, intermediate_size=4 * args.width, tie_word_embeddings=True,
            rotary_pct=args.rotary_pct, **common,
        )  # fmt: skip
    elif arch in ("alibi_llama", "llama"):
        model = build_model(
            "llama", **shape, num_key_value_heads=args.heads, intermediate_size=4 * args.width,
            tie_word_embeddings=True, **common,
        )  # fmt: skip
    else:
        raise ValueError(arch)
    if arch.startswith("alibi_"):
        hf_alibi.patch_model(model)
    return model


def batches(train: torch.Tensor, steps: int, batch: int, length: int, seed: int):
    """The same (batch, length) blocks for every arm: random offsets from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, train.numel() - length, (batch,), generator=generator)
        yield torch.stack([train[s : s + length] for s in starts.tolist()])


def lr_at(step: int, args) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_step(model, optimizer, ids, scaling, step, args):
    start = time.perf_counter()
    data = scale_sequence_length({"input_ids": ids, "labels": ids}, scaling)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    loss = model(**data).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, loss


def train_short_interleaved(args):
    """Both arms in one process, their steps interleaved (order alternating), each step timed: on a
    shared machine the load then falls on both arms alike. Peak memory needs --mode train-short."""
    torch.set_num_threads(args.threads)
    streams, vocab = load_tokens(args)
    arms = {"gpt2": 1.0, "alibi_gpt2": args.scaling}
    models = {arch: build(arch, args, vocab, args.length).train() for arch in arms}
    optimizers = {
        arch: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
        for arch, m in models.items()
    }
    probe = streams["validation"][: args.probe_tokens]
    seconds = dict.fromkeys(arms, 0.0)
    step_times = {arch: [] for arch in arms}
    curves = {arch: [] for arch in arms}
    for step, ids in enumerate(batches(streams["train"], args.steps, args.batch, args.length, args.seed)):
        for arch in list(arms) if step % 2 == 0 else list(arms)[::-1]:
            took, _ = train_step(models[arch], optimizers[arch], ids, arms[arch], step, args)
            seconds[arch] += took
            step_times[arch].append(took)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            for arch, model in models.items():
                ppl = evaluate_perplexity(model, probe, args.length, None, batch_size=8)["perplexity"]
                model.train()
                curves[arch].append({"step": step + 1, "train_seconds": seconds[arch], "ppl_at_L": ppl})
    base, alibi = curves["gpt2"], curves["alibi_gpt2"]
    target = base[-1]["ppl_at_L"]
    median = {arch: sorted(t)[len(t) // 2] for arch, t in step_times.items()}
    print(f"median step: unpatched GPT-2 at {args.length}: {median['gpt2'] * 1000:.1f} ms, ALiBi at "
          f"{int(args.length * args.scaling)}: {median['alibi_gpt2'] * 1000:.1f} ms, "
          f"ratio {median['alibi_gpt2'] / median['gpt2']:.3f}")  # fmt: skip
    print(f"unpatched GPT-2 at L={args.length}: final ppl at L {target:.2f} after {seconds['gpt2']:.1f} s")
    for name, curve in (("unpatched", base), ("ALiBi", alibi)):
        print(f"  {name:>9} ppl at L by step: " + ", ".join(f"{p['step']}: {p['ppl_at_L']:.1f}" for p in curve))
    reached = next((point for point in alibi if point["ppl_at_L"] <= target), None)
    if reached is None:
        print(f"ALiBi did NOT reach {target:.2f} within {args.steps} steps (final {alibi[-1]['ppl_at_L']:.2f})")
    else:
        print(f"ALiBi at L*{args.scaling:g}: reached ppl {reached['ppl_at_L']:.2f} <= {target:.2f} at step "
              f"{reached['step']}, {reached['train_seconds']:.1f} s: {reached['train_seconds'] / seconds['gpt2']:.3f} "
              f"of the baseline's training wall-clock")  # fmt: skip
    return {"curves": curves, "seconds": seconds, "median_step_seconds": median, "target_ppl": target}


def train_arm(arch, args, scaling, queue):
    torch.set_num_threads(args.threads)
    streams, vocab = load_tokens(args)
    model = build(arch, args, vocab, args.length).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    rss_before = peak_rss_mb()
    probe = streams["validation"][: args.probe_tokens]
    train_seconds, curve = 0.0, []
    for step, ids in enumerate(batches(streams["train"], args.steps, args.batch, args.length, args.seed)):
        seconds, loss = train_step(model, optimizer, ids, scaling, step, args)
        train_seconds += seconds
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            ppl = evaluate_perplexity(model, probe, args.length, None, batch_size=8)["perplexity"]
            model.train()
            curve.append({"step": step + 1, "train_seconds": train_seconds, "ppl_at_L": ppl})
    figures = {
        "arch": arch, "scaling": scaling, "train_length": int(args.length * scaling),
        "train_seconds": train_seconds, "peak_rss_mb": peak_rss_mb(), "rss_before_training_mb": rss_before,
        "curve": curve, "final_loss": loss.item(),
    }  # fmt: skip
    if args.mode == "extrapolation":
        lengths = [args.length * k for k in (1, 2, 4, 8)]
        figures["eval"] = evaluate_lengths(model, {"validation": streams["validation"]}, lengths, None, batch_size=4)
    queue.put(figures)


def run(arch, args, scaling=1.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=train_arm, args=(arch, args, scaling, queue))
    process.start()
    figures = queue.get()
    process.join()
    print(
        f"  {arch} (train length {figures['train_length']}): {figures['train_seconds']:.1f} s training, "
        f"final train loss {figures['final_loss']:.3f}, peak RSS {figures['peak_rss_mb']:.0f} MB",
        flush=True,
    )
    return figures


def extrapolation(args):
    arms = args.arms
    results = {arch: run(arch, args) for arch in arms}
    lengths = [args.length * k for k in (1, 2, 4, 8)]
    for protocol in ("nonoverlapping", "sliding"):
        print(
            f"\nvalidation, {protocol} (first {args.eval_tokens} tokens): ppl(kL) and ppl(kL)/ppl(L), L={args.length}"
        )
        print(f"{'length':>7}" + "".join(f" | {arch:>24}" for arch in arms))
        for n in lengths:
            row = f"{n:>7}"
            for arch in arms:
                figures = results[arch]["eval"]["splits"]["validation"][protocol]
                cell, base = figures[str(n)], figures[str(args.length)]
                text = (
                    f"{cell['perplexity']:.2f} ({cell['perplexity'] / base['perplexity']:.3f})"
                    if "perplexity" in cell
                    else "cannot run (n_positions)"
                )
                row += f" | {text:>24}"
            print(row)
    return results


def train_short(args):
    baseline = run("gpt2", args, 1.0)
    alibi = run("alibi_gpt2", args, args.scaling)
    target = baseline["curve"][-1]["ppl_at_L"]
    print(f"\nunpatched GPT-2 at L={args.length}: final ppl at L {target:.2f} after {baseline['train_seconds']:.1f} s")
    reached = next((point for point in alibi["curve"] if point["ppl_at_L"] <= target), None)
    alibi_final = alibi["curve"][-1]["ppl_at_L"]
    if reached is None:
        print(
            f"ALiBi at L*{args.scaling:g}: did NOT reach {target:.2f} within {args.steps} steps "
            f"(final {alibi_final:.2f})"
        )
    else:
        ratio = reached["train_seconds"] / baseline["train_seconds"]
        print(f"ALiBi at L*{args.scaling:g}={alibi['train_length']}: reached ppl {reached['ppl_at_L']:.2f} <= "
              f"{target:.2f} at step {reached['step']}, {reached['train_seconds']:.1f} s: {ratio:.3f} of the "
              f"baseline's wall-clock (final ppl at L {alibi_final:.2f})")  # fmt: skip
    for name, figures in (("unpatched GPT-2", baseline), ("ALiBi", alibi)):
        print(f"  {name}: peak RSS {figures['peak_rss_mb']:.0f} MB; during training +"
              f"{figures['peak_rss_mb'] - figures['rss_before_training_mb']:.0f} MB")  # fmt: skip
    print(f"  peak RSS ratio ALiBi / unpatched: {alibi['peak_rss_mb'] / baseline['peak_rss_mb']:.3f}")
    return {"baseline": baseline, "alibi": alibi, "target_ppl": target, "reached": reached}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mode", choices=["extrapolation", "train-short", "train-short-interleaved"], default="extrapolation"
    )
    parser.add_argument("--length", type=int, default=64, help="L: training length of the unpatched models")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--rotary_pct", type=float, default=0.25, help="GPT-NeoX's default (Pythia)")
    parser.add_argument("--scaling", type=float, default=0.25, help="train-short: ALiBi's sequence-length scaling")
    parser.add_argument("--train_tokens", type=int, default=2_000_000)
    parser.add_argument("--eval_tokens", type=int, default=16384)
    parser.add_argument("--probe_tokens", type=int, default=8192, help="train-short: tokens of the ppl-at-L probe")
    parser.add_argument(
        "--eval_every", type=int, default=0, help="train-short: probe every N steps (default steps/10)"
    )
    parser.add_argument(
        "--arms", nargs="+", choices=EXTRAPOLATION_ARMS, default=list(EXTRAPOLATION_ARMS), help="extrapolation: arms"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if args.mode.startswith("train-short") and not args.eval_every:
        args.eval_every = max(1, args.steps // 10)
    print(
        f"{args.mode}: L={args.length}, {args.steps} steps x {args.batch} x {args.length} tokens, "
        f"{args.layers} layers, width {args.width}, {args.heads} heads, vocab {args.vocab_size}",
        flush=True,
    )
    modes = {
        "extrapolation": extrapolation,
        "train-short": train_short,
        "train-short-interleaved": train_short_interleaved,
    }
    results = modes[args.mode](args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
