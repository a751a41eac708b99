"""The ``hf-alibi`` command line's parser: every command's flags, each declared once; the one reader of an option
in a command line that is passed on (:func:`take_option`: ``serve``'s); the one error exit (:func:`fail`).

``recover``'s flags come from :class:`~hf_alibi.recover.settings.RecoverySettings`, the conversion options' from
:class:`~hf_alibi.core.settings.AlibiSettings`; ``convert``'s own flags are declared here (:data:`CONVERT_FLAGS`),
``serve``'s too (:data:`SERVE_FLAGS`), and every flag is spelled by :func:`~hf_alibi.core.settings.flag_spellings`
from its name.

Imports only the standard library and hf_alibi's modules that import neither torch nor transformers: ``hf-alibi``
builds this parser before the library is imported (hf_alibi_boot, tests/cli/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..core.names import ENCODER_VARIANTS
from ..core.settings import FIT_TOKENS, conversion_options, flag_spellings, presets
from ..core.version import __version__
from ..evaluate.inputs import DEFAULT_LENGTHS, DEFAULT_MAX_TOKENS, DEPTHS, PLOT_FILE, RESULTS_FILE
from ..export.gguf import OUTTYPES, GGUFExportError
from ..hub.checkpoints import CheckpointError
from ..recover.settings import add_setting_flags
from ..serve.request_checks import Limits


class CliError(Exception):
    """A bad input: printed as ``hf-alibi: error: ...`` with exit status 2."""


def fail(message: object, status: int = 2) -> NoReturn:
    """The command's one error exit: ``hf-alibi: error: MESSAGE`` on stderr, one line, and exit ``status`` (2: a bad
    input; 1: the Hub could not be reached)."""
    sys.stderr.write(f"hf-alibi: error: {message}\n")
    sys.exit(status)


@contextmanager
def errors_exit(*more: type[BaseException]) -> Iterator[None]:
    """A bad input raised inside (:class:`CliError`, the library's ``CheckpointError``, ``GGUFExportError`` and the
    classes in ``more``) ends the command through :func:`fail`, a ``ConnectionError`` with status 1."""
    try:
        yield
    except (CliError, CheckpointError, GGUFExportError, *more) as error:
        fail(error)
    except ConnectionError as error:
        fail(error, 1)


class Parser(argparse.ArgumentParser):
    """Bad arguments are one line (``hf-alibi: error: ...``, naming the command's help) and exit status 2,
    like the other errors (argparse would print its usage block first)."""

    commands: dict[str, argparse.ArgumentParser]  # hf-alibi's: each command's parser (build_parser)

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)")


def flag(name: str) -> str:
    """How the command line spells the setting ``name`` in messages (its first spelling, dashed).

    >>> flag("fit_text") == flag_spellings("fit_text")[0]
    True
    """
    return flag_spellings(name)[0]


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"  # what argparse calls a bad value


@dataclass(frozen=True)
class Flag:
    """A command's flag: the setting it names (its ``dest``; spelled by ``flag_spellings``: dashed, also with
    underscores) and ``argparse.add_argument``'s keywords."""

    name: str
    help: str
    keywords: dict[str, Any] = field(default_factory=dict)


def _option_flags() -> tuple[Flag, ...]:
    """The conversion options as flags, from their declarations (``AlibiSettings``)."""
    return tuple(
        Flag(o.name, o.metadata["flag_help"], {"type": o.metadata["parse"], "default": None})
        for o in conversion_options()
    )


