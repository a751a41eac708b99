"""A converted model in llama.cpp against itself in transformers: perplexity at 1x to 8x the training length,
and generation speed, in one run.

The model (default: the main job's, ``out/main_job``; see README, "On a fresh machine") is exported to GGUF
in each ``--outtypes`` (``hf_alibi.export_gguf``) and run by llama.cpp (PyPI ``llama-cpp-python``, F32 KV cache,
one thread as transformers here). Perplexity: the same non-overlapping windows of each length, cut from the
embedded corpus' test split (or ``--text``), every token after the first scored, in both runtimes. Speed:
greedy generation of ``--new-tokens`` after a ``--prompt``-token prompt, with the KV cache, transformers and
llama.cpp interleaved, median of ``--repeats``.

    python scripts/run_clm.py ... --output_dir out/main_job        # README's main job
    python benchmarks/gguf_export.py                                       # docs/sharing.md's table
    python benchmarks/gguf_export.py --model my-alibi-llama --lengths 256 512 1024 2048 --outtypes f32 q8_0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def windows(ids: list[int], length: int, count: int) -> list[list[int]]:
    return [ids[i * length : (i + 1) * length] for i in range(min(count, len(ids) // length))]


def nll(logits: np.ndarray, window: list[int]) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of ``window[1:]`` and its count, float64."""
    logits = logits[: len(window) - 1].astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    return float((log_z - logits[np.arange(len(window) - 1), window[1:]]).sum()), len(window) - 1


def transformers_logits(model, window: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([window])).logits[0].float().numpy()


def llama_logits(llm, window: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(window)
    return np.asarray(llm.scores[: len(window)])


def perplexity(logits_of, pieces: list[list[int]]) -> float:
    total, count = 0.0, 0
    for window in pieces:
        value, n = nll(logits_of(window), window)
        total, count = total + value, count + n
    return float(np.exp(total / count))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "out", "main_job"), help="a converted folder")
    parser.add_argument("--trained", type=int, default=128, help="the training length (the main job's block size)")
    parser.add_argument("--lengths", nargs="*", type=int, help="default: 1x, 2x, 4x, 8x --trained")
    parser.add_argument("--outtypes", nargs="*", default=["f32", "f16", "q8_0"])
    parser.add_argument("--text", help="a text file to measure on (default: the embedded corpus' test split)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per length, at most")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_alibi

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trained = args.trained
    lengths = args.lengths or [trained * k for k in (1, 2, 4, 8)]
    if args.text:
        text = Path(args.text).read_text()
    else:
        from hf_alibi.train.data import embedded_corpus

        text = "\n\n".join(embedded_corpus()["test"]["text"])
    ids = tokenizer(text)["input_ids"]
    folder = Path(tempfile.mkdtemp(prefix="gguf-bench-"))
    runtimes = {}
    for outtype in args.outtypes:
        path = hf_alibi.export_gguf(args.model, folder / f"model-{outtype}.gguf", outtype=outtype)
        runtimes[outtype] = llama_cpp.Llama(
            model_path=str(path), n_ctx=max(lengths) + args.prompt + args.new_tokens, logits_all=True,
            verbose=False, n_threads=args.threads, type_k=0, type_v=0, flash_attn=False,
        )  # fmt: skip
    print(f"# {args.model}: trained at {trained} tokens; torch {torch.__version__}, llama-cpp-python "
          f"{llama_cpp.__version__}; {args.threads} thread(s); up to {args.tokens} tokens per length")  # fmt: skip
    head = " | ".join(f"llama.cpp {t} (ratio)" for t in args.outtypes)
    print(f"| length | transformers | {head} |")
    print("|---|---|" + "---|" * len(args.outtypes))
    for length in lengths:
        pieces = windows(ids, length, max(1, args.tokens // length))
        reference = perplexity(lambda w: transformers_logits(model, w), pieces)
        cells = []
        for llm in runtimes.values():
            value = perplexity(lambda w, llm=llm: llama_logits(llm, w), pieces)
            cells.append(f"{value:.3f} ({value / reference:.4f})")
        print(f"| {length} ({length // trained}x) | {reference:.3f} | {' | '.join(cells)} |", flush=True)

    prompt = ids[: args.prompt]
    times: dict[str, list[float]] = {"transformers": [], **{t: [] for t in runtimes}}
    for _ in range(args.repeats):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           do_sample=False)  # fmt: skip
        times["transformers"].append(time.perf_counter() - start)
        for outtype, llm in runtimes.items():
            llm.reset()
            start = time.perf_counter()
            for n, _token in enumerate(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0), start=1):
                if n == args.new_tokens:
                    break
            times[outtype].append(time.perf_counter() - start)
    rate = {name: args.new_tokens / statistics.median(values) for name, values in times.items()}
    cells = " | ".join(f"{rate[t]:.0f} ({rate[t] / rate['transformers']:.2f}x)" for t in runtimes)
    print(f"\n| generation, tokens/s ({args.prompt} + {args.new_tokens}) | transformers | {head} |")
    print("|---|---|" + "---|" * len(args.outtypes))
    print(f"| median of {args.repeats}, interleaved | {rate['transformers']:.0f} | {cells} |")


if __name__ == "__main__":
    main()
