#!/usr/bin/env python
"""A pretrained causal LM converted to ALiBi, against the original and YaRN: one command, one table.

The measurements are hf_alibi.evaluate's, as ``hf-alibi compare`` makes them on saved folders (docs/pretrained.md);
this script adds the arms it builds in memory from one checkpoint: YaRN, conversions with any options, fitted slopes,
recovery. For each arm (the original; YaRN x2, x4 without training; each conversion, before and after N recovery
steps), on the checkpoint folder's own text:

- perplexity on non-overlapping windows of each ``--lengths`` over the first ``--eval_tokens`` tokens;
- perplexity by position on one stream of ``--position_tokens`` tokens (to at least 2x the native length),
  fed in query chunks of ``--chunk`` with the KV cache, so no L x L tensor is ever built;
- passkey retrieval: a 5-digit number hidden at ``--depths`` of filler text of each ``--passkey_lengths``,
  read back by greedy decoding (hits / depths);
- the tokens each arm processed and its wall-clock.

Conversion arms: ``paper`` (``hf_alibi.patch_model(m)``), ``pretrained`` (``preset="pretrained"``) and any
``--arm "sinks=1,slope_scale=0.03"`` (patch_model's keyword options; ``preset=pretrained`` allowed; ``fit=0.1``:
slopes fitted per layer and head by ``hf_alibi.fit_slopes`` with that scale, on ``--fit_tokens`` of the text after
the evaluated tokens).

    PYTHONPATH=. python benchmarks/pretrained.py --model /work/models/smollm2
    PYTHONPATH=. python benchmarks/pretrained.py --arms original yarn:2 pretrained --arm slope_scale=0.01 \
        --lengths 256 1024 --position_tokens 0 --passkey_lengths 1024 --recover_steps 40
    PYTHONPATH=. python benchmarks/pretrained.py --quick          # a tiny self-made Llama, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from builders import build_model
from transformers import AutoConfig, AutoModelForCausalLM

import hf_alibi
from hf_alibi.convert.positions import original_length, position_limit
from hf_alibi.core.settings import conversion_options
from hf_alibi.evaluate.comparison import measure_model, rope_overrides, rope_theta
from hf_alibi.evaluate.passkey import NEW_TOKENS
from hf_alibi.evaluate.stream import position_bounds, short
from hf_alibi.hub.checkpoints import read_config
from hf_alibi.recover import recover

DEFAULT_ARMS = ("original", "yarn:2", "yarn:4", "paper", "pretrained")
# an arm's keys: the conversion options as declared (but slopes: its commas are the arm's separators), and these
ARM_OPTIONS = {
    **{f.name: f.metadata["parse"] for f in conversion_options() if f.name != "slopes"},
    "preset": str.strip,
    "fit": float,  # fit_slopes' scale
    "yarn": float,  # YaRN's factor on the rotary the conversion keeps
}


@dataclass
class Arm:
    """One row: ``kind`` is original / yarn / alibi; ``options`` go to patch_model (alibi) or ``factor`` (yarn)."""

    name: str
    kind: str
    options: dict = field(default_factory=dict)


def parse_arm(text: str) -> Arm:
    """``original``, ``yarn:F``, ``paper``, ``pretrained`` or ``key=value,...`` (patch_model options).

    >>> parse_arm("sinks=1,slope_scale=0.03")
    Arm(name='sinks=1,slope_scale=0.03', kind='alibi', options={'sinks': 1, 'slope_scale': 0.03})
    """
    if text == "original":
        return Arm(text, "original")
    if text.startswith("yarn:"):
        try:
            return Arm(text, "yarn", {"factor": float(text[5:])})
        except ValueError:
            raise SystemExit(f"--arms: {text!r} needs a number after 'yarn:', e.g. yarn:2.") from None
    if text == "paper":
        return Arm(text, "alibi")
    if text == "pretrained":
        return Arm(text, "alibi", {"preset": "pretrained"})
    options = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ARM_OPTIONS:
            raise SystemExit(
                f"--arm {text!r}: unknown option {key!r}; use original, yarn:F, paper, pretrained or "
                f"key=value pairs of {', '.join(ARM_OPTIONS)} (fit: fit_slopes' scale; yarn: YaRN's factor on the "
                "rotary the conversion keeps)."
            )
        options[key] = ARM_OPTIONS[key](value)
    return Arm(text, "alibi", options)


# ---------------------------------------------------------------- models and text


def fit_arm(folder: str, arm: Arm, native: int, ids: torch.Tensor) -> Arm:
    """An arm with ``fit=SCALE``: its slopes fitted per layer and head on ``ids`` by the original
    (``hf_alibi.fit_slopes``), once, given to the conversion as ``slopes``."""
    if "fit" not in arm.options:
        return arm
    original = load(folder, Arm("original", "original"), native)
    return Arm(arm.name, arm.kind, fitted_options(arm.options, original, ids))


def fitted_options(options: dict, original, ids: torch.Tensor) -> dict:
    """An arm's options with ``fit=SCALE`` turned into ``slopes`` fitted by ``original`` on ``ids`` (the arm's sinks,
    else the preset's one; the slopes replace any ``slope_scale``)."""
    options = dict(options)
    scale = options.pop("fit")
    options.pop("slope_scale", None)
    sinks = options.get("sinks", 1 if options.get("preset") else 0)
    options["slopes"] = hf_alibi.fit_slopes(original, ids, scale=scale, sinks=sinks)
    return options


