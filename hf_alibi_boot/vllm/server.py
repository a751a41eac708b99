"""vLLM's OpenAI-compatible server on a converted folder, run as a file: ``python -m hf_alibi_boot.vllm MODEL
[options]`` (and ``hf-alibi serve MODEL --engine vllm``) start ``python .../hf_alibi_boot/vllm/server.py MODEL
[options]``.

As a file, because vLLM starts its engine in processes of its own (``spawn`` on the CPU), and such a process runs
its parent's main file before anything else, but never a ``__main__`` module of a package: so each of them imports
:mod:`hf_alibi_boot.vllm` first and what cannot load is hidden before vLLM imports transformers. The server itself is
vLLM's (``vllm serve``'s api_server entry): every option is vLLM's.
"""

import os
import sys

import hf_alibi_boot.vllm  # first, here and in every process vLLM spawns from this file


def main(argv: list[str]) -> None:
    """vLLM's api_server entry with ``argv`` (``MODEL`` first, or ``--model MODEL`` among them)."""
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    from vllm.entrypoints.launchers.api_server.entry import main as api_server

    from hf_alibi.serve.request_checks import limits_from_environment

    limits = limits_from_environment()  # hf-alibi serve --engine vllm's bounds (hf_alibi.serve.vllm.guard)
    if limits is not None:
        from hf_alibi.serve.connections import bound_connections

        bound_connections(limits)  # idle connections closed, late headers answered 408, in vLLM's uvicorn server

    sys.argv = ["vllm", *argv]  # its parser reads sys.argv
    api_server()


def exec_server(argv: list[str]) -> None:
    """This file, with ``argv``, in the calling process's place, in :func:`hf_alibi_boot.vllm.environment` (``python -m
    hf_alibi_boot.vllm`` and ``hf-alibi serve MODEL --engine vllm``)."""
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], hf_alibi_boot.vllm.environment())


if __name__ == "__main__":
    main(sys.argv[1:])
