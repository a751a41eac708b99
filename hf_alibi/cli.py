"""``hf-alibi``: convert a checkpoint to ALiBi, inspect one, push one to the Hub.

    hf-alibi convert SRC OUT [--heads N] [--encoder-variant V] [--overwrite]
                             [--preset pretrained] [--sinks N] [--rotary-max-wavelength X]
                             [--slope-scale S] [--slopes a,b,...] [--position-mean N]
                             [--table-max-wavelength X]
                             [--fit-slopes TEXT_FILE [--fit-scale C] [--fit-tokens T]]
                             [--push-to-hub REPO_ID [--private] [--commit-message MSG]]
    hf-alibi recover SRC OUT --train_file F [--max_steps N] [--length L] [...]   (see hf_alibi.recover)
    hf-alibi info PATH [--json]

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
import os
import sys
from pathlib import Path

from .checkpoints import (
    TOKENIZER_FILES,  # noqa: F401  (re-exported: the CLI's names of today)
    CheckpointError,
    check_output,
    has_tokenizer,
    is_alibi,
    is_hub_id,
    is_local,
    model_class_for,
    read_config,
    staged_output,
)
from .core.settings import AlibiSettings, conversion_options, describe_options
from .core.slopes import ENCODER_VARIANTS, scaled_slopes_list
from .fit import fit_slopes
from .gguf import GGUFExportError, export_gguf
from .hub.folder import write_converted
from .jobs import recover_checkpoint
from .patch import OPTIONS, PRESETS, patch_model, settings_for
from .registry import supported_model_types


class CliError(Exception):
    """A bad input: printed as ``hf-alibi: error: ...`` with exit status 2."""


def convert(
    src: str,
    out: str | os.PathLike,
    heads: int | None = None,
    encoder_variant: str | None = None,
    overwrite: bool = False,
    fit_file: str | os.PathLike | None = None,
    fit_scale: float | None = None,
    fit_tokens: int = 1024,
    **options,
) -> Path:
    """Convert the checkpoint ``src`` to ALiBi into the folder ``out`` (what ``hf-alibi convert`` does).

    ``options`` are :func:`hf_alibi.patch_model`'s keyword arguments (``preset``, ``sinks``,
    ``rotary_max_wavelength``, ``slope_scale``, ``slopes``, ``position_mean``, ``table_max_wavelength``). Every
    argument is checked before the model is loaded. The folder is written next to ``out`` first and moved in place
    at the end, so a failure leaves no half-written ``out`` (and with ``overwrite`` the old one stays until the new
    one is complete).
    It holds SRC's companion files (:func:`hf_alibi.hub.write_converted`).

    ``fit_file``: a text file; the slopes are fitted per layer and head on its first ``fit_tokens`` tokens by
    the original (:func:`hf_alibi.fit_slopes`, ``scale`` ``fit_scale``) and given to ``patch_model`` as ``slopes``.

    >>> convert("my-gpt2", "gpt2-alibi", preset="pretrained")  # doctest: +SKIP
    """
    from transformers import AutoConfig

    out = Path(out)
    check_output(src, out, overwrite)
    config_dict = read_config(src)
    model_cls = model_class_for(config_dict)
    try:
        config = AutoConfig.for_model(**config_dict)
    except Exception as error:
        raise CliError(f"SRC {src!r} has a config.json transformers cannot build a config from: {error}") from error
    try:
        settings = settings_for(config, heads, encoder_variant, **options)
    except ValueError as error:
        raise CliError(str(error)) from error
    fit_text = _fit_text(fit_file, fit_scale, fit_tokens, options)
    src_has_tokenizer = has_tokenizer(src)
    if fit_text is not None and src_has_tokenizer is False:
        raise CliError(f"--fit-slopes tokenizes the text with SRC's tokenizer, but SRC {src!r} has none.")
    with staged_output(out) as staging:  # made first: a place that cannot be written fails before loading
        try:
            model = model_cls.from_pretrained(src)
        except Exception as error:
            raise CliError(f"Could not load the model from SRC {src!r} as {model_cls.__name__}: {error}") from error
        tokenizer = None
        if src_has_tokenizer is not False:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(src)
            except Exception as error:
                if src_has_tokenizer or fit_text is not None:
                    raise CliError(f"SRC {src!r} has tokenizer files that could not be loaded: {error}") from error
        if fit_text is not None:
            ids = tokenizer(fit_text, truncation=True, max_length=fit_tokens, return_tensors="pt")["input_ids"]
            try:
                scale = {} if fit_scale is None else {"scale": fit_scale}
                options["slopes"] = fit_slopes(model, ids, sinks=settings.sinks, **scale)
            except ValueError as error:
                raise CliError(str(error)) from error
        try:
            patch_model(model, heads=heads, encoder_variant=encoder_variant, **options)
        except ValueError as error:
            raise CliError(str(error)) from error
        write_converted(staging, model, src, tokenizer)
    return out


def describe(path: str) -> dict:
    """What ``hf-alibi info`` reports about a checkpoint folder or Hub id, as a dict: the settings of
    ``config.alibi`` (``slopes_given``: explicit slopes or None) and ``slopes``, the slopes in use."""
    config_dict = read_config(path, label="PATH")
    model_type = config_dict["model_type"]
    info = {
        "path": path,
        "model_type": model_type,
        "architectures": config_dict.get("architectures"),
        "is_alibi": is_alibi(config_dict),
    }
    if info["is_alibi"]:
        settings = AlibiSettings.from_dict(config_dict["alibi"])
        info.update(settings.to_dict())
        info["slopes_given"] = settings.slopes  # explicit slopes (--slopes), else None
        info["slopes"] = scaled_slopes_list(settings.heads, settings.slope_scale, settings.slopes)  # in use
        info["remote_code"] = sorted(set((config_dict.get("auto_map") or {}).values()))
        if is_local(path):
            info["remote_code_file"] = (Path(path) / "modeling_alibi.py").is_file()
        if settings.encoder_variant == "learned":
            info["learned_slopes"] = learned_slopes(path) if is_local(path) else None
    else:
        info["convertible"] = model_type in supported_model_types()
    if is_local(path):
        info["tokenizer"] = has_tokenizer(path)
    return info


LEARNED_SUFFIXES = (".alibi.slopes_left", ".alibi.slopes_right")


def learned_slopes(path: str | os.PathLike) -> dict[str, dict[str, list[float]]]:
    """The learned encoder slopes saved in a checkpoint folder, per layer: ``-sigmoid`` of the saved
    ``...alibi.slopes_left`` / ``slopes_right`` parameters (the bias is ``left * (i - j)`` for keys at or
    left of the query, ``right * (j - i)`` right of it). Keys are the layers' parameter prefixes."""
    import torch
    from safetensors import safe_open

    folder = Path(path).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CliError(f"PATH {str(path)!r} has no safetensors weights: the learned slopes cannot be read.")
    raw: dict[str, dict[str, torch.Tensor]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as weights:
            for key in weights.keys():
                for suffix in LEARNED_SUFFIXES:
                    if key.endswith(suffix):
                        side = suffix.rsplit("_", 1)[1]  # "left" / "right"
                        raw.setdefault(key.removesuffix(suffix), {})[side] = weights.get_tensor(key)
    if not raw:
        raise CliError(
            f"PATH {str(path)!r} says encoder_variant 'learned' but its weights hold no learned slopes "
            "(...alibi.slopes_left / slopes_right): the checkpoint is incomplete; save it again with save_pretrained."
        )

    def layer_order(prefix: str) -> list:  # numbered layers in numeric order: layer.2 before layer.10
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in prefix.split(".")]

    return {
        prefix: {side: (-torch.sigmoid(raw[prefix][side].double())).tolist() for side in ("left", "right")}
        for prefix in sorted(raw, key=layer_order)
    }


