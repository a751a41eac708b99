"""``hf-alibi``: convert a checkpoint to ALiBi, inspect one, push one to the Hub.

    hf-alibi convert SRC OUT [conversion options] [upload options]
    hf-alibi recover SRC OUT [its training text, recovery settings, conversion options]
    hf-alibi export-gguf SRC OUT.gguf
    hf-alibi serve MODEL [transformers serve options]
    hf-alibi info PATH
    hf-alibi compare MODEL [MODEL ...] [--text FILE] [--lengths ...] [--out DIR]

The command line is this package: :mod:`~hf_alibi.cli.parser` (every command's flags, from their declarations; the
one reader of a passed-on option; the one error exit), :mod:`~hf_alibi.cli.checks` (what needs no model: paths,
texts, option values through :mod:`hf_alibi.convert.planning`), both without torch, and :mod:`~hf_alibi.cli.jobs`
(with the library: ``convert_checkpoint``, ``recover_checkpoint``, ``checkpoint_info``, ``compare`` through
:func:`hf_alibi.evaluate.compare`, and :func:`~hf_alibi.cli.jobs.run`,
which calls one and reports). This module answers what needs no model (:func:`answer`), then runs the job
(:func:`run_job`). ``hf-alibi`` is :func:`main` (pyproject.toml's ``[project.scripts]``); ``import hf_alibi`` is light
(hf_alibi/__init__.py), so the help, the version and every error that needs no model come before torch loads.

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
import os
import sys

# Module level imports only the standard library and hf_alibi's modules that import neither torch nor transformers:
# the command line is parsed, and the help, the version and every error that needs no model answered, before the
# library is imported (seconds); a job then runs in ``hf_alibi.cli.jobs`` (:func:`run_job`).
from ..hub.checkpoints import (
    TOKENIZER_FILES,  # noqa: F401  (re-exported: callers of the CLI import it from here)
    check_source,
)
from ..serve.request_checks import VLLM_MIDDLEWARE, limits_environment
from .checks import check_inputs, serve_options, serving_engine
from .parser import CliError, add_option_flags, build_parser, errors_exit, fail, take_option  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and check what needs no model (here: no torch, no transformers), then run the job.

    >>> main(["info", "gpt2-alibi"])  # doctest: +SKIP
    gpt2-alibi: ALiBi checkpoint of gpt2 (GPT2LMHeadModel)
    """
    parser, parsed = answer(argv)
    return run_job(parser, parsed)


def answer(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """What the command answers before the library is imported: the help, the version and every error that needs
    no model exit here (``hf-alibi: error: ...``, status 2). Returns the parser and the checked command line for
    :func:`run_job`."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the rest is the engine's server's own command line (hf_alibi/serve/server.py)
        return parser, _serve(parser, argv[1:])
    args = parser.parse_args(argv)
    with errors_exit():
        check_inputs(args)
    return parser, args


def run_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run what :func:`answer` checked, with the library imported (``hf_alibi.cli.jobs``)."""
    return importlib.import_module("hf_alibi.cli.jobs").run(args)


def _serve(parser, argv: list[str]) -> argparse.Namespace:
    """``serve``'s command line: MODEL, hf-alibi's own flags (:data:`~hf_alibi.cli.parser.SERVE_FLAGS`, read by
    :func:`~hf_alibi.cli.parser.take_option`) and the engine's server's options, passed on unchanged."""
    if argv[:1] in (["-h"], ["--help"]):
        print(parser.commands["serve"].format_help())
        print("transformers serve's options follow (needs transformers' serving extras: pip install "
              "'transformers[serving]'):", flush=True)  # fmt: skip
        from hf_alibi.serve.compat import transformers_cli_app

        transformers_cli_app()(args=["serve", "--help"], prog_name="hf-alibi")
    if not argv or argv[0].startswith("-"):
        fail("serve needs MODEL first (a converted folder or Hub id), then `transformers serve`'s options")
    with errors_exit():
        check_source(argv[0], "MODEL")
        engine, argv = serving_engine(argv)
        if engine == "vllm" and take_option(argv, "max_prompt_tokens")[0]:
            raise CliError("--max-prompt-tokens is transformers' server's: with --engine vllm a prompt is bounded by "
                           "vLLM's --max-model-len.")  # fmt: skip
        limits, arguments = serve_options(argv[1:])
        if engine == "vllm":
            _exec_vllm([argv[0], *arguments], limits)
    return argparse.Namespace(command="serve", model=argv[0], engine=engine, limits=limits, arguments=arguments)


def _exec_vllm(argv: list[str], limits) -> None:
    """vLLM's OpenAI server in this process's place: ``python -m hf_alibi_boot.vllm``, which starts every process of it
    as vLLM's entrance must (hf_alibi_boot/vllm/server.py; run, not imported: nothing of hf_alibi imports it), its
    requests bounded by ``limits`` (:mod:`hf_alibi.serve.vllm.guard`, added as vLLM's ``--middleware``)."""
    if importlib.util.find_spec("vllm") is None:
        raise CliError("--engine vllm needs vLLM: pip install -e '.[vllm]' (docs/engines.md).")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "hf_alibi_boot.vllm", *argv, "--middleware", VLLM_MIDDLEWARE],
              {**os.environ, **limits_environment(limits)})  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
