#!/usr/bin/env python
"""Recovering a pretrained checkpoint after conversion, measured.

For each model (a BERT pretrained with MLM, a GPT-2 with learned positions, a GPT-NeoX with rotary),
on the embedded corpus (the interpreter's standard library source; BPE tokenizer trained on it):

1. pretrain the original with its own position path at length L (cached under hf_alibi.train.data's cache
   dir, ``recover-bench/``), and measure how much worse it gets with that path zeroed (GPT-2/BERT: the
   position table set to 0; NeoX: rotary frequencies set to 0, i.e. no rotation);
2. convert a copy and recover it by self-distillation (``hf_alibi.recover.recover``) for N steps;
3. print agreement with the original at L at 0, N/4, N steps (encoders: cosine of mean-pooled
   embeddings; LMs: KL and perplexity), and the recovered model's quality at 1x..8x L
   (LMs: perplexity, non-overlapping; encoders: retrieval accuracy: find the document a random passage
   was taken from among many documents of k x L tokens; the original truncates them to L);
4. the levers against plain distillation (same steps and data): warm start, attention-only first steps,
   ``encoder_variant`` and intermediate layers for BERT.

    PYTHONPATH=. python benchmarks/recover.py                       # everything (about 20-30 min CPU)
    PYTHONPATH=. python benchmarks/recover.py --models gpt2 --no-levers
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from itertools import chain
from pathlib import Path

import torch
import torch.nn.functional as F
from builders import build_model

from hf_alibi.evaluate import evaluate_perplexity
from hf_alibi.recover import mean_pooled, recover
from hf_alibi.train.data import default_cache_dir, embedded_corpus, embedded_tokenizer

MODELS = ("bert", "gpt2", "gpt_neox")


# ---------------------------------------------------------------------------------------------------- data


def load_data(args):
    corpus = embedded_corpus()
    tokenizer = embedded_tokenizer(corpus, args.vocab_size)
    eos = tokenizer.eos_token_id

    def stream(split, limit):
        ids, total = [], 0
        for text in corpus[split]["text"]:
            piece = tokenizer(text)["input_ids"] + [eos]
            ids.append(piece)
            total += len(piece)
            if total >= limit:
                break
        return torch.tensor(list(chain(*ids))[:limit], dtype=torch.long)

    # Retrieval documents: consecutive pieces of 8 L tokens of the test, then validation, split's files
    # (never trained on), at most two per file; a document of k L tokens is the first k L of a piece.
    docs, size = [], 8 * args.length
    for text in chain(corpus["test"]["text"], corpus["validation"]["text"]):
        ids = tokenizer(text)["input_ids"]
        for start in range(0, min(len(ids) - size + 1, 2 * size), size):
            docs.append(torch.tensor(ids[start : start + size]))
        if len(docs) >= args.docs:
            break
    docs = docs[: args.docs]
    return {
        "train": stream("train", args.train_tokens),
        "validation": stream("validation", args.eval_tokens),
        "docs": torch.stack(docs),
        "vocab": len(tokenizer),
    }


# ---------------------------------------------------------------------------------------------------- originals


def build(name: str, args, vocab: int):
    shape = dict(layers=args.layers, heads=args.heads, width=args.width, positions=args.length, seed=args.seed)
    common = dict(bos_token_id=0, eos_token_id=0)
    if name == "gpt2":
        return build_model("gpt2", **shape, vocab=vocab, **common)
    if name == "gpt_neox":
        return build_model(
            "gpt_neox", **shape, vocab=vocab, intermediate_size=4 * args.width, tie_word_embeddings=True,
            rotary_pct=args.rotary_pct, **common,
        )  # fmt: skip
    if name == "bert":  # vocab + 1: the last id is [MASK]
        return build_model(
            "bert", **shape, vocab=vocab + 1, intermediate_size=4 * args.width, pad_token_id=0, type_vocab_size=1
        )
    raise ValueError(name)


def mlm_batch(ids: torch.Tensor, mask_id: int, vocab: int, generator: torch.Generator, probability: float):
    """BERT's masking: ``probability`` of the tokens are targets; of those 80% [MASK], 10% random, 10% kept."""
    labels = ids.clone()
    chosen = torch.rand(ids.shape, generator=generator) < probability
    labels[~chosen] = -100
    inputs = ids.clone()
    roll = torch.rand(ids.shape, generator=generator)
    inputs[chosen & (roll < 0.8)] = mask_id
    random_tokens = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[random_tokens] = torch.randint(0, vocab, ids.shape, generator=generator)[random_tokens]
    return inputs, labels


