"""What ALiBi costs: each registered architecture, ALiBi model / the same model unpatched.

For every ``hf_alibi.supported_model_types()`` entry that has a builder below, and L in 512, 1024,
2048: one training step (forward + backward) time and peak memory, ALiBi / unpatched (same
attention implementation, the unpatched model with its own position path, e.g. GPT-2's ``wpe``);
then forward-only time at 4096 and cached generation tokens/s (each arm from two copies, built in opposite
orders: a model's place in memory moves that figure). Models are timed interleaved
(ALiBi, unpatched, ALiBi, ...) and each figure is the median of ``--repeats`` runs, so load from
other processes hits both sides alike. The "bias" column is the ALiBi model forced onto the
bias-tensor path (``HF_ALIBI_PATH=bias``), to show what the automatic choice saves. The "flex"
column is the ALiBi model on ``flex_attention`` (forward only: torch has no FlexAttention backward on
CPU, and its CPU kernel is the unfused one). ``--dtype bf16`` / ``fp16`` casts every model (weights
and activations) to that dtype: the automatic path is then the half-precision fold.

The header names the processor and whether subnormal floats are slow on it (ALiBi's far keys make the
attention kernels compute them; hf_alibi flushes them to zero inside its kernels, see
hf_alibi/core/denormals.py). ``HF_ALIBI_FLUSH_DENORMALS=0`` turns that off, to measure what it saves.

Threads: 1 by default. On a machine shared with other jobs, two OpenMP threads wait on each other
at every op (steps ran 3 to 6 times slower and ratios moved by +-30%); one thread does not.

Peak memory on CPU: the process's peak resident set (``VmHWM``), reset before each step by
writing 5 to ``/proc/self/clear_refs``, minus the resident set just before the step. The script
re-runs itself with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns every freed tensor to
the OS at once and the resident set follows the live tensors (Linux only).

    python benchmarks/overhead.py                 # tiny GPT-2, fp32 (a few minutes on 2 cores)
    python benchmarks/overhead.py --lengths 512 --repeats 3 --types gpt2
    python benchmarks/overhead.py --types gpt2 --dtype bf16 --lengths 512 1024 2048 4096 --forward-length 8192
    python benchmarks/overhead.py --constructions --layers 6 --width 384 --heads 6 --batch 2 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from builders import build_model

# this checkout's hf_alibi, not another installed copy (a script's own folder heads sys.path, not the cwd)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


@dataclass
class Built:
    model: torch.nn.Module
    batch: Callable[[int], dict]  # L -> model kwargs for a training step (with labels)
    generates: bool  # a causal LM: cached generation is measured


def _ids(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(length))


def _shape(max_len: int, args) -> dict:
    return dict(layers=args.layers, heads=args.heads, width=args.width, positions=max_len, vocab=args.vocab)


def build_gpt2(alibi: bool, max_len: int, args) -> Built:
    model = build_model("gpt2", **_shape(max_len, args), attn=args.attn, dropout=False)
    return Built(_convert(model, alibi), lambda n: _lm_batch(n, args), generates=True)


def build_gpt_neox(alibi: bool, max_len: int, args) -> Built:
    model = build_model(
        "gpt_neox", **_shape(max_len, args), attn=args.attn, dropout=False, intermediate_size=4 * args.width
    )
    return Built(_convert(model, alibi), lambda n: _lm_batch(n, args), generates=True)


def build_llama(alibi: bool, max_len: int, args) -> Built:
    """Llama with grouped-query attention: half as many KV heads as query heads."""
    model = build_model(
        "llama", **_shape(max_len, args), attn=args.attn, dropout=False,
        num_key_value_heads=max(1, args.heads // 2), intermediate_size=4 * args.width,
    )  # fmt: skip
    return Built(_convert(model, alibi), lambda n: _lm_batch(n, args), generates=True)


def build_bert(alibi: bool, max_len: int, args) -> Built:
    model = build_model(
        "bert", **_shape(max_len, args), attn=args.attn, dropout=False, intermediate_size=4 * args.width
    )
    return Built(_convert(model, alibi, encoder_variant="symmetric"), lambda n: _lm_batch(n, args), generates=False)


def _lm_batch(length: int, args) -> dict:
    ids = _ids(args.batch, length, args.vocab)
    return {"input_ids": ids, "labels": ids}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _convert(model, alibi: bool, **options):
    if alibi:
        import hf_alibi

        hf_alibi.patch_model(model, **options)
    return model.to(DTYPES[_ARGS.dtype]).train()


_ARGS = argparse.Namespace(dtype="fp32")  # main() replaces it with the parsed arguments


# model_type -> builder(alibi, max_len, args). A new architecture needs one entry here.
BUILDERS: dict[str, Callable] = {
    "gpt2": build_gpt2, "gpt_neox": build_gpt_neox, "llama": build_llama, "bert": build_bert,
}  # fmt: skip


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def train_step(model, batch) -> tuple[float, float]:
    """(seconds, peak MB above the resident set before the step) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _rss_kb("VmRSS")
    start = time.perf_counter()
    model(**batch).loss.backward()
    seconds = time.perf_counter() - start
    peak = _rss_kb("VmHWM")
    model.zero_grad(set_to_none=True)
    return seconds, (peak - before) / 1024


