"""``hf-alibi``: convert a checkpoint to ALiBi, inspect one, push one to the Hub.

    hf-alibi convert SRC OUT [conversion options] [upload options]
    hf-alibi recover SRC OUT [its training text, recovery settings, conversion options]
    hf-alibi export-gguf SRC OUT.gguf
    hf-alibi serve MODEL [transformers serve options]
    hf-alibi info PATH

Each command's help lists its flags (:mod:`hf_alibi.cli_parser`, from their declarations); the checks that
need no model are :mod:`hf_alibi.cli_checks`'.
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
import importlib.util
import json
import sys

# Module level imports only the standard library and hf_alibi's modules that import neither torch nor transformers:
# the command line is parsed, and the help, the version and every error that needs no model answered, before the
# library is imported (seconds). ``hf-alibi`` runs this file without hf_alibi/__init__.py (hf_alibi_cli/); a job
# then runs in the real ``hf_alibi.cli`` (:func:`_jobs`), where the library's own exception classes are caught.
from .checkpoints import (
    TOKENIZER_FILES,  # noqa: F401  (re-exported: the CLI's names of today)
    CheckpointError,
    check_source,
)
from .cli_checks import OPTIONS, CliError, check_inputs, check_serve_arguments, fit_file, serving_engine
from .cli_parser import add_option_flags, build_parser  # noqa: F401  (re-exported: the parser's home)
from .core.settings import AlibiSettings, describe_options
from .gguf import GGUFExportError
from .recover.settings import settings_from_flags


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
    """``a, b, ...``; per-layer slopes as their count and range (the whole list is in the JSON report)."""
    if slopes and isinstance(slopes[0], list):
        flat = [s for layer in slopes for s in layer]
        return f"per layer ({len(slopes)} layers x {len(slopes[0])} heads), from {min(flat):.6g} to {max(flat):.6g}"
    return ", ".join(f"{s:.6g}" for s in slopes)


def _options_line(info: dict) -> str:
    """The conversion options of an info report as one line, each as its declaration says it."""
    return describe_options(AlibiSettings.from_dict(info["alibi"]))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and check what needs no model (here: no torch, no transformers), then run the job."""
    parser, parsed = answer(argv)
    return run_job(parser, parsed)


def answer(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace | list[str]]:
    """What the command answers before the library is imported: the help, the version and every error that needs
    no model exit here (``hf-alibi: error: ...``, status 2). Returns the parser and the checked command line
    (``serve``'s arguments as a list) for :func:`run_job`."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the rest is `transformers serve`'s own command line (hf_alibi/serve.py)
        return parser, _serve(parser, argv[1:])
    args = parser.parse_args(argv)
    try:
        check_inputs(args)
    except (CliError, CheckpointError, GGUFExportError) as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    return parser, args


def run_job(parser: argparse.ArgumentParser, parsed: argparse.Namespace | list[str]) -> int:
    """Run what :func:`answer` checked, with the library imported."""
    jobs = _jobs()
    return jobs.run_serve(parser, parsed) if isinstance(parsed, list) else jobs.run(parser, parsed)


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


def _serve(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: hf-alibi serve MODEL [--engine transformers|vllm] [--max-new-tokens-cap N (default 1024)] "
              "[the engine's server options]  (MODEL: a converted folder or Hub id, or a BLOOM, MPT or Falcon-RW one, "
              "run on hf_alibi's attention; --engine vllm: vLLM's OpenAI server, `vllm serve`'s options, "
              "docs/engines.md)\n")  # fmt: skip
        print("transformers serve's options follow (needs transformers' serving extras: pip install "
              "'transformers[serving]'):", flush=True)  # fmt: skip
        from hf_alibi.core.compat import transformers_cli_app

        transformers_cli_app()(args=["serve", "--help"], prog_name="hf-alibi")
    if not argv or argv[0].startswith("-"):
        parser.exit(2, "hf-alibi: error: serve needs MODEL first (a converted folder or Hub id), then `transformers "
                    "serve`'s options\n")  # fmt: skip
    try:
        check_source(argv[0], "MODEL")
        engine, argv = serving_engine(argv)
        if engine == "vllm":
            _exec_vllm(argv)
        check_serve_arguments(argv[1:])
    except (CheckpointError, CliError) as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    return argv


def _exec_vllm(argv: list[str]) -> None:
    # vLLM's OpenAI server in this process's place, every process of it started as hf_alibi_vllm starts them
    if importlib.util.find_spec("vllm") is None:
        raise CliError("--engine vllm needs vLLM: pip install -e '.[vllm]' (docs/engines.md).")
    from hf_alibi_vllm.server import exec_server

    exec_server(argv)


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
