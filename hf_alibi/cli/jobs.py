"""The jobs ``hf-alibi`` runs, with the library imported: :func:`run` calls one and reports. Each job is a library
function: :func:`hf_alibi.convert.convert_checkpoint` (``hf-alibi convert``),
:func:`hf_alibi.recover.recover_checkpoint` (``hf-alibi recover``), :func:`hf_alibi.hub.checkpoint_info`
(``hf-alibi info``), :func:`hf_alibi.export.export_gguf`, :func:`hf_alibi.evaluate.compare` and
:func:`hf_alibi.serve.serve`; their errors (:class:`hf_alibi.hub.checkpoints.CheckpointError`, ...) end the command
through the one error exit (status 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..convert.checkpoint import convert_checkpoint
from ..core.settings import AlibiSettings, describe_options
from ..evaluate.inputs import CompareError
from ..hub.info import checkpoint_info, learned_slopes  # noqa: F401  (learned_slopes: the CLI's names of today)
from ..recover.checkpoint import recover_checkpoint
from ..recover.settings import settings_from_flags
from ..serve.server import MissingServingExtras
from .checks import OPTIONS, fit_file
from .parser import errors_exit


def run(args: argparse.Namespace) -> int:
    """Run the command :func:`hf_alibi.cli.answer` checked, and report; the library's errors end it through the one
    error exit (``hf-alibi: error: ...``: status 2, or 1 where the Hub could not be reached)."""
    with errors_exit(MissingServingExtras, CompareError):
        if args.command == "convert":
            options = {name: getattr(args, name) for name in ("preset", *OPTIONS)}
            out = convert_checkpoint(
                args.src, args.out, args.heads, args.encoder_variant, args.overwrite, fit_file=fit_file(args),
                fit_scale=args.fit_scale, fit_tokens=args.fit_tokens, **options,
            )  # fmt: skip
            print(f"Wrote the ALiBi checkpoint to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
            if args.push_to_hub:
                from ..hub import push_folder

                push_folder(out, args.push_to_hub, private=args.private or None, commit_message=args.commit_message)
                print(f"Pushed {out} to https://huggingface.co/{args.push_to_hub}")
        elif args.command == "recover":
            out, result = recover_checkpoint(
                args.src, args.out, args.train_file, validation_file=args.validation_file, overwrite=args.overwrite,
                checkpoint_dir=args.checkpoint_dir, settings=settings_from_flags(args),
            )  # fmt: skip
            from ..train.distributed import launch_rank

            if launch_rank() == 0:  # several processes: rank 0 wrote it
                print(f"Wrote the recovered ALiBi checkpoint to {out} (agreement: {result.final_line})")
        elif args.command == "export-gguf":
            from ..export.gguf import export_gguf

            path = export_gguf(args.src, args.out, outtype=args.outtype, overwrite=args.overwrite)
            print(f"Wrote {path} ({args.outtype}): {RUN_GGUF.format(path=path)}")
        elif args.command == "info":
            info = checkpoint_info(args.path)
            print(json.dumps(info, indent=2)) if args.json else _print_info(info)
        elif args.command == "compare":
            from ..evaluate import compare, format_comparison
            from .parser import COMPARE_FLAGS  # one flag a keyword of compare(), declared once

            keywords = {flag.name: getattr(args, flag.name) for flag in COMPARE_FLAGS}
            print(format_comparison(compare(args.models, **keywords)))
            print(f"Wrote {Path(args.out) / 'compare.json'} and {Path(args.out) / 'compare.png'}")
        elif args.command == "serve":
            from ..serve.server import serve

            serve(args.model, args.arguments, limits=args.limits)
    return 0


# how to run an exported file: llama.cpp's own programs, or llama-cpp-python (which ".[dev]" installs)
RUN_GGUF = "llama-cli -m {path} (llama.cpp's programs), or llama_cpp.Llama(model_path='{path}') (llama-cpp-python)"


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