def forward_time(model, ids) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids)
    return time.perf_counter() - start


def generate_rate(model, prompt, new_tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return new_tokens / (time.perf_counter() - start)


def interleave(measure: Callable, models: dict, repeats: int) -> dict[str, list]:
    results = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            results[name].append(measure(model))
    return results


def median(values):
    return statistics.median(values)


def run_type(model_type: str, args) -> list[str]:
    import hf_alibi

    builder = BUILDERS[model_type]
    max_len = max([*args.lengths, args.forward_length])
    alibi, plain = builder(True, max_len, args), builder(False, max_len, args)
    bias = builder(True, max_len, args)
    hf_alibi.set_attention_path(bias.model, "bias")
    models = {"alibi": alibi.model, "plain": plain.model, "bias": bias.model}
    flex = None
    if args.flex and args.attn == "sdpa":
        flex = builder(True, max_len, args).model
        flex.config._attn_implementation_internal = "flex_attention"  # dispatches to hf_alibi's flex function
    rows = []
    flex_train = "no CPU backward" if flex is not None else "n/a"
    for length in args.lengths:
        batch = alibi.batch(length)
        interleave(lambda m, b=batch: train_step(m, b), models, 1)  # warm-up
        res = interleave(lambda m, b=batch: train_step(m, b), models, args.repeats)
        t = {k: median([s for s, _ in v]) for k, v in res.items()}
        mem = {k: median([mb for _, mb in v]) for k, v in res.items()}
        rows.append(
            f"| {model_type} | train fwd+bwd | {length} | {t['alibi'] / t['plain']:.3f} | "
            f"{mem['alibi'] / mem['plain']:.3f} | {mem['alibi'] - mem['plain']:+.0f} | "
            f"{t['bias'] / t['plain']:.3f} | {mem['bias'] / mem['plain']:.3f} | {flex_train} | "
            f"{t['plain'] * 1000:.0f} ms, {mem['plain']:.0f} MB |"
        )
        print(rows[-1], flush=True)
    for model in models.values():
        model.eval()
    forward_models = dict(models)
    if flex is not None:
        forward_models["flex"] = flex.eval()
    ids = _ids(1, args.forward_length, args.vocab)
    interleave(lambda m: forward_time(m, ids), forward_models, 1)
    res = interleave(lambda m: forward_time(m, ids), forward_models, args.repeats)
    t = {k: median(v) for k, v in res.items()}
    flex_column = f"{t['plain'] / t['flex']:.3f}" if "flex" in t else "n/a"
    rows.append(
        f"| {model_type} | forward, throughput | {args.forward_length} | {t['plain'] / t['alibi']:.3f} | | | "
        f"{t['plain'] / t['bias']:.3f} | | {flex_column} | {t['plain'] * 1000:.0f} ms |"
    )
    print(rows[-1], flush=True)
    if alibi.generates:
        # a second copy of each arm, built in the opposite order (ALiBi first above, the unpatched model first here):
        # where a model lands in memory moved one generation figure by 1-2% on the 2-core machines (two unpatched
        # copies differ by that much), so each arm's tokens/s is the median over both of its copies
        second = {"plain 2": builder(False, max_len, args).model, "alibi 2": builder(True, max_len, args).model}
        gen_models = {**models, **{name: model.eval() for name, model in second.items()}}
        prompt = _ids(1, args.prompt, args.vocab)
        interleave(lambda m: generate_rate(m, prompt, 8), gen_models, 1)
        res = interleave(lambda m: generate_rate(m, prompt, args.new_tokens), gen_models, args.repeats)
        r = {k: median(v + res.get(f"{k} 2", [])) for k, v in res.items() if k not in second}
        rows.append(
            f"| {model_type} | generate, tokens/s | {args.prompt}+{args.new_tokens} | "
            f"{r['alibi'] / r['plain']:.3f} | | | "
            f"{r['bias'] / r['plain']:.3f} | | | {r['plain']:.0f} tok/s |"
        )
        print(rows[-1], flush=True)
    return rows


def compare_constructions(args) -> None:
    """GPT-2 train step: the fold's "row" construction (the automatic one on CPU) and its "channel"
    construction (the fold before the row existed), each / the unpatched model, interleaved."""
    import hf_alibi.core.folded as attention

    automatic = attention.fold_construction
    max_len = max(args.lengths)
    models = {
        "plain": build_gpt2(False, max_len, args).model,
        "row": build_gpt2(True, max_len, args).model,
        "channel": build_gpt2(True, max_len, args).model,
    }

    def step(name, model, batch):
        attention.fold_construction = (lambda *a, **k: attention.CHANNEL) if name == "channel" else automatic
        try:
            return train_step(model, batch)[0]
        finally:
            attention.fold_construction = automatic

    print("| L | row / unpatched | channel / unpatched | unpatched |")
    print("|---|---|---|---|")
    for length in args.lengths:
        batch = _lm_batch(length, args)
        for name, model in models.items():  # warm-up
            step(name, model, batch)
        times = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                times[name].append(step(name, model, batch))
        t = {k: median(v) for k, v in times.items()}
        print(
            f"| {length} | {t['row'] / t['plain']:.3f} | {t['channel'] / t['plain']:.3f} | "
            f"{t['plain'] * 1000:.0f} ms |",
            flush=True,
        )


def processor() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def subnormal_penalty(repeats: int = 9) -> float:
    """SDPA forward + backward with a steep ALiBi row as mask (the far keys' weights are subnormal), without /
    with flush-to-zero on every thread (hf_alibi's scope, denormals.py): about 1.0 where subnormals cost nothing,
    up to 2 where the processor computes them in microcode. Interleaved, median of ``repeats``."""
    from hf_alibi.core import denormals

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g, requires_grad=True) for _ in range(3))
    row = (torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None] * torch.arange(1024.0)).view(1, 4, 1, 1024)

    def step() -> float:
        start = time.perf_counter()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=row, is_causal=True)
        out.sum().backward()
        return time.perf_counter() - start

    def flushed_step() -> float:
        with denormals.flushed(q):
            return step()

    times = {"plain": [], "flushed": []}
    step(), flushed_step()  # warm up
    for _ in range(repeats):
        times["plain"].append(step())
        times["flushed"].append(flushed_step())
    return statistics.median(times["plain"]) / statistics.median(times["flushed"])


