"""What sinks cost on the sdpa fold: forward time of a Llama, sink fold / plain fold / bias path / unpatched.

Four copies of one Llama (same weights): unpatched (RoPE, transformers' sdpa), ALiBi the paper's way
(the fold: CPU row construction without a mask, channel construction with one), ALiBi with the
"pretrained" preset (sinks: the fold's channel construction with two channel groups), and that preset
forced onto the bias path (an L x L float mask per forward). Timed interleaved (each model once per
round), median of ``--repeats`` rounds, forward only under ``torch.no_grad``, fp32, one thread.
``--padded`` gives the batch a left-padded row (a 2D mask: every ALiBi path then merges a mask).

    python benchmarks/sinks.py                       # 1024 and 2048 tokens, median of 5
    python benchmarks/sinks.py --lengths 1024 --padded
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


def build(args, **patch) -> torch.nn.Module:
    import transformers

    import hf_alibi

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads // 3, max_position_embeddings=512,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    if patch.pop("alibi", True):
        path = patch.pop("path", "auto")
        hf_alibi.patch_model(model, **patch)
        hf_alibi.set_attention_path(model, path)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--padded", action="store_true", help="a left-padded row: every path merges a 2D mask")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {
        "unpatched": build(args, alibi=False),
        "plain fold": build(args),
        "sink fold": build(args, preset="pretrained"),
        "sink bias": build(args, preset="pretrained", path="bias"),
    }
    print(f"fp32, {args.layers} layers, width {args.width}, {args.heads} heads, batch {args.batch}, "
          f"padded={args.padded}, median of {args.repeats}, interleaved; seconds and ratio to unpatched")  # fmt: skip
    for length in args.lengths:
        batch = max(args.batch, 2) if args.padded else args.batch
        ids = torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        if args.padded:
            mask[1, : length // 8] = 0
        inputs = {"input_ids": ids, "attention_mask": mask if args.padded else None}
        times: dict[str, list[float]] = {name: [] for name in models}
        with torch.no_grad():
            for model in models.values():  # warm-up
                model(**inputs)
            for _ in range(args.repeats):
                for name, model in models.items():
                    start = time.perf_counter()
                    model(**inputs)
                    times[name].append(time.perf_counter() - start)
        base = statistics.median(times["unpatched"])
        paths = {name: sorted({m.last_path for m in model.modules() if hasattr(m, "last_path")})
                 for name, model in models.items()}  # fmt: skip
        cells = [f"{name} {statistics.median(t):.3f}s ({statistics.median(t) / base:.2f}x, {paths[name]})"
                 for name, t in times.items()]  # fmt: skip
        print(f"L={length}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