def _fit_text(fit_file, fit_scale, fit_tokens: int, options: dict) -> str | None:
    """The text of ``--fit-slopes`` (None without it), every flag checked before anything loads."""
    if fit_file is None:
        if fit_scale is not None:
            raise CliError("--fit-scale applies to --fit-slopes only: pass --fit-slopes TEXT_FILE too.")
        return None
    if options.get("slopes") is not None or options.get("slope_scale") is not None:
        raise CliError("--fit-slopes computes the slopes: drop --slopes and --slope-scale.")
    if fit_scale is not None and not fit_scale > 0:
        raise CliError(f"--fit-scale must be > 0 (the slope of a head is C / its mean distance), got {fit_scale}.")
    if fit_tokens < 2:
        raise CliError(f"--fit-tokens must be at least 2, got {fit_tokens}.")
    path = Path(fit_file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"--fit-slopes {str(path)!r} could not be read as UTF-8 text ({error}).") from error
    if not text.strip():
        raise CliError(f"--fit-slopes {str(path)!r} holds no text. Pass text like the model's inputs.")
    return text


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

    gguf = commands.add_parser("export-gguf", help="write a converted folder as GGUF for llama.cpp")
    gguf.add_argument("src", metavar="SRC", help="converted checkpoint folder (with its tokenizer)")
    gguf.add_argument("out", metavar="OUT", help="the .gguf file to write")
    gguf.add_argument("--outtype", choices=("f32", "f16", "bf16", "q8_0"), default="f32", help="matrices' type")

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
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            _check_push_arguments(args)
            options = {name: getattr(args, name) for name in ("preset", *OPTIONS)}
            out = convert(
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
            print(f"Wrote {export_gguf(args.src, args.out, outtype=args.outtype)} ({args.outtype})")
        elif args.command == "info":
            info = describe(args.path)
            print(json.dumps(info, indent=2)) if args.json else _print_info(info)
    except (CliError, CheckpointError, GGUFExportError) as error:
        parser.exit(2, f"hf-alibi: error: {error}\n")
    except ConnectionError as error:
        parser.exit(1, f"hf-alibi: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
