"""``hf-alibi``: convert a checkpoint to ALiBi, inspect one, push one to the Hub.

    hf-alibi convert SRC OUT [--heads N] [--encoder-variant V] [--overwrite]
                             [--preset pretrained] [--sinks N] [--rotary-max-wavelength X]
                             [--slope-scale S] [--slopes a,b,...] [--position-mean N]
                             [--table-max-wavelength X]
                             [--fit-slopes TEXT_FILE [--fit-scale C] [--fit-tokens T]]
                             [--push-to-hub REPO_ID [--private] [--commit-message MSG]]
    hf-alibi recover SRC OUT --train_file F [--max_steps N] [--length L] [the options above] [...]
    hf-alibi export-gguf SRC OUT [--outtype f32|f16|bf16|q8_0] [--overwrite]
    hf-alibi serve MODEL [transformers serve options]
    hf-alibi info PATH [--json]

The jobs are :mod:`hf_alibi.jobs` (``convert_checkpoint``, ``recover_checkpoint``, ``checkpoint_info``); this
module parses, calls one and reports.

SRC is a local checkpoint folder or a Hub id. OUT gets safetensors weights, config.json with the ALiBi
settings and ``auto_map``, ``modeling_alibi.py`` (for ``trust_remote_code=True``), the tokenizer when
SRC has one (without the original's maximum length), SRC's companion files (sentence-transformers
modules, generation config, chat template; see :mod:`hf_alibi.hub.folder`) and README.md (model card).
SRC is only read. The Hub token is the usual one: ``HF_TOKEN`` or the stored ``hf auth login``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .checkpoints import (
    TOKENIZER_FILES,  # noqa: F401  (re-exported: the CLI's names of today)
    CheckpointError,
    is_hub_id,
)
from .core.settings import AlibiSettings, conversion_options, describe_options
from .core.slopes import ENCODER_VARIANTS
from .gguf import OUTTYPES, GGUFExportError, export_gguf
from .jobs import checkpoint_info, convert_checkpoint, recover_checkpoint
from .patch import OPTIONS, PRESETS


class CliError(Exception):
    """A bad input: printed as ``hf-alibi: error: ...`` with exit status 2."""


def _print_info(info: dict) -> None:
    if info["is_alibi"]:
        print(
            f"{info['path']}: ALiBi checkpoint of {info['base_model_type']} ({', '.join(info['architectures'] or [])})"
        )
        print(f"  heads: {info['heads']}")
        print(f"  encoder variant: {info['encoder_variant'] or 'none (causal self-attention only)'}")
        fixed = _slopes_text(info["slopes"])
        if info["encoder_variant"] == "learned":
            if info.get("learned_slopes") is None:
                print("  learned slopes: in the weights (download the checkpoint and run info on its folder)")
            else:
                print("  learned slopes (-sigmoid of the saved parameters), per layer, left | right:")
                for prefix, sides in info["learned_slopes"].items():
                    left, right = (", ".join(f"{s:.6g}" for s in sides[side]) for side in ("left", "right"))
                    print(f"    {prefix}: {left} | {right}")
            print(f"  fixed slopes (causal self-attention only, if any): {fixed}")
        else:
            print(f"  slopes: {fixed}")
        print(f"  {_options_line(info)}")
        print(f"  converted by hf_alibi {info['hf_alibi_version']}")
        remote = "yes" if info["remote_code"] and info.get("remote_code_file", True) else "no"
        print(f"  loadable without hf_alibi (trust_remote_code=True): {remote}")
    elif info.get("native_alibi"):
        print(
            f"{info['path']}: a {info['model_type']} model trained with ALiBi (natively ALiBi: nothing to convert); "
            "hf_alibi runs its attention as it is: hf_alibi.patch_model(AutoModelForCausalLM.from_pretrained(PATH))."
        )
    else:
        can = "can" if info["convertible"] else "cannot"
        print(
            f"{info['path']}: not an ALiBi checkpoint (model_type {info['model_type']!r}); hf_alibi {can} convert it."
        )
    if "tokenizer" in info:
        print(f"  tokenizer: {'yes' if info['tokenizer'] else 'no'}")


def _slopes_text(slopes: list) -> str:
    """``a, b, ...``; per-layer slopes as their count and range (the whole list is in --json)."""
    if slopes and isinstance(slopes[0], list):
        flat = [s for layer in slopes for s in layer]
        return f"per layer ({len(slopes)} layers x {len(slopes[0])} heads), from {min(flat):.6g} to {max(flat):.6g}"
    return ", ".join(f"{s:.6g}" for s in slopes)


def _options_line(info: dict) -> str:
    """The conversion options of an info report as one line, each as its declaration says it."""
    names = {f.name for f in dataclasses.fields(AlibiSettings)}
    saved = {k: v for k, v in info.items() if k in names}
    saved["slopes"] = info.get("slopes_given")  # info's "slopes" are the ones in use
    return describe_options(AlibiSettings.from_dict(saved))


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (``hf-alibi: error: ... (see hf-alibi convert --help)``) and exit status 2,
    like the other errors (argparse would print its usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog.split()[0]}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive integer"


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """The conversion options as flags (``--slope-scale``, also ``--slope_scale``), from their declarations."""
    for option in conversion_options():
        dashed = "--" + option.name.replace("_", "-")
        flags = (dashed, "--" + option.name) if "_" in option.name else (dashed,)
        parser.add_argument(
            *flags, dest=option.name, type=option.metadata["parse"], default=None, help=option.metadata["flag_help"]
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-alibi", description="ALiBi checkpoints: convert, inspect, share.")
    commands = parser.add_subparsers(dest="command", required=True)

    conv = commands.add_parser("convert", help="convert a checkpoint (folder or Hub id) to ALiBi")
    conv.add_argument("src", metavar="SRC", help="checkpoint folder or Hub id; only read")
    conv.add_argument("out", metavar="OUT", help="folder to write the ALiBi checkpoint to")
    conv.add_argument("--heads", type=_positive_int, default=None, help="number of heads (must match; checked)")
    conv.add_argument(
        "--encoder-variant", choices=ENCODER_VARIANTS, default=None, help="bidirectional bias (default symmetric)"
    )
    conv.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="pretrained: keep more of what a pretrained model knew"
    )
    add_option_flags(conv)
    conv.add_argument(
        "--fit-slopes", metavar="TEXT_FILE", dest="fit_file", default=None,
        help="fit the slopes per layer and head on this text (hf_alibi.fit_slopes; instead of --slopes)",
    )  # fmt: skip
    conv.add_argument(
        "--fit-scale",
        type=float,
        default=None,
        help="--fit-slopes: C in C / mean distance (default: fit_slopes')",
    )
    conv.add_argument("--fit-tokens", type=int, default=1024, help="--fit-slopes: tokens of the text used")
    conv.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    conv.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="then upload OUT to this Hub repo")
    conv.add_argument("--private", action="store_true", help="create the Hub repo private")
    conv.add_argument("--commit-message", default=None, help="commit message of the upload")

    rec = commands.add_parser(
        "recover",
        help="convert a checkpoint and recover it by self-distillation from the original on your text",
        description="Load SRC, convert a copy to ALiBi, train it to give SRC's outputs on your unlabeled text "
        "at the original length (KL of next-token distributions for causal LMs, hidden states for encoders), "
        "and write OUT as a converted checkpoint. See hf_alibi.recover.",
    )
    rec.add_argument("src", metavar="SRC", help="the original checkpoint (folder or Hub id, with a tokenizer)")
    rec.add_argument("out", metavar="OUT", help="folder to write the recovered ALiBi checkpoint to")
    rec.add_argument("--train-file", "--train_file", required=True, help="unlabeled text: .txt, or .jsonl with 'text'")
    rec.add_argument(
        "--validation-file", "--validation_file", default=None, help="held-out text (default: the end of F)"
    )
    rec.add_argument(
        "--length", type=int, default=None, help="training length (default: the original maximum, at most 512)"
    )
    rec.add_argument("--max-steps", "--max_steps", type=int, default=500)
    rec.add_argument("--batch-size", "--batch_size", type=int, default=8)
    rec.add_argument(
        "--learning-rate", "--learning_rate", type=float, default=None,
        help="default: 1e-5 causal, 1e-4 encoders (the preset); 2e-4 (--preset paper); x 20 with LoRA",
    )  # fmt: skip
    rec.add_argument("--lm-weight", "--lm_weight", type=float, default=0.0, help="share of the LM/MLM loss (0..1)")
    rec.add_argument("--temperature", type=float, default=1.0, help="KL temperature (causal LMs)")
    rec.add_argument("--hidden-layers", "--hidden_layers", choices=("last", "all"), default="last")
    rec.add_argument("--warm-start-steps", "--warm_start_steps", type=int, default=0)
    rec.add_argument("--attention-only-steps", "--attention_only_steps", type=int, default=0)
    rec.add_argument("--eval-every", "--eval_every", type=int, default=None, help="default: max steps / 4")
    rec.add_argument("--heads", type=int, default=None, help="number of heads (must match the config; checked)")
    rec.add_argument(
        "--encoder-variant", choices=ENCODER_VARIANTS, default=None, help="bidirectional bias (default symmetric)"
    )
    rec.add_argument(
        "--preset", default="pretrained", help="conversion preset (hf_alibi.patch.PRESETS); 'paper': the paper's ALiBi"
    )
    add_option_flags(rec)
    rec.add_argument(
        "--fit-slopes", "--fit_slopes", action=argparse.BooleanOptionalAction, default=None,
        help="slopes fitted per layer and head by SRC on the training text (default: with a preset)",
    )  # fmt: skip
    rec.add_argument("--lora-rank", "--lora_rank", type=int, default=0, help="LoRA rank (0: train every weight)")
    rec.add_argument(
        "--max-eval-length", "--max_eval_length", type=int, default=2048, help="longest agreement length (tokens)"
    )
    rec.add_argument("--save-steps", "--save_steps", type=int, default=None, help="Trainer checkpoint every N steps")
    rec.add_argument("--checkpoint-dir", "--checkpoint_dir", default=None, help="default: OUT.checkpoints")
    rec.add_argument("--resume-from-checkpoint", "--resume_from_checkpoint", default=None, metavar="CHECKPOINT")
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")

    gguf = commands.add_parser("export-gguf", help="write a converted checkpoint as GGUF for llama.cpp")
    gguf.add_argument("src", metavar="SRC", help="converted checkpoint folder or Hub id (with its tokenizer)")
    gguf.add_argument("out", metavar="OUT", help="the .gguf file to write")
    gguf.add_argument("--outtype", choices=OUTTYPES, default="f32", help="the matrices' type (norms, biases: f32)")
    gguf.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")

    commands.add_parser(
        "serve",
        help="serve a converted checkpoint with transformers' OpenAI-compatible server",
        description="hf-alibi serve MODEL [transformers serve options]: MODEL first, then `transformers serve`'s own "
        "options (--port, --continuous-batching, ...), passed on unchanged.",
    )
    info = commands.add_parser("info", help="is PATH an ALiBi checkpoint, with which settings")
    info.add_argument("path", metavar="PATH", help="checkpoint folder or Hub id")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _check_push_arguments(args) -> None:
    if args.push_to_hub is None:
        upload_flags = (("--private", args.private), ("--commit-message", args.commit_message))
        given = [flag for flag, value in upload_flags if value]
        if given:
            raise CliError(f"{' and '.join(given)} apply to the upload only: pass --push-to-hub REPO_ID too.")
    elif not is_hub_id(args.push_to_hub):
        raise CliError(
            f"--push-to-hub {args.push_to_hub!r} is not a valid Hub repo id (name or user/name); nothing converted."
        )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the rest is `transformers serve`'s own command line (hf_alibi/serve.py)
        return _serve(parser, argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            _check_push_arguments(args)
            options = {name: getattr(args, name) for name in ("preset", *OPTIONS)}
            out = convert_checkpoint(
                args.src, args.out, args.heads, args.encoder_variant, args.overwrite, fit_file=args.fit_file,
                fit_scale=args.fit_scale, fit_tokens=args.fit_tokens, **options,
            )  # fmt: skip
            print(f"Wrote the ALiBi checkpoint to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
            if args.push_to_hub:
                from .hub import push_folder

                push_folder(out, args.push_to_hub, private=args.private or None, commit_message=args.commit_message)
                print(f"Pushed {out} to https://huggingface.co/{args.push_to_hub}")
        elif args.command == "recover":
            out, result = recover_checkpoint(
                args.src, args.out, args.train_file, validation_file=args.validation_file,
                overwrite=args.overwrite, length=args.length, max_steps=args.max_steps,
                batch_size=args.batch_size, learning_rate=args.learning_rate, lm_weight=args.lm_weight,
                temperature=args.temperature, hidden_layers=args.hidden_layers, heads=args.heads,
                encoder_variant=args.encoder_variant, warm_start_steps=args.warm_start_steps,
                attention_only_steps=args.attention_only_steps, eval_every=args.eval_every, seed=args.seed,
                preset=args.preset, fit_slopes=args.fit_slopes, lora_rank=args.lora_rank,
                max_eval_length=args.max_eval_length, save_steps=args.save_steps, checkpoint_dir=args.checkpoint_dir,
                resume_from_checkpoint=args.resume_from_checkpoint, **{name: getattr(args, name) for name in OPTIONS},
            )  # fmt: skip
            print(f"Wrote the recovered ALiBi checkpoint to {out} (agreement: {result.final_line})")
        elif args.command == "export-gguf":
            path = export_gguf(args.src, args.out, outtype=args.outtype, overwrite=args.overwrite)
            print(f"Wrote {path} ({args.outtype}): llama-cli -m {path}")
        elif args.command == "info":
            info = checkpoint_info(args.path)
            print(json.dumps(info, indent=2)) if args.json else _print_info(info)
    except (CliError, CheckpointError, GGUFExportError) as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    except ConnectionError as error:
        parser.exit(1, f"hf-alibi: error: {error}\n")
    return 0


def _serve(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    from hf_alibi.serve import serve

    if argv[:1] in (["-h"], ["--help"]):
        print("usage: hf-alibi serve MODEL [transformers serve options]  (MODEL: a converted folder or Hub id)\n")
        from hf_alibi.core.compat import transformers_cli_app

        transformers_cli_app()(args=["serve", "--help"], prog_name="hf-alibi")
    if not argv or argv[0].startswith("-"):
        parser.exit(2, "hf-alibi: error: serve needs MODEL first (a converted folder or Hub id), then `transformers "
                    "serve`'s options\n")  # fmt: skip
    try:
        serve(argv[0], argv[1:])
    except CheckpointError as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