def machine_line() -> str:
    from hf_alibi.core import denormals

    if not denormals.available():
        return f"# {processor()}: hf_alibi cannot scope flush-to-zero here (not x86-64 Linux with GNU OpenMP)"
    penalty = subnormal_penalty()
    verdict = "SLOW (hf_alibi flushes them in its kernels)" if penalty > 1.15 else "not slow"
    switch = os.environ.get("HF_ALIBI_FLUSH_DENORMALS", "1") != "0"
    return (
        f"# {processor()}: subnormals {verdict}: the kernel with ALiBi's far keys takes {penalty:.2f}x its time "
        f"with flush-to-zero; hf_alibi's flush {'on' if switch else 'OFF (HF_ALIBI_FLUSH_DENORMALS=0)'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every registered one with a builder)")
    parser.add_argument("--lengths", nargs="*", type=int, default=[512, 1024, 2048])
    parser.add_argument("--forward-length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="1: robust on a shared machine")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights and activations")
    parser.add_argument("--no-flex", dest="flex", action="store_false", help="skip the flex_attention column")
    parser.add_argument(
        "--constructions", action="store_true", help="GPT-2 only: the fold's row vs channel construction"
    )
    args = parser.parse_args()
    global _ARGS
    _ARGS = args

    if os.environ.get(MMAP_ENV) is None and sys.platform.startswith("linux"):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, MMAP_ENV: "65536"})
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    import transformers

    import hf_alibi

    registered = hf_alibi.supported_model_types()
    types = args.types or registered
    print(
        f"# torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
        f"{args.attn}, batch {args.batch}, {args.layers} layers, {args.heads} heads, width {args.width}, "
        f"{args.dtype}, median of {args.repeats}, interleaved; hf_alibi from {os.path.dirname(hf_alibi.__file__)}"
    )
    print(machine_line())  # a figure read off another processor may not hold here (subnormals)
    if args.constructions:
        compare_constructions(args)
        return
    print(
        "| model | measure | L | ALiBi/unpatched time | memory | extra MB | bias path: time | memory | flex: time "
        "| unpatched |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model_type in types:
        if model_type not in BUILDERS:
            print(f"| {model_type} | no builder in benchmarks/overhead.py BUILDERS: skipped | | | | | | | | |")
            continue
        if model_type not in registered:
            print(f"| {model_type} | not registered with hf_alibi: skipped | | | | | | | | |")
            continue
        run_type(model_type, args)


if __name__ == "__main__":
    main()