def pretrain(name: str, args, data) -> tuple:
    """The original, pretrained at L with its position path; cached by the settings."""
    key_fields = {k: getattr(args, k) for k in ("length", "layers", "heads", "width", "vocab_size", "rotary_pct")}
    steps, lr = (args.bert_pretrain_steps, args.bert_lr) if name == "bert" else (args.pretrain_steps, args.lr)
    key_fields.update(steps=steps, batch=args.batch, lr=lr, seed=args.seed, train=args.train_tokens)
    if name == "bert":
        key_fields["mlm_probability"] = args.mlm_probability
    key = hashlib.sha256(json.dumps([name, key_fields], sort_keys=True).encode()).hexdigest()[:12]
    folder = default_cache_dir() / "recover-bench" / f"{name}-{key}"
    cls = type(build(name, args, data["vocab"]))
    if (folder / "pretrain.json").exists():
        return cls.from_pretrained(folder, attn_implementation="sdpa").eval(), json.loads(
            (folder / "pretrain.json").read_text()
        )
    model = build(name, args, data["vocab"]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(args.seed)
    train, length = data["train"], args.length
    warmup = max(1, steps // 20)
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / steps)))
        starts = torch.randint(0, train.numel() - length, (args.batch,), generator=generator)
        ids = torch.stack([train[s : s + length] for s in starts.tolist()])
        if name == "bert":
            inputs, labels = mlm_batch(ids, data["vocab"], data["vocab"], generator, args.mlm_probability)
            loss = model(input_ids=inputs, labels=labels).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % max(1, steps // 5) == 0:
            print(f"  pretrain {name} step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    seconds = time.perf_counter() - start
    model.eval()
    info = {"seconds": round(seconds, 1), "steps": steps, "tokens": steps * args.batch * length}
    info.update(position_evidence(name, model, data, args))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "pretrain.json").write_text(json.dumps(info, indent=2))
    return model, info


@torch.no_grad()
def mlm_loss(model, stream: torch.Tensor, args, vocab: int) -> float:
    generator = torch.Generator().manual_seed(1234)
    windows = stream[: stream.numel() // args.length * args.length].view(-1, args.length)
    total, count = 0.0, 0
    for i in range(0, len(windows), 32):
        inputs, labels = mlm_batch(windows[i : i + 32], vocab, vocab, generator, args.mlm_probability)
        n = (labels != -100).sum().item()
        total += model(input_ids=inputs, labels=labels).loss.item() * n
        count += n
    return total / count


def _zeroed(model):
    import copy

    zeroed = copy.deepcopy(model)
    for name, module in zeroed.named_modules():
        if name.split(".")[-1] in ("wpe", "position_embeddings"):
            module.weight.data.zero_()
        if hasattr(module, "inv_freq"):  # rotary: frequency 0 rotates nothing
            module.inv_freq.zero_()
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq.zero_()
    return zeroed.eval()


def position_evidence(name: str, model, data, args) -> dict:
    """How much worse the original gets with its position path zeroed."""
    zeroed = _zeroed(model)
    val = data["validation"]
    if name == "bert":
        loss, loss_zero = mlm_loss(model, val, args, data["vocab"]), mlm_loss(zeroed, val, args, data["vocab"])
        windows = val[: val.numel() // args.length * args.length].view(-1, args.length)[:64]
        cosine = F.cosine_similarity(mean_pooled(model, windows), mean_pooled(zeroed, windows)).mean().item()
        return {"mlm_ppl": math.exp(loss), "mlm_ppl_zeroed": math.exp(loss_zero), "cosine_zeroed": cosine}
    n = (val.numel() - 1) // args.length * args.length + 1
    ppl = evaluate_perplexity(model, val[:n], args.length)["perplexity"]
    ppl_zero = evaluate_perplexity(zeroed, val[:n], args.length)["perplexity"]
    return {"ppl": ppl, "ppl_zeroed": ppl_zero}


# ---------------------------------------------------------------------------------------------------- retrieval


@torch.no_grad()
def retrieval_accuracy(model, docs: torch.Tensor, doc_length: int, passage: int, truncate: int | None, seed=0):
    """Top-1 accuracy of finding, by cosine of mean-pooled embeddings, the document (its first ``doc_length``
    tokens; the model reads its first ``truncate`` tokens when given) a random ``passage``-token piece
    of it was taken from, among all the documents."""
    generator = torch.Generator().manual_seed(seed)
    documents = docs[:, :doc_length]
    starts = torch.randint(0, doc_length - passage + 1, (len(docs),), generator=generator)
    queries = torch.stack([documents[i, s : s + passage] for i, s in enumerate(starts.tolist())])
    doc_emb = mean_pooled(model, documents[:, :truncate] if truncate else documents, batch_size=8)
    query_emb = mean_pooled(model, queries)
    scores = F.normalize(query_emb, dim=-1) @ F.normalize(doc_emb, dim=-1).T
    return (scores.argmax(-1) == torch.arange(len(docs))).float().mean().item()


# ---------------------------------------------------------------------------------------------------- recovery


def run_recovery(name, original, data, args, factors=(1, 2, 4, 8), **levers):
    result = recover(
        original,
        data["train"],
        length=args.length,
        max_steps=args.steps,
        batch_size=args.batch,
        learning_rate=args.recover_lr,
        eval_texts=data["validation"],
        max_eval_tokens=args.eval_tokens,
        eval_every=max(1, args.steps // 4),
        eval_factors=factors,
        seed=args.seed,
        progress=False,
        log=(lambda line: print("   ", line, flush=True)) if args.verbose else None,
        **levers,
    )
    return result


def summary_figure(name: str, figures: dict) -> str:
    if name == "bert":
        return f"cos {figures['cosine']:.4f}"
    return f"KL {figures['kl']:.4f}, ppl {figures['ppl']:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--length", type=int, default=64, help="L: the originals' maximum length")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--rotary_pct", type=float, default=1.0, help="NeoX rotary share (1.0: every dimension)")
    parser.add_argument("--pretrain_steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3, help="pretraining learning rate (GPT-2, NeoX)")
    parser.add_argument("--bert_pretrain_steps", type=int, default=1200, help="MLM has fewer targets per step")
    parser.add_argument("--bert_lr", type=float, default=1e-3)
    parser.add_argument(
        "--mlm_probability", type=float, default=0.4, help="share of MLM targets (40%%: Wettig et al. 2023)"
    )
    parser.add_argument("--steps", type=int, default=160, help="N: recovery steps")
    parser.add_argument("--recover_lr", type=float, default=5e-4)
    parser.add_argument("--train_tokens", type=int, default=1_000_000, help="the benchmark corpus (train)")
    parser.add_argument("--eval_tokens", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=128, help="retrieval: documents of 8 L tokens")
    parser.add_argument("--passage", type=int, default=32, help="retrieval: passage length")
    parser.add_argument("--no-levers", dest="levers", action="store_false")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print the agreement lines as recovery goes")
    parser.add_argument("--output", default=None, help="write every figure as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = load_data(args)
    L, N = args.length, args.steps
    print(
        f"# L={L}, {args.layers} layers, width {args.width}, {args.heads} heads, vocab {data['vocab']}; "
        f"pretraining {args.pretrain_steps} x {args.batch} x {L} (BERT: {args.bert_pretrain_steps}, MLM "
        f"{args.mlm_probability:.0%}); recovery N={N} steps x {args.batch} x {L} "
        f"= {N * args.batch * L} tokens (benchmark corpus: {data['train'].numel()} train tokens); "
        f"{len(data['docs'])} retrieval documents, passages of {args.passage}",
        flush=True,
    )
    report = {"args": vars(args), "models": {}}
    for name in args.models:
        original, pre = pretrain(name, args, data)
        print(f"\n## {name}: pretrained ({pre['tokens']} tokens); position path zeroed: {pre}", flush=True)
        plain = run_recovery(name, original, data, args)
        h = {entry["step"]: entry for entry in plain.history}
        row = {"pretrain": pre, "history": plain.history, "info": plain.info}
        q = N // 4
        print("| steps | " + " | ".join(f"{s}" for s in (0, q, N)) + " |")
        if name == "bert":
            print("| cosine at L | " + " | ".join(f"{h[s]['cosine']:.4f}" for s in (0, q, N)) + " |")
            retrieval = {}
            for k in (1, 2, 4, 8):
                retrieval[k] = {
                    "original_truncated": retrieval_accuracy(original, data["docs"], k * L, args.passage, L),
                    "recovered": retrieval_accuracy(plain.student, data["docs"], k * L, args.passage, None),
                }
            row["retrieval"] = retrieval
            print("| doc length | original (reads L) | recovered (reads all) | cosine to original's chunks |")
            for k, r in retrieval.items():
                cos = h[N]["cosine" if k == 1 else f"cosine_{k}x"]
                print(f"| {k * L} ({k}x) | {r['original_truncated']:.3f} | {r['recovered']:.3f} | {cos:.4f} |")
        else:
            print("| KL at L | " + " | ".join(f"{h[s]['kl']:.4f}" for s in (0, q, N)) + " |")
            print("| ppl at L (original " + f"{h[0]['teacher_ppl']:.2f}) | " + " | ".join(
                f"{h[s]['ppl']:.2f} ({h[s]['ppl'] / h[0]['teacher_ppl']:.3f})" for s in (0, q, N)
            ) + " |")  # fmt: skip
            print("| length | recovered ppl | / ppl at L |")
            for k in (1, 2, 4, 8):
                ppl = h[N]["ppl" if k == 1 else f"ppl_{k}x"]
                print(f"| {k * L} ({k}x) | {ppl:.2f} | {ppl / h[N]['ppl']:.3f} |")
        print(f"recovery took {plain.info['train_seconds']} s training", flush=True)
        if args.levers:
            levers = {"attention_only_steps": {"attention_only_steps": N // 4}}
            if name in ("gpt2", "bert"):
                levers["warm_start_steps"] = {"warm_start_steps": N // 4}
            if name == "bert":
                levers["encoder_variant=nonsymmetric"] = {"encoder_variant": "nonsymmetric"}
                levers["encoder_variant=learned"] = {"encoder_variant": "learned"}
                levers["hidden_layers=all"] = {"hidden_layers": "all"}
            row["levers"] = {}
            print(f"| lever ({name}) | at N/4 | at N | plain at N/4 | plain at N |")
            for label, settings in levers.items():
                result = run_recovery(name, original, data, args, factors=(1,), **settings)
                lh = {entry["step"]: entry for entry in result.history}
                row["levers"][label] = result.history
                print(
                    f"| {label} | {summary_figure(name, lh[q])} | {summary_figure(name, lh[N])} | "
                    f"{summary_figure(name, h[q])} | {summary_figure(name, h[N])} |",
                    flush=True,
                )
        report["models"][name] = row
    print(f"\ntotal wall-clock {time.perf_counter() - start:.0f} s")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