_SWITCH = {"action": "store_true", "default": False}
# convert's flags, in the help's order. fit_slopes is a switch, as in `recover` (which fits on its training text);
# convert reads fit_text. The old form, a text given to fit_slopes itself, still parses (with a note) for one release
CONVERT_FLAGS: tuple[Flag, ...] = (
    Flag("heads", "number of heads (must match; checked)", {"type": positive_int}),
    Flag("encoder_variant", "bidirectional bias (default symmetric)", {"choices": ENCODER_VARIANTS}),
    Flag("preset", "pretrained: keep more of what a pretrained model knew", {"choices": sorted(presets())}),
    *_option_flags(),
    Flag(
        "fit_slopes",
        f"fit the slopes per layer and head on {flag('fit_text')} (hf_alibi.fit_slopes; instead of {flag('slopes')})",
        {"nargs": "?", "const": True, "metavar": "TEXT_FILE"},
    ),
    Flag("fit_text", f"{flag('fit_slopes')}: the text to fit on", {"metavar": "TEXT_FILE"}),
    Flag("fit_scale", f"{flag('fit_slopes')}: C in C / mean distance (default: fit_slopes')", {"type": float}),
    Flag("fit_tokens", f"{flag('fit_slopes')}: tokens of the text used", {"type": int, "default": FIT_TOKENS}),
    Flag("overwrite", "replace OUT if it exists", _SWITCH),
    Flag("push_to_hub", "then upload OUT to this Hub repo", {"metavar": "REPO_ID"}),
    Flag("private", "create the Hub repo private", _SWITCH),
    Flag("commit_message", "commit message of the upload"),
)


# compare's flags (hf_alibi.evaluate.compare's keywords, one each), in the help's order
_LENGTHS = {"type": positive_int, "nargs": "+", "default": list(DEFAULT_LENGTHS)}
_PROTOCOLS = {"nargs": "+", "choices": ("nonoverlapping", "sliding"), "default": ["nonoverlapping"]}
COMPARE_FLAGS: tuple[Flag, ...] = (
    Flag("lengths", "perplexity at these window lengths", _LENGTHS),
    Flag("protocols", "fairseq's: nonoverlapping windows, and/or sliding (each scores its last stride)", _PROTOCOLS),
    Flag("stride", "sliding windows' step (default: half the length)", {"type": positive_int}),
    Flag(
        "max_tokens",
        "the most tokens the windows of each length cover",
        {"type": positive_int, "default": DEFAULT_MAX_TOKENS},
    ),
    Flag(
        "position_tokens",
        "by-position stream (default: 2x the longest native length, or the whole text if shorter; 0: off)",
        {"type": int},
    ),
    Flag(
        "rope",
        "baselines: the first MODEL with transformers' rope_parameters TYPE (yarn, linear, dynamic) at FACTOR",
        {"nargs": "+", "metavar": "TYPE:FACTOR", "default": []},
    ),
    Flag("chunk", "queries per forward along the stream (KV cache)", {"type": positive_int, "default": 1024}),
    Flag(
        "passkey_lengths",
        "passkey retrieval at these lengths (default: the longest of --lengths; none: off)",
        {"type": positive_int, "nargs": "*"},
    ),
    Flag("depths", "where the passkey hides (0: start, 1: end)", {"type": float, "nargs": "+", "default": [*DEPTHS]}),
    Flag("text", "a plain-text file (default: the embedded corpus's validation split)", {"metavar": "FILE"}),
    Flag("dataset", "a datasets name (NAME or NAME:CONFIG, a 'text' column) instead of --text"),
    Flag("split", "--dataset's split", {"default": "validation"}),
    Flag("device", "cpu, cuda, cuda:1, ... (default: cuda when there is one, in bf16; else cpu, fp32)"),
    Flag("out", f"the folder for {RESULTS_FILE} and {PLOT_FILE}", {"default": "compare"}),
    Flag("overwrite", f"replace {RESULTS_FILE} and {PLOT_FILE} in --out", _SWITCH),
)


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


