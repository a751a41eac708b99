"""A checkpoint loaded through its remote code costs what the library-loaded one costs.

One ALiBi GPT-2 is saved, then loaded twice in this process: with hf_alibi's registered classes
(``AutoModelForCausalLM.from_pretrained``) and with the checkpoint's own code (the class ``auto_map``
names, from transformers' dynamic-module loader: what ``trust_remote_code=True`` runs without hf_alibi).
Both are timed with the unpatched GPT-2 (``wpe``) for a training step (forward + backward), interleaved,
median of ``--repeats``; the attention path each took is printed too.

    python benchmarks/remote_code.py                      # L = 1024 and 2048, 1 thread
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from builders import build_model
from transformers import AutoModelForCausalLM, GPT2LMHeadModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module

import hf_alibi


def step_seconds(model, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    unpatched = build_model(
        "gpt2", layers=2, heads=4, width=256, positions=max(args.lengths), vocab=1000, dropout=False
    )
    with tempfile.TemporaryDirectory() as folder:  # the converted model: the next weights of the same seed
        hf_alibi.patch_model(GPT2LMHeadModel(unpatched.config)).save_pretrained(folder)
        library = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
        remote_cls = get_class_from_dynamic_module("modeling_alibi.AlibiGPT2LMHeadModel", folder)
        remote = remote_cls.from_pretrained(folder, attn_implementation="sdpa")
    models = {"unpatched": unpatched, "library": library, "remote code": remote}
    print(f"# torch {torch.__version__}, {args.threads} thread(s), GPT-2 2 layers x 4 heads x 256, batch 1, "
          f"median of {args.repeats}; remote class from {type(remote).__module__}")  # fmt: skip
    print("| L | unpatched | library | remote code | remote / library | paths (library, remote) |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        ids = torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(length))
        times = {name: [] for name in models}
        for model in models.values():  # warm-up
            step_seconds(model, ids)
        for _ in range(args.repeats):
            for name, model in models.items():
                times[name].append(step_seconds(model, ids))
        med = {name: statistics.median(values) for name, values in times.items()}
        paths = [sorted({m.last_path for m in model.modules() if type(m).__name__ == "AlibiBias"})
                 for model in (library, remote)]  # fmt: skip
        lib, rem, base = med["library"], med["remote code"], med["unpatched"]
        print(f"| {length} | {base * 1e3:.0f} ms | {lib * 1e3:.0f} ms ({lib / base:.3f}) | "
              f"{rem * 1e3:.0f} ms ({rem / base:.3f}) | {rem / lib:.3f} | {paths} |")  # fmt: skip


if __name__ == "__main__":
    main()