def load(folder: str, arm: Arm, native: int) -> torch.nn.Module:
    """The checkpoint as this arm runs it, fp32, SDPA, eval mode."""
    kwargs, options = {}, dict(arm.options)
    factor = options.pop("factor" if arm.kind == "yarn" else "yarn", None)
    if factor is not None:  # a YaRN arm, or a conversion of the YaRN-scaled model (alibi arm's yarn=F)
        config = AutoConfig.from_pretrained(folder)
        if rope_theta(config) is None:
            raise SystemExit(f"{config.model_type} has no rope_theta: YaRN arms need a rotary model; drop yarn:F.")
        kwargs = rope_overrides(config, "yarn", factor, native)  # hf-alibi compare --rope yarn:F's keywords
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa", **kwargs)
    if arm.kind == "alibi":
        hf_alibi.patch_model(model, **options)
    return model.eval()


class Text:
    """The text as ids, and encode/decode for the passkey prompts (a tokenizer, or bytes in --quick)."""

    def __init__(self, ids: torch.Tensor, encode, decode):
        self.ids, self.encode, self.decode = ids, encode, decode


def read_prose(path: str | None) -> str:
    """The text at ``path``, or with none the prose the docs measure on: Python's own pydoc topics (in every
    Python, ``pydoc_data.topics``), sorted by name, joined by blank lines."""
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[name] for name in sorted(topics))
    if not Path(path).is_file():
        raise SystemExit(f"--text {path}: no such file (give a plain-text file, or leave --text out: the pydoc prose)")
    return Path(path).read_text()


def text_from(folder: str, path: str | None) -> Text:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tokenizer(read_prose(path))["input_ids"])
    return Text(ids, lambda s: tokenizer(s, add_special_tokens=False)["input_ids"], tokenizer.decode)


