"""The jobs ``hf-alibi`` runs, with the library imported: :func:`run` calls one and reports; the checkpoint jobs take
a folder or Hub id in and give a converted checkpoint folder (or a report) out.

:func:`convert_checkpoint` (``hf-alibi convert``) loads SRC, converts it and writes OUT;
:func:`recover_checkpoint` (``hf-alibi recover``) loads the original, distils it into a converted copy
(:func:`hf_alibi.recover.recover`) and writes the result; :func:`checkpoint_info` (``hf-alibi info``) reads
one; ``hf-alibi serve`` runs :func:`hf_alibi.serve.serve`. Every input is checked before anything loads; OUT is
written in a staging folder beside it and renamed at the end; bad input is a
:class:`hf_alibi.checkpoints.CheckpointError` (:func:`run` prints it through the one error exit, status 2).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoConfig, AutoTokenizer

from ..checkpoints import CheckpointError, Source, check_output, is_alibi, open_source, staged_output
from ..core.settings import AlibiSettings, describe_options
from ..evaluate.inputs import CompareError
from ..fit import fit_slopes
from ..hub.folder import write_converted
from ..patch import ConversionPlan, patch_model, plan_conversion, takes_options
from ..positions import original_length
from ..recover.settings import check_fit_slopes, settings_from_flags
from ..registry import get_native_architecture, supported_model_types
from ..serve.server import MissingServingExtras
from .checks import OPTIONS, fit_file
from .parser import errors_exit

if TYPE_CHECKING:
    from ..recover.settings import RecoverySettings


@takes_options
def convert_checkpoint(
    src: str,
    out: str | os.PathLike,
    heads: int | None = None,
    encoder_variant: str | None = None,
    overwrite: bool = False,
    fit_file: str | os.PathLike | None = None,
    fit_scale: float | None = None,
    fit_tokens: int = 1024,
    preset: str | None = None,
    **options,
) -> Path:
    """Convert the checkpoint ``src`` to ALiBi into the folder ``out`` (what ``hf-alibi convert`` does).

    ``preset`` and the conversion ``options`` are :func:`hf_alibi.patch_model`'s. Every argument is checked
    before the model is loaded; bad input is a :class:`CheckpointError`. The folder is written next to ``out``
    first and moved in place at the end, so a failure leaves no half-written ``out`` (and with ``overwrite`` the old
    one stays until the new one is complete).
    It holds SRC's companion files (:func:`hf_alibi.hub.write_converted`).

    ``fit_file``: a text file; the slopes are fitted per layer and head on its first ``fit_tokens`` tokens by
    the original (:func:`hf_alibi.fit_slopes`, ``scale`` ``fit_scale``) and given to ``patch_model`` as ``slopes``.

    >>> convert_checkpoint("my-gpt2", "gpt2-alibi", preset="pretrained")  # doctest: +SKIP
    """

    out = Path(out)
    check_output(src, out, overwrite)
    source = open_source(src)  # resolved once, carried to the last write
    model_cls = source.model_class()
    plan = _plan(source, heads, encoder_variant, preset, options)
    fit_text = _fit_text(fit_file, fit_scale, fit_tokens, options)
    src_has_tokenizer = source.has_tokenizer()
    if fit_text is not None and src_has_tokenizer is False:
        raise CheckpointError(f"--fit-slopes tokenizes the text with SRC's tokenizer, but SRC {src!r} has none.")
    with staged_output(out) as staging:  # made first: a place that cannot be written fails before loading
        try:
            model = model_cls.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(
                f"Could not load the model from SRC {src!r} as {model_cls.__name__}: {error}"
            ) from error
        tokenizer = None
        if src_has_tokenizer is not False:
            try:
                tokenizer = AutoTokenizer.from_pretrained(src)
            except Exception as error:
                if src_has_tokenizer or fit_text is not None:
                    raise CheckpointError(
                        f"SRC {src!r} has tokenizer files that could not be loaded: {error}"
                    ) from error
        if fit_text is not None:
            ids = tokenizer(fit_text, truncation=True, max_length=fit_tokens, return_tensors="pt")["input_ids"]
            try:
                scale = {} if fit_scale is None else {"scale": fit_scale}
                plan = plan.with_slopes(fit_slopes(model, ids, sinks=plan.settings.sinks, **scale))
            except ValueError as error:
                raise CheckpointError(str(error)) from error
        try:
            patch_model(model, plan=plan)
        except ValueError as error:
            raise CheckpointError(str(error)) from error
        write_converted(staging, model, source, tokenizer)
    return out


def recover_checkpoint(
    src: str,
    out: str | os.PathLike,
    train_file: str | os.PathLike,
    *,
    validation_file: str | os.PathLike | None = None,
    overwrite: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    settings: RecoverySettings | None = None,
    **overrides: Any,
):
    """What ``hf-alibi recover SRC OUT --train_file F`` does: load the original checkpoint ``src``, convert
    a copy, distil (:func:`hf_alibi.recover.recover` with ``settings``, a :class:`~hf_alibi.recover.RecoverySettings`,
    and ``overrides``, settings by name over it), and write ``out`` as a
    normal converted checkpoint (weights, config with the ALiBi settings, remote code, tokenizer) whose
    model card says how it was recovered, plus ``recovery.json`` (settings and agreement history).
    With ``save_steps`` the Trainer's checkpoints go to ``checkpoint_dir`` (default ``OUT.checkpoints``, kept
    after the run); ``resume_from_checkpoint`` (a ``checkpoint-N`` folder, or a folder holding them: the
    last) continues an interrupted run.

    Every input is checked before training, and ``out`` is written into a staging folder next to it and
    renamed at the end: a failure leaves no half-written ``out``. Raises
    :class:`hf_alibi.checkpoints.CheckpointError` (a ``ValueError``) for bad input, before anything is
    loaded or trained: OUT is checked and its staging folder made first.

    Example:
        >>> recover_checkpoint("my-gpt2", "gpt2-alibi", "notes.txt", settings=RecoverySettings(max_steps=300))
    """
    # on use: hf_alibi.recover loads transformers' Trainer, which the other jobs do not need
    from ..recover.api import recover
    from ..recover.blocks import read_texts, token_stream
    from ..recover.lengths import check_text_length, resolve_lengths
    from ..recover.settings import check_settings, recovery_settings
    from ..recover.summary import recovery_card_section

    out = Path(out)
    check_output(src, out, overwrite)
    source = open_source(src)  # resolved once, carried to the last write
    config_dict = source.config
    if is_alibi(config_dict):
        raise CheckpointError(
            f"SRC {src!r} is already an ALiBi checkpoint (model_type {config_dict['model_type']!r}); recover needs "
            "the original checkpoint it was converted from (the teacher)."
        )
    original = original_length(config_dict)
    try:  # every setting, before the tokenizer or the model loads: the teacher's limit is in config.json
        settings = recovery_settings(settings, **overrides)
        if settings.save_steps or settings.resume_from_checkpoint is not None:  # the Trainer's checkpoints go there
            settings = replace(settings, output_dir=str(checkpoint_dir or out.with_name(out.name + ".checkpoints")))
        check_settings(original, settings)
        lengths = resolve_lengths(original, settings.length, max_eval_length=settings.max_eval_length)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    # the conversion's checks too, before anything loads; recover() converts the teacher with this plan
    plan = _plan(source, settings.heads, settings.encoder_variant, settings.preset, settings.conversion_options())
    if settings.resume_from_checkpoint is not None:
        settings = replace(settings, resume_from_checkpoint=_checkpoint_to_resume(settings.resume_from_checkpoint))
    model_cls = source.model_class()
    texts = read_texts(train_file)
    eval_texts = read_texts(validation_file) if validation_file is not None else None
    if source.has_tokenizer() is False:
        raise CheckpointError(
            f"SRC {src!r} has no tokenizer files; recover needs the model's tokenizer to read the text."
        )
    with staged_output(out) as staging:  # made first: a place that cannot be written fails before training
        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(f"Could not load the tokenizer of SRC {src!r}: {error}") from error
        stream = token_stream(texts, tokenizer)
        eval_stream = token_stream(eval_texts, tokenizer) if eval_texts is not None else None
        length = lengths.length
        if eval_stream is None:
            enough = stream.numel() >= 2 * length + 1
        else:
            enough = stream.numel() >= length and eval_stream.numel() >= length + 1
        try:  # before the model loads (recover() checks the split it makes with the same function)
            check_text_length(stream.numel(), length, enough or not length)
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        try:
            teacher = model_cls.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(
                f"Could not load the model from SRC {src!r} as {model_cls.__name__}: {error}"
            ) from error
        try:
            result = recover(teacher, stream, tokenizer, settings, eval_texts=eval_stream, plan=plan)
        except CheckpointError:
            raise
        except ValueError as error:
            raise CheckpointError(str(error)) from error
        result.info["teacher"] = src

        # as hf-alibi convert (SRC's companions kept), the card with how it was recovered
        write_converted(staging, result.student, source, tokenizer, recovery=recovery_card_section(result))
        (staging / "recovery.json").write_text(
            json.dumps({"info": result.info, "history": result.history}, indent=2, default=str) + "\n"
        )
    return out, result


def _checkpoint_to_resume(path: str | os.PathLike) -> str:
    """A Trainer checkpoint folder (``checkpoint-N``), or the last one in a folder of them; else an error."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(path).expanduser()
    if (folder / "trainer_state.json").is_file():
        return str(folder)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        raise CheckpointError(
            f"--resume_from_checkpoint {str(path)!r} is neither a Trainer checkpoint (checkpoint-N with "
            "trainer_state.json) nor a folder holding one. Pass the folder --save_steps wrote to."
        )
    return last


