"""``hf-alibi``: convert a checkpoint to ALiBi, inspect one, push one to the Hub.

    hf-alibi convert SRC OUT [--heads N] [--encoder-variant V] [--overwrite]
                             [--preset pretrained] [--sinks N] [--rotary-max-wavelength X]
                             [--slope-scale S] [--slopes a,b,...] [--position-mean N]
                             [--table-max-wavelength X]
                             [--fit-slopes --fit-text TEXT_FILE [--fit-scale C] [--fit-tokens T]]
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
import importlib
import json
import os
import sys

# Module level imports only the standard library and hf_alibi's modules that import neither torch nor transformers:
# the command line is parsed, and --help, --version and every error about arguments or paths answered, before the
# library is imported (seconds). ``hf-alibi`` runs this file without hf_alibi/__init__.py (hf_alibi_cli/); a job
# then runs in the real ``hf_alibi.cli`` (:func:`_jobs`), where the library's own exception classes are caught.
from .checkpoints import (
    TOKENIZER_FILES,  # noqa: F401  (re-exported: the CLI's names of today)
    CheckpointError,
    check_output,
    check_source,
    is_hub_id,
)
from .core.names import ENCODER_VARIANTS
from .core.settings import AlibiSettings, conversion_options, describe_options, flag_spellings, presets
from .core.version import __version__
from .gguf import OUTTYPES, GGUFExportError, check_output_file
from .recover.settings import add_setting_flags, settings_from_flags

OPTIONS: tuple[str, ...] = tuple(f.name for f in conversion_options())
PRESETS = presets()


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
    return describe_options(AlibiSettings.from_dict(info["alibi"]))


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
        parser.add_argument(
            *flag_spellings(option.name),
            dest=option.name,
            type=option.metadata["parse"],
            default=None,
            help=option.metadata["flag_help"],
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-alibi", description="ALiBi checkpoints: convert, inspect, share.")
    parser.add_argument("--version", action="version", version=f"hf-alibi {__version__}")
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
    # --fit-slopes is a switch, as in `recover` (which fits on its training text); convert reads --fit-text. The
    # old form, --fit-slopes TEXT_FILE, still parses (with a note) for one release
    conv.add_argument(
        "--fit-slopes", nargs="?", const=True, default=None, metavar="TEXT_FILE",
        help="fit the slopes per layer and head on --fit-text (hf_alibi.fit_slopes; instead of --slopes)",
    )  # fmt: skip
    conv.add_argument("--fit-text", metavar="TEXT_FILE", default=None, help="--fit-slopes: the text to fit on")
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
    add_setting_flags(rec)  # every recovery setting with a flag, the conversion options' among them
    rec.add_argument("--checkpoint-dir", "--checkpoint_dir", default=None, help="default: OUT.checkpoints")
    rec.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")

    gguf = commands.add_parser("export-gguf", help="write a converted checkpoint as GGUF for llama.cpp")
    gguf.add_argument("src", metavar="SRC", help="converted checkpoint folder or Hub id (with its tokenizer)")
    gguf.add_argument("out", metavar="OUT", help="the .gguf file to write")
    gguf.add_argument("--outtype", choices=OUTTYPES, default="f32", help="the matrices' type (norms, biases: f32)")
    gguf.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")

    commands.add_parser(
        "serve",
        help="serve a converted checkpoint (or a BLOOM, MPT, Falcon-RW) with transformers' OpenAI-compatible server",
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
    """Parse ``argv`` and check what needs no model (here: no torch, no transformers), then run the job."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the rest is `transformers serve`'s own command line (hf_alibi/serve.py)
        return _serve(parser, argv[1:])
    args = parser.parse_args(argv)
    try:
        check_inputs(args)
    except (CliError, CheckpointError, GGUFExportError) as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    return _jobs().run(parser, args)


def check_inputs(args: argparse.Namespace) -> None:
    """The checks of a parsed command line that need no model, so that their errors come at once: SRC a folder or
    a Hub id (the offline cache too), OUT writable, the text files there, the upload flags. The jobs check the
    same again (they are library functions too); this only says it before the library is imported."""
    if args.command in ("convert", "recover", "info"):
        check_source(args.path if args.command == "info" else args.src, "PATH" if args.command == "info" else "SRC")
    if args.command in ("convert", "recover"):
        check_output(args.src, args.out, args.overwrite)
    if args.command == "convert":
        _check_push_arguments(args)
        _check_file(fit_file(args), "--fit-text")
    if args.command == "recover":
        _check_file(args.train_file, "--train-file")
        _check_file(args.validation_file, "--validation-file")
        try:  # each setting's own check (those that need the model's config: the job's, before it loads)
            settings_from_flags(args)
        except ValueError as error:
            raise CliError(str(error)) from None
    if args.command == "export-gguf":
        check_source(args.src)
        check_output_file(args.out, args.overwrite)