positive_float.__name__ = "positive number"
_LIMITS = Limits()  # the defaults
SERVING_ENGINES = ("transformers", "vllm")
# serve's own flags, taken out of its command line (take_option); the rest is the engine's server's, passed on
SERVE_FLAGS: tuple[Flag, ...] = (
    Flag(
        "engine",
        "transformers: transformers serve (its options follow MODEL); vllm: vLLM's OpenAI server, `vllm serve`'s "
        "options (docs/engines.md)",
        {"choices": SERVING_ENGINES, "default": "transformers"},
    ),
    Flag(
        "max_new_tokens_cap",
        f"the most new tokens a request may ask for (one that names no maximum gets it; default {_LIMITS.new_tokens})",
        {"type": positive_int, "default": _LIMITS.new_tokens, "metavar": "N"},
    ),
    Flag(
        "max_prompt_tokens",
        f"the most tokens a prompt may have, as the model reads it; more: 400 (default {_LIMITS.prompt_tokens})",
        {"type": positive_int, "default": _LIMITS.prompt_tokens, "metavar": "N"},
    ),
    Flag(
        "max_body_bytes",
        f"the largest request body; larger: 413, read no further (default {_LIMITS.body_bytes}, 1 MiB)",
        {"type": positive_int, "default": _LIMITS.body_bytes, "metavar": "BYTES"},
    ),
    Flag(
        "read_timeout",
        f"seconds to receive a request's headers, then its body; later: 408 and the connection closed (default "
        f"{_LIMITS.read_timeout:g})",
        {"type": positive_float, "default": _LIMITS.read_timeout, "metavar": "SECONDS"},
    ),
    Flag(
        "idle_timeout",
        f"seconds a connection may hold no request, before its first and between requests, before it is closed "
        f"(default {_LIMITS.idle_timeout:g})",
        {"type": positive_float, "default": _LIMITS.idle_timeout, "metavar": "SECONDS"},
    ),
    Flag(
        "max_concurrent_requests",
        f"generation requests inside the engine at once; the others wait their turn in arrival order, and leave the "
        f"queue if their client does (default {_LIMITS.concurrent})",
        {"type": positive_int, "default": _LIMITS.concurrent, "metavar": "N"},
    ),
    Flag(
        "max_queued_requests",
        f"requests that may wait for a place; one more: 429 with Retry-After (default {_LIMITS.queued})",
        {"type": positive_int, "default": _LIMITS.queued, "metavar": "N"},
    ),
)
SERVE_USAGE = (
    f"%(prog)s MODEL [--engine transformers|vllm] [--max-new-tokens-cap N (default {_LIMITS.new_tokens})] "
    "[--max-prompt-tokens N] [--max-body-bytes BYTES] [--read-timeout SECONDS] [--idle-timeout SECONDS] "
    "[--max-concurrent-requests N] [--max-queued-requests N] [the engine's server options]"
)
SERVE_DESCRIPTION = (
    "MODEL: a converted folder or Hub id, or a BLOOM, MPT or Falcon-RW one, run on hf_alibi's attention. The options "
    "follow MODEL: hf-alibi's own (below), then the engine's server's, passed on unchanged (transformers serve's: the "
    "port, continuous batching, ...; with --engine vllm, `vllm serve`'s: docs/engines.md)."
)


def take_option(argv: list[str], name: str) -> tuple[list[str | None], list[str]]:
    """The values of the flag ``name`` in a command line that is passed on (``--name VALUE`` or ``--name=VALUE``, in
    every spelling :func:`~hf_alibi.core.settings.flag_spellings` gives; None: the flag last, without its value),
    and the command line without them. The one reader of such a flag (``serve``'s: the engine, the cap, the port).

    >>> take_option(["m", "--port", "8000", "--engine=vllm"], "engine")
    (['vllm'], ['m', '--port', '8000'])
    """
    spellings, values, rest = flag_spellings(name), [], []
    words = iter(argv)
    for word in words:
        spelled, equals, value = word.partition("=")
        if spelled not in spellings:
            rest.append(word)
        else:
            values.append(value if equals else next(words, None))
    return values, rest


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...]) -> None:
    for declared in flags:
        keywords = {"default": None, **declared.keywords}
        parser.add_argument(*flag_spellings(declared.name), dest=declared.name, help=declared.help, **keywords)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """The conversion options as flags (slope_scale: dashed, also with underscores), from their declarations."""
    add_flags(parser, _option_flags())