def quick_setup(folder: str) -> Text:
    """A tiny Llama (byte vocabulary, native length 64) saved to ``folder``; the text: this file's bytes."""
    model = build_model(
        "llama", layers=2, heads=4, width=32, positions=64, vocab=256, intermediate_size=64, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    model.save_pretrained(folder)
    ids = torch.tensor(list(Path(__file__).read_bytes()))
    return Text(ids, lambda s: list(s.encode()), lambda ids: bytes(ids).decode(errors="replace"))


# ---------------------------------------------------------------- measurements


def measure(model, text: Text, args, bounds: list[int]) -> dict:
    """Every figure of one row (hf_alibi.evaluate's, as ``hf-alibi compare`` measures them), with the tokens it
    processed and the seconds it took."""
    start = time.perf_counter()
    stream = text.ids[: args.position_tokens + 1] if args.position_tokens else None
    figures = measure_model(
        model, text.ids[: args.eval_tokens + 1], stream, {"limit": position_limit(model)}, args.lengths,
        ("nonoverlapping",), None, 4096, args.chunk, bounds, args.passkey_lengths, args.depths, text.encode,
        text.decode,
    )  # fmt: skip
    row, tokens = {}, 0
    for length, entry in figures["perplexity"]["nonoverlapping"].items():
        row[f"ppl@{length}"] = entry.get("perplexity", entry.get("error"))
        tokens += entry.get("tokens", 0)
    row.update({name: ppl for name, ppl in figures.get("by_position", {}).items() if ppl is not None})
    tokens += stream.numel() - 1 if stream is not None else 0
    for length, entry in figures["passkey"].items():
        row[f"passkey@{short(int(length))}"] = f"{entry['hits']}/{entry['of']}" if "hits" in entry else ""
        tokens += (int(length) + NEW_TOKENS) * len(args.depths)
    row["tokens"], row["seconds"] = tokens, round(time.perf_counter() - start, 1)
    return row


# ---------------------------------------------------------------- recovery


def recover_options(options: dict) -> dict:
    """``recover()``'s conversion keywords for this arm's patch_model options: no preset unless the arm names one
    (as ``patch_model``; ``recover()`` itself defaults to the preset), and no slopes fitted by recover() (a
    fit=SCALE arm brings its fitted slopes): the arm recovered is the arm measured."""
    return {"preset": None, "fit_slopes": False, **options}


def recovered(folder: str, arm: Arm, native: int, text: Text, args) -> tuple[torch.nn.Module, dict]:
    """The arm's conversion after ``--recover_steps`` of ``recover()`` from the original, and its totals."""
    if "yarn" in arm.options:
        raise SystemExit(f"--arm {arm.name!r}: yarn=F conversions are measured untrained only; drop --recover_steps.")
    teacher = load(folder, Arm("original", "original"), native)
    need = args.recover_steps * args.recover_batch * args.recover_length
    start = max(args.eval_tokens, args.position_tokens)
    train = text.ids[start : start + need]
    if train.numel() < need:
        raise SystemExit(
            f"The text has {text.ids.numel()} tokens; recovery needs {need} after the {start} evaluation tokens: "
            "lower --recover_steps, --recover_batch or --recover_length, or give a longer --text."
        )
    held = text.ids[: args.recover_length * 4 + 1]
    extra = {} if args.recover_lr is None else {"learning_rate": args.recover_lr}
    if args.recover_lora_rank:
        extra["lora_rank"] = args.recover_lora_rank
    result = recover(
        teacher,
        train,
        length=args.recover_length,
        max_steps=args.recover_steps,
        batch_size=args.recover_batch,
        eval_texts=held,
        max_eval_tokens=held.numel() - 1,
        eval_factors=(1,),
        eval_every=0,
        progress=False,
        log=None,
        **recover_options(arm.options),
        **extra,
    )
    info = {"recover_tokens": result.info["tokens"], "recover_seconds": result.info["train_seconds"]}
    info["recover_lr"] = result.info["learning_rate"]
    info["recover_lora_rank"] = result.info["lora_rank"]
    info["kl"] = f"{result.history[0]['kl']:.4f} -> {result.history[-1]['kl']:.4f}" if "kl" in result.final else ""
    return result.student.eval(), info


# ---------------------------------------------------------------- main


def format_rows(rows: list[dict], digits: int = 2) -> str:
    columns = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [row.get(c, "") for c in columns]
        lines.append(
            "| "
            + " | ".join(
                f"{v:.{digits}f}" if isinstance(v, float) and c != "seconds" else str(v)
                for c, v in zip(columns, cells)
            )
            + " |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/work/models/smollm2", help="a causal LM checkpoint folder")
    p.add_argument("--text", default=None, help="plain text to measure on (default: Python's pydoc topics)")
    p.add_argument("--quick", action="store_true", help="a tiny self-made Llama and small settings (seconds)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), help=f"default: {' '.join(DEFAULT_ARMS)}")
    p.add_argument("--arm", action="append", default=[], help='an extra conversion, e.g. "sinks=1,slope_scale=0.03"')
    p.add_argument("--lengths", type=int, nargs="*", default=[256, 1024, 4096])
    p.add_argument("--eval_tokens", type=int, default=4096, help="tokens for the window perplexities")
    p.add_argument(
        "--position_tokens", type=int, default=None, help="stream length by position (default 2x native; 0: off)"
    )
    p.add_argument(
        "--bounds", type=int, nargs="+", default=None, help="position ranges' bounds (default native/8 .. 2x native)"
    )
    p.add_argument("--chunk", type=int, default=1024, help="queries per forward in the by-position stream")
    p.add_argument("--passkey_lengths", type=int, nargs="*", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--fit_tokens", type=int, default=1024, help="text tokens fit=SCALE arms fit their slopes on")
    add_recovery_arguments(p, recover_batch=2)
    quick = {"lengths": [32, 64, 128], "eval_tokens": 512, "position_tokens": 256, "chunk": 48, "fit_tokens": 64}
    quick.update(passkey_lengths=[128, 256], recover_steps=2, recover_batch=2, recover_length=32)
    return parse_with_quick(p, argv, quick)


def add_recovery_arguments(p: argparse.ArgumentParser, recover_batch: int) -> None:
    """The recovery, thread and output flags of the pretrained-checkpoint benchmarks (this one, encoder.py)."""
    p.add_argument("--recover_steps", type=int, default=0, help="N recovery steps per conversion (0: none)")
    p.add_argument("--recovered_only", action="store_true", help="measure conversions only after recovery")
    p.add_argument("--recover_batch", type=int, default=recover_batch)
    p.add_argument("--recover_length", type=int, default=256)
    p.add_argument("--recover_lr", type=float, default=None, help="default: recover()'s")
    p.add_argument("--recover_lora_rank", type=int, default=0, help="recover with LoRA of this rank (0: every weight)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="append each row as one JSON line to this file")


def parse_with_quick(p: argparse.ArgumentParser, argv, quick: dict) -> argparse.Namespace:
    """The arguments; with ``--quick``, the ``quick`` settings where the command line left the default."""
    args = p.parse_args(argv)
    if args.quick:
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = [parse_arm(a) for a in args.arms + args.arm]
    scratch = tempfile.TemporaryDirectory(prefix="hf_alibi_pretrained_bench_")
    folder = scratch.name if args.quick else args.model
    text = quick_setup(folder) if args.quick else text_from(folder, args.text)
    native = original_length(read_config(folder, "--model"))
    if not native:
        raise SystemExit(f"{folder}: its config states no maximum length (max_position_embeddings).")
    if args.position_tokens is None:
        args.position_tokens = 2 * native
    bounds = args.bounds or (position_bounds(native, args.position_tokens) if args.position_tokens else [])
    need = max(args.eval_tokens, args.position_tokens)
    if text.ids.numel() < need:
        raise SystemExit(f"The text has {text.ids.numel()} tokens; the evaluation needs {need}: lower the settings.")
    print(
        f"# {folder}: native length {native}, {text.ids.numel()} text tokens; windows {args.lengths} over "
        f"{args.eval_tokens}; by position over {args.position_tokens} (chunks of {args.chunk}); passkey "
        f"{args.passkey_lengths} x depths {args.depths}; recovery {args.recover_steps} x {args.recover_batch} x "
        f"{args.recover_length}; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    fit_ids = text.ids[need : need + args.fit_tokens]  # after the evaluated tokens, like the recovery text
    arms = [fit_arm(folder, arm, native, fit_ids) for arm in arms]
    rows, total = [], time.perf_counter()
    for arm in arms:
        if not (args.recovered_only and arm.kind == "alibi"):
            rows.append(_emit({"arm": arm.name, **measure(load(folder, arm, native), text, args, bounds)}, args))
        if arm.kind == "alibi" and args.recover_steps:
            model, info = recovered(folder, arm, native, text, args)
            row = {"arm": f"{arm.name} +{args.recover_steps} steps", **measure(model, text, args, bounds), **info}
            rows.append(_emit(row, args))
    print("\n" + format_rows(rows))
    print(f"total wall-clock {time.perf_counter() - total:.0f} s")
    scratch.cleanup()
    return rows


def _emit(row: dict, args) -> dict:
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    sys.exit(main() and 0)