def fit_file(args: argparse.Namespace) -> str | None:
    """The text ``convert --fit-slopes`` fits on (``--fit-text``; the old ``--fit-slopes TEXT_FILE`` too, with a note
    on stderr), else ``None``; a ``CliError`` for ``--fit-slopes`` without a text."""
    if isinstance(args.fit_slopes, str):
        if args.fit_text is not None:
            raise CliError("--fit-slopes TEXT_FILE and --fit-text both name a text: keep --fit-text.")
        print(
            "hf-alibi: note: --fit-slopes TEXT_FILE is now --fit-slopes --fit-text TEXT_FILE (as in `recover`, "
            "--fit-slopes is a switch); the old form goes in the next release.",
            file=sys.stderr,
        )
        args.fit_slopes, args.fit_text = True, args.fit_slopes  # read as the new form from here on: one note
    if args.fit_slopes and args.fit_text is None:
        raise CliError("--fit-slopes fits on a text, and convert has no training text: add --fit-text TEXT_FILE.")
    return args.fit_text


def _check_file(path: str | None, flag: str) -> None:
    if path is not None and not os.path.isfile(path):
        raise CliError(f"{flag} {path!r} is not a file: pass the path of a text file.")


def _jobs():
    # the module that runs jobs: this one when hf_alibi was imported as usual, else (hf-alibi ran this file without
    # the package's __init__) the real hf_alibi.cli, imported now with the library
    return sys.modules[__name__] if __name__ == "hf_alibi.cli" else importlib.import_module("hf_alibi.cli")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the parsed command's job and report; the library's errors become ``hf-alibi: error: ...``."""
    from .jobs import checkpoint_info, convert_checkpoint, recover_checkpoint

    try:
        if args.command == "convert":
            options = {name: getattr(args, name) for name in ("preset", *OPTIONS)}
            out = convert_checkpoint(
                args.src, args.out, args.heads, args.encoder_variant, args.overwrite, fit_file=fit_file(args),
                fit_scale=args.fit_scale, fit_tokens=args.fit_tokens, **options,
            )  # fmt: skip
            print(f"Wrote the ALiBi checkpoint to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
            if args.push_to_hub:
                from .hub import push_folder

                push_folder(out, args.push_to_hub, private=args.private or None, commit_message=args.commit_message)
                print(f"Pushed {out} to https://huggingface.co/{args.push_to_hub}")
        elif args.command == "recover":
            out, result = recover_checkpoint(
                args.src, args.out, args.train_file, validation_file=args.validation_file, overwrite=args.overwrite,
                checkpoint_dir=args.checkpoint_dir, settings=settings_from_flags(args),
            )  # fmt: skip
            print(f"Wrote the recovered ALiBi checkpoint to {out} (agreement: {result.final_line})")
        elif args.command == "export-gguf":
            from .gguf import export_gguf

            path = export_gguf(args.src, args.out, outtype=args.outtype, overwrite=args.overwrite)
            print(f"Wrote {path} ({args.outtype}): {RUN_GGUF.format(path=path)}")
        elif args.command == "info":
            info = checkpoint_info(args.path)
            print(json.dumps(info, indent=2)) if args.json else _print_info(info)
    except (CliError, CheckpointError, GGUFExportError) as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    except ConnectionError as error:
        parser.exit(1, f"hf-alibi: error: {error}\n")
    return 0


# how to run an exported file: llama.cpp's own programs, or llama-cpp-python (which ".[dev]" installs)
RUN_GGUF = "llama-cli -m {path} (llama.cpp's programs), or llama_cpp.Llama(model_path='{path}') (llama-cpp-python)"


def _serve(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: hf-alibi serve MODEL [--max-new-tokens-cap N (default 1024)] [transformers serve options]  "
              "(MODEL: a converted folder or Hub id, or a BLOOM, MPT or Falcon-RW one, run on hf_alibi's "
              "attention)\n")  # fmt: skip
        print("transformers serve's options follow (needs transformers' serving extras: pip install "
              "'transformers[serving]'):", flush=True)  # fmt: skip
        from hf_alibi.core.compat import transformers_cli_app

        transformers_cli_app()(args=["serve", "--help"], prog_name="hf-alibi")
    if not argv or argv[0].startswith("-"):
        parser.exit(2, "hf-alibi: error: serve needs MODEL first (a converted folder or Hub id), then `transformers "
                    "serve`'s options\n")  # fmt: skip
    try:
        check_source(argv[0], "MODEL")
    except CheckpointError as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    return _jobs().run_serve(parser, argv)


def run_serve(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """``hf-alibi serve MODEL ...`` with the library imported; its errors become ``hf-alibi: error: ...``."""
    from .serve import MissingServingExtras, serve
    from .serve_guard import ServeOptionError

    try:
        serve(argv[0], argv[1:])
    except (CheckpointError, MissingServingExtras, ServeOptionError) as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
