"""Models trained with ALiBi (BLOOM, MPT, Falcon-RW): transformers' own implementation against hf_alibi's.

Per model and dtype, one model is built (benchmarks/builders.py) and a deep copy of it is patched
(``hf_alibi.patch_model``: the same weights, attention on hf_alibi's sdpa path, the fold). transformers' arm runs its
own default: eager for BLOOM and MPT (their only implementation), sdpa for Falcon (whose ALiBi then rides in a dense
``(B, H, q, kv)`` float mask). MPT's own code cannot run past ``max_seq_len``: every model is built with the longest
length measured. The two arms are timed interleaved and each figure is the median of ``--repeats``, on one thread.

Rows, hf_alibi / transformers: generation tokens/s (greedy, with the cache; above 1 is faster; measured first, each
arm from two copies, median of at least 7); the train step (forward + backward) time at each ``--train-lengths``; the
forward's peak memory (no grad; measured as benchmarks/overhead.py does: the resident set's peak above the set before
the call) at each ``--memory-lengths``. The goals: train <= 0.60 at 2048 and <= 0.45 at 4096, memory <= 0.25
at 4096, generation >= 1.0.

    python benchmarks/native.py --quick     # a minute: short lengths, one repeat
    python benchmarks/native.py             # docs/performance.md, "Native ALiBi models"
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import warnings

import torch
from builders import build_model
from overhead import MMAP_ENV, _ids, _rss_kb, generate_rate, interleave, machine_line, median, train_step

TYPES = ("bloom", "mpt", "falcon")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ARMS = ("transformers", "hf_alibi")


def forward_peak(model, ids: torch.Tensor) -> float:
    """Peak MB above the resident set before one forward without gradients (benchmarks/overhead.py's measure)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _rss_kb("VmRSS")
    with torch.no_grad():
        model(input_ids=ids)
    return (_rss_kb("VmHWM") - before) / 1024


def build_arms(model_type: str, dtype: torch.dtype, args) -> dict[str, torch.nn.Module]:
    """transformers' model and hf_alibi's copy of it (the same weights), in ``dtype``."""
    import hf_alibi

    longest = max([*args.train_lengths, *args.memory_lengths, args.prompt + args.new_tokens])
    original = build_model(
        model_type, layers=args.layers, heads=args.heads, width=args.width, positions=longest, vocab=args.vocab,
        attn=None, dropout=False,
    )  # fmt: skip
    patched = hf_alibi.patch_model(copy.deepcopy(original))
    return {"transformers": original.to(dtype), "hf_alibi": patched.to(dtype)}


def run(model_type: str, dtype_name: str, args) -> None:
    models = build_arms(model_type, DTYPES[dtype_name], args)
    backend = models["transformers"].config._attn_implementation

    def row(measure: str, length, values: dict, unit: str, fmt: str = "{:.0f}") -> None:
        ratio = values["hf_alibi"] / values["transformers"]
        cells = " | ".join(fmt.format(values[arm]) + f" {unit}" for arm in ARMS)
        print(
            f"| {model_type} ({backend}) | {dtype_name} | {measure} | {length} | {ratio:.3f} | {cells} |", flush=True
        )

    # Generation first, on fresh models, each arm from two copies (the second pair copied in the opposite order) and
    # at least 7 repeats: after the long steps below (GBs allocated and freed by transformers' arm), and with a single
    # copy, one arm's tokens/s moved by up to 25% between runs of the same code (where a model lies in memory)
    copies = {"hf_alibi 2": copy.deepcopy(models["hf_alibi"]), "transformers 2": copy.deepcopy(models["transformers"])}
    generating = {name: model.eval() for name, model in {**models, **copies}.items()}
    prompt = _ids(args.batch, args.prompt, args.vocab)
    interleave(lambda m: generate_rate(m, prompt, 8), generating, 1)  # warm-up
    results = interleave(lambda m: generate_rate(m, prompt, args.new_tokens), generating, max(args.repeats, 7))
    rates = {arm: median(results[arm] + results[f"{arm} 2"]) for arm in ARMS}
    row("generation tokens/s", f"{args.prompt}+{args.new_tokens}", rates, "")
    del copies, generating
    for model in models.values():
        model.train()
    for i, length in enumerate(args.train_lengths):
        batch = {"input_ids": _ids(args.batch, length, args.vocab), "labels": _ids(args.batch, length, args.vocab)}
        if i == 0:  # warm-up, once per model: a longer step pays no first-call costs (a minute saved per model)
            interleave(lambda m, b=batch: train_step(m, b), models, 1)
        results = interleave(lambda m, b=batch: train_step(m, b), models, args.repeats)
        row("train step", length, {k: median([s for s, _ in v]) * 1000 for k, v in results.items()}, "ms")
    for model in models.values():
        model.eval()
    for length in args.memory_lengths:
        ids = _ids(args.batch, length, args.vocab)
        results = interleave(lambda m, i=ids: forward_peak(m, i), models, args.repeats)
        row("forward peak memory", length, {k: median(v) for k, v in results.items()}, "MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="*", default=list(TYPES), choices=TYPES)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=sorted(DTYPES))
    parser.add_argument("--train-lengths", nargs="*", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--memory-lengths", nargs="*", type=int, default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="1: robust on a shared machine")
    parser.add_argument("--quick", action="store_true", help="short lengths, one repeat: a check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.train_lengths, args.memory_lengths, args.repeats, args.new_tokens = [256, 512], [512], 1, 16

    if os.environ.get(MMAP_ENV) is None and sys.platform.startswith("linux"):
        # glibc then returns freed tensors to the OS at once: the resident set follows the live tensors
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, MMAP_ENV: "65536"})
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    import hf_alibi

    print(
        f"# torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s), batch "
        f"{args.batch}, {args.layers} layers, {args.heads} heads, width {args.width}, vocab {args.vocab}, median of "
        f"{args.repeats}, interleaved; hf_alibi (sdpa, the fold) from {os.path.dirname(hf_alibi.__file__)}"
    )
    print(machine_line())
    print(
        "| model (transformers' backend) | dtype | measure | L | hf_alibi / transformers | transformers | hf_alibi |"
    )
    print("|---|---|---|---|---|---|---|")
    for model_type in args.types:
        for dtype_name in args.dtypes:
            run(model_type, dtype_name, args)


if __name__ == "__main__":
    main()