def _plan(source: Source, heads, encoder_variant, preset, options: dict) -> ConversionPlan:
    """The conversion of SRC (:func:`hf_alibi.patch.plan_conversion` on its config), planned before anything loads;
    a :class:`CheckpointError` for a config transformers cannot build or a bad option."""
    try:
        config = AutoConfig.for_model(**source.config)
    except Exception as error:
        raise CheckpointError(
            f"SRC {source.name!r} has a config.json transformers cannot build a config from: {error}"
        ) from error
    try:
        return plan_conversion(config, heads, encoder_variant, preset=preset, **options)
    except ValueError as error:
        raise CheckpointError(str(error)) from error


def checkpoint_info(path: str) -> dict:
    """What ``hf-alibi info`` reports about a checkpoint folder or Hub id, as a dict: ``alibi``, config.json's
    settings as saved; the same settings flattened (``slopes_given``: explicit slopes or None) and ``slopes``, the
    slopes in use.

    >>> checkpoint_info("gpt2-alibi")["heads"]  # doctest: +SKIP
    12
    """
    source = open_source(path, label="PATH")
    config_dict, model_type, local = source.config, source.config["model_type"], source.local
    info = {
        "path": path,
        "model_type": model_type,
        "architectures": config_dict.get("architectures"),
        "is_alibi": is_alibi(config_dict),
    }
    if info["is_alibi"]:
        settings = AlibiSettings.from_dict(config_dict["alibi"])
        info["alibi"] = settings.to_dict()  # as config.json has them: what describes the options, unrenamed
        info.update(info["alibi"])
        info["slopes_given"] = settings.slopes  # explicit slopes (--slopes), else None
        info["slopes"] = settings.slopes_in_use()  # in use
        info["remote_code"] = sorted(set((config_dict.get("auto_map") or {}).values()))
        if local:
            info["remote_code_file"] = (Path(path) / "modeling_alibi.py").is_file()
        if settings.encoder_variant == "learned":
            info["learned_slopes"] = learned_slopes(path) if local else None
    else:
        info["convertible"] = model_type in supported_model_types()
        native = get_native_architecture(model_type)  # trained with ALiBi: run as it is, not converted
        info["native_alibi"] = native is not None and native.uses_alibi(config_dict)
    if local:
        info["tokenizer"] = source.has_tokenizer()
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
        raise CheckpointError(f"PATH {str(path)!r} has no safetensors weights: the learned slopes cannot be read.")
    raw: dict[str, dict[str, torch.Tensor]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as weights:
            for key in weights.keys():
                for suffix in LEARNED_SUFFIXES:
                    if key.endswith(suffix):
                        side = suffix.rsplit("_", 1)[1]  # "left" / "right"
                        raw.setdefault(key.removesuffix(suffix), {})[side] = weights.get_tensor(key)
    if not raw:
        raise CheckpointError(
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
            raise CheckpointError(
                "--fit-scale applies to --fit-slopes only: pass --fit-slopes --fit-text TEXT_FILE too."
            )
        return None
    try:
        check_fit_slopes(True, options)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    if fit_scale is not None and not fit_scale > 0:
        raise CheckpointError(
            f"--fit-scale must be > 0 (the slope of a head is C / its mean distance), got {fit_scale}."
        )
    if fit_tokens < 2:
        raise CheckpointError(f"--fit-tokens must be at least 2, got {fit_tokens}.")
    path = Path(fit_file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"--fit-text {str(path)!r} could not be read as UTF-8 text ({error}).") from error
    if not text.strip():
        raise CheckpointError(f"--fit-text {str(path)!r} holds no text. Pass text like the model's inputs.")
    return text


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
            print(f"Wrote the recovered ALiBi checkpoint to {out} (agreement: {result.final_line})")
        elif args.command == "export-gguf":
            from ..gguf import export_gguf

            path = export_gguf(args.src, args.out, outtype=args.outtype, overwrite=args.overwrite)
            print(f"Wrote {path} ({args.outtype}): {RUN_GGUF.format(path=path)}")
        elif args.command == "info":
            info = checkpoint_info(args.path)
            print(json.dumps(info, indent=2)) if args.json else _print_info(info)
        elif args.command == "compare":
            from ..evaluate import compare, format_comparison

            names = ("lengths", "protocols", "stride", "max_tokens", "position_tokens", "chunk", "passkey_lengths",
                     "depths", "text", "dataset", "split", "device", "out", "overwrite")  # fmt: skip
            print(format_comparison(compare(args.models, **{name: getattr(args, name) for name in names})))
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
