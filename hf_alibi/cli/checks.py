"""The ``hf-alibi`` command line's checks that need no model: paths, text files, upload flags, the conversion
options' values (against SRC's config.json and its architecture row: :mod:`hf_alibi.convert.planning`'s rules),
``serve``'s engine, cap and port.

They run before the library is imported, so that every error a user can cause answers at once; the jobs check the
same again (they are library functions too). Imports only the standard library and hf_alibi's modules that import
neither torch nor transformers (tests/cli/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..convert.planning import (  # noqa: F401  (config_heads, HEAD_FIELDS: re-exported for callers of the CLI)
    HEAD_FIELDS,
    HeadsMismatch,
    applies,
    builtin_rows,
    check_heads,
    config_fields,
    config_heads,
    encoder_variant_for,
    resolve_options,
)
from ..core.settings import check_pretrained_options, conversion_options, preset_name
from ..evaluate.inputs import CompareError, check_configs, check_output_folder, local_configs, parse_rope
from ..export.gguf import check_output_file
from ..hub.checkpoints import check_output, check_source, is_hub_id, is_local
from ..recover.settings import settings_from_flags
from ..serve.request_checks import LIMIT_FLAGS, Limits
from .parser import SERVE_FLAGS, SERVING_ENGINES, CliError, flag, take_option

OPTIONS: tuple[str, ...] = tuple(f.name for f in conversion_options())


def check_inputs(args: argparse.Namespace) -> None:
    """The checks of a parsed command line that need no model, so that their errors come at once: SRC a folder or
    a Hub id (the offline cache too), OUT writable, the text files there, the upload flags, the option values."""
    if args.command in ("convert", "recover", "info"):
        check_source(args.path if args.command == "info" else args.src, "PATH" if args.command == "info" else "SRC")
    if args.command in ("convert", "recover"):
        check_output(args.src, args.out, args.overwrite)
    if args.command == "convert":
        _check_push_arguments(args)
        _check_file(fit_file(args), "fit_text")
        check_conversion_values(args)
    if args.command == "recover":
        _check_file(args.train_file, "train_file")
        _check_file(args.validation_file, "validation_file")
        try:  # each setting's own check (those that need the model's config: the job's, before it loads)
            settings_from_flags(args)
        except ValueError as error:
            raise CliError(str(error)) from None
    if args.command == "export-gguf":
        check_source(args.src)
        check_output_file(args.out, args.overwrite)
    if args.command == "compare":
        check_compare(args)


def check_compare(args: argparse.Namespace) -> None:
    """``compare``'s inputs that need no model: each MODEL a folder (a causal LM by its config.json) or a Hub id, one
    vocabulary size, each --rope baseline, the text, the output folder (hf_alibi.evaluate.inputs: the library asks the
    same again)."""
    if args.text is not None and args.dataset is not None:
        raise CliError(f"{flag('text')} and {flag('dataset')} both name a text: keep one.")
    _check_file(args.text, "text")
    try:
        check_configs(local_configs(args.models))
        for spec in args.rope:
            parse_rope(spec)
        check_output_folder(args.out, args.overwrite)
    except CompareError as error:
        raise CliError(str(error)) from None


def check_conversion_values(args: argparse.Namespace) -> None:
    """``convert``'s heads and options checked by the planner :func:`hf_alibi.plan_conversion` calls
    (:mod:`hf_alibi.convert.planning`), from SRC's config.json read as JSON (a folder here; a Hub id is the job's):
    the head count, the encoder variant, the values as they would be stored (the preset's where they fit, overridden
    by the explicit ones: an option that needs another, as rotary_stretch needs rotary_knee, reads the preset's) with
    each option's own check (:func:`~hf_alibi.core.settings.check_pretrained_options`) and where
    it applies (the type's row)."""
    config = _local_config(args.src)
    fields = config_fields(config)  # config.json's fields, as the declarations read a config's
    try:
        heads = check_heads(args.heads, fields.num_attention_heads)
    except HeadsMismatch as error:
        raise CliError(
            f"{flag('heads')} {error.given} does not match SRC's {error.found} attention heads (its config.json); "
            f"ALiBi needs one slope per head. Pass {flag('heads')} {error.found} or leave it out."
        ) from None
    row = builtin_row(config.get("model_type"))
    explicit = {name: getattr(args, name) for name in OPTIONS}
    try:
        if row is not None:
            encoder_variant_for(row, args.encoder_variant)
        values = resolve_options(fields, row, preset_name(args.preset), **explicit)
    except ValueError as error:
        raise CliError(str(error)) from None
    if row is not None:  # where the declaration says an option applies by the model's config (sinks: one mask)
        for option in conversion_options():
            value = explicit[option.name]
            given = value is not None and value != option.default
            if option.metadata["refusal"] is None and given and not applies(option, row, fields):
                pair = (
                    " (an encoder-decoder: its two stacks are padded apart)"
                    if config.get("is_encoder_decoder")
                    else ""
                )
                raise CliError(
                    f"{flag(option.name)} {value} does not apply to SRC's {row.model_type} model{pair}; leave it out."
                )
    slopes = values["slopes"]
    count = heads or (len(slopes) if slopes else 1)  # unknown here: the job counts them
    try:
        check_pretrained_options(count, architecture=None if row is None else row.to_dict(), **values)
    except ValueError as error:
        raise CliError(f"{error} Nothing converted.") from None


def _local_config(src: str) -> dict[str, Any]:
    """SRC's config.json as JSON when SRC is a folder here (:func:`check_source` read it), else ``{}``."""
    if not is_local(src):
        return {}
    return json.loads((Path(src).expanduser() / "config.json").read_text())


def builtin_row(model_type: str | None):
    """The built-in architecture row of ``model_type`` (:func:`hf_alibi.convert.planning.builtin_rows`: plain data,
    read without torch), or ``None``: not a converted type (a type trained with ALiBi included: the job says what it
    is)."""
    return builtin_rows()[0].get(model_type)


def _check_push_arguments(args) -> None:
    if args.push_to_hub is None:
        upload_flags = (("private", args.private), ("commit_message", args.commit_message))
        given = [flag(name) for name, value in upload_flags if value]
        if given:
            raise CliError(f"{' and '.join(given)} apply to the upload only: pass {flag('push_to_hub')} REPO_ID too.")
    elif not is_hub_id(args.push_to_hub):
        raise CliError(
            f"{flag('push_to_hub')} {args.push_to_hub!r} is not a valid Hub repo id (name or user/name); nothing "
            "converted."
        )


def fit_file(args: argparse.Namespace) -> str | None:
    """The text convert's ``fit_slopes`` fits on (its ``fit_text`` flag; the old form, a text given to ``fit_slopes``
    itself, too, with a note on stderr), else ``None``; a ``CliError`` for ``fit_slopes`` without a text."""
    fit, text = flag("fit_slopes"), flag("fit_text")
    if isinstance(args.fit_slopes, str):
        if args.fit_text is not None:
            raise CliError(f"{fit} TEXT_FILE and {text} both name a text: keep {text}.")
        print(
            f"hf-alibi: note: {fit} TEXT_FILE is now {fit} {text} TEXT_FILE (as in `recover`, {fit} is a switch); "
            "the old form goes in the next release.",
            file=sys.stderr,
        )
        args.fit_slopes, args.fit_text = True, args.fit_slopes  # read as the new form from here on: one note
    if args.fit_slopes and args.fit_text is None:
        raise CliError(f"{fit} fits on a text, and convert has no training text: add {text} TEXT_FILE.")
    return args.fit_text


def _check_file(path: str | None, name: str) -> None:
    if path is not None and not os.path.isfile(path):
        raise CliError(f"{flag(name)} {path!r} is not a file: pass the path of a text file.")


def serving_engine(argv: list[str]) -> tuple[str, list[str]]:
    """``hf-alibi serve MODEL ...``'s ``--engine`` (``transformers``, the default, or ``vllm``) and the command line
    without it.

    >>> serving_engine(["m", "--engine", "vllm", "--port", "8000"])
    ('vllm', ['m', '--port', '8000'])
    """
    values, rest = take_option(argv, "engine")
    for value in values:
        if value not in SERVING_ENGINES:
            choices = ", ".join(SERVING_ENGINES)
            raise CliError(f"argument --engine: invalid choice {value or ''!r} (choose from {choices})")
    return (values[-1] if values else SERVING_ENGINES[0]), rest


def serve_options(argv: list[str]) -> tuple[Limits, list[str]]:
    """``hf-alibi serve MODEL ...``'s limits (``--max-new-tokens-cap N``, ``--max-prompt-tokens N``,
    ``--max-body-bytes BYTES``, ``--read-timeout SECONDS``, ``--idle-timeout SECONDS``, ``--max-concurrent-requests
    N``, ``--max-queued-requests N``, taken out: the rest goes to
    `transformers serve`) and the options this command answers in its own form before `transformers serve` parses
    them (with the library loaded): the port, a number from 0 to 65535.

    >>> serve_options(["--port", "8000", "--max-new-tokens-cap", "256"])[0].new_tokens
    256
    """
    given, rest = {}, argv
    for declared in SERVE_FLAGS:
        if declared.name not in LIMIT_FLAGS:
            continue
        values, rest = take_option(rest, declared.name)
        for value in values:
            try:
                given[LIMIT_FLAGS[declared.name]] = declared.keywords["type"](value)
            except (TypeError, ValueError):
                raise CliError(f"{flag(declared.name)} takes a {_UNITS[declared.name]} (got {value!r})") from None
    for value in take_option(rest, "port")[0]:
        if not (value and value.isdigit() and int(value) <= 65535):
            raise CliError(f"argument {flag('port')}: invalid port {value or ''!r}: give a number from 0 to 65535.")
    return Limits(**given), rest


_UNITS = {"max_new_tokens_cap": "positive number of new tokens per request",
          "max_prompt_tokens": "positive number of prompt tokens per request",
          "max_body_bytes": "positive number of bytes", "read_timeout": "positive number of seconds",
          "idle_timeout": "positive number of seconds", "max_concurrent_requests": "positive number of requests",
          "max_queued_requests": "positive number of requests"}  # fmt: skip