def build_parser() -> Parser:
    parser = Parser(prog="hf-alibi", description="ALiBi checkpoints: convert, inspect, share.")
    parser.add_argument("--version", action="version", version=f"hf-alibi {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    conv = commands.add_parser("convert", help="convert a checkpoint (folder or Hub id) to ALiBi")
    conv.add_argument("src", metavar="SRC", help="checkpoint folder or Hub id; only read")
    conv.add_argument("out", metavar="OUT", help="folder to write the ALiBi checkpoint to")
    add_flags(conv, CONVERT_FLAGS)

    rec = commands.add_parser(
        "recover",
        help="convert a checkpoint and recover it by self-distillation from the original on your text",
        description="Load SRC, convert a copy to ALiBi, train it to give SRC's outputs on your unlabeled text "
        "at the original length (KL of next-token distributions for causal LMs, hidden states for encoders), "
        "and write OUT as a converted checkpoint. See hf_alibi.recover.",
    )
    rec.add_argument("src", metavar="SRC", help="the original checkpoint (folder or Hub id, with a tokenizer)")
    rec.add_argument("out", metavar="OUT", help="folder to write the recovered ALiBi checkpoint to")
    add_flags(rec, (Flag("train_file", "unlabeled text: .txt, or .jsonl with 'text'", {"required": True}),))
    add_flags(rec, (Flag("validation_file", "held-out text (default: the end of F)"),))
    add_setting_flags(rec)  # every recovery setting with a flag, the conversion options' among them
    add_flags(
        rec,
        (Flag("checkpoint_dir", "default: OUT.checkpoints"), Flag("overwrite", "replace OUT if it exists", _SWITCH)),
    )

    gguf = commands.add_parser("export-gguf", help="write a converted checkpoint as GGUF for llama.cpp")
    gguf.add_argument("src", metavar="SRC", help="converted checkpoint folder or Hub id (with its tokenizer)")
    gguf.add_argument("out", metavar="OUT", help="the .gguf file to write")
    add_flags(
        gguf, (Flag("outtype", "the matrices' type (norms, biases: f32)", {"choices": OUTTYPES, "default": "f32"}),)
    )
    add_flags(gguf, (Flag("overwrite", "replace OUT if it exists", _SWITCH),))

    serve = commands.add_parser(
        "serve",
        help="serve a converted checkpoint (or a BLOOM, MPT, Falcon-RW) with transformers' OpenAI-compatible server",
        usage=SERVE_USAGE,
        description=SERVE_DESCRIPTION,
    )
    serve.add_argument("model", metavar="MODEL", help="a converted folder or Hub id (or BLOOM, MPT, Falcon-RW)")
    add_flags(serve, SERVE_FLAGS)
    cmp = commands.add_parser(
        "compare",
        help="measure an original and its conversions on the same tokens: perplexity by length and by position, "
        "passkey; a table, a plot, a JSON",
        description="Perplexity at each length (fairseq's protocols), by position along one stream through the KV "
        "cache, and passkey retrieval, for every MODEL on the same tokens; prints a table (ratios to the first MODEL) "
        f"and writes OUT/{RESULTS_FILE} and OUT/{PLOT_FILE}. See hf_alibi.evaluate.compare and docs/pretrained.md.",
    )
    cmp.add_argument(
        "models", metavar="MODEL", nargs="+", help="folders or Hub ids; the first is the ratios' baseline"
    )
    add_flags(cmp, COMPARE_FLAGS)
    info = commands.add_parser("info", help="is PATH an ALiBi checkpoint, with which settings")
    info.add_argument("path", metavar="PATH", help="checkpoint folder or Hub id")
    add_flags(info, (Flag("json", "print the report as JSON", _SWITCH),))
    parser.commands = commands.choices  # each command's parser by name (serve's help: hf_alibi.cli)
    return parser
