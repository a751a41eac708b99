"""Serving: every way hf_alibi puts a model behind an OpenAI-compatible server, in one package.

- ``server.py``: ``hf-alibi serve MODEL`` on transformers' own server (``transformers serve``), a converted class
  added to its namespace (:func:`serve`, :func:`serving_class`);
- ``guard.py``: what hf_alibi adds to that server's app (each request checked before a handler reads it, the cap on
  new tokens, the process ended in one line when the continuous-batching worker dies);
- ``request_checks.py``: the checks themselves and OpenAI's error shape, built once (no torch: the command line's
  front reads its defaults);
- ``vllm/``: vLLM's plugin (the converted architectures registered with vLLM, its backend pinned to one that applies
  the slopes, sinks on vLLM's kernels). vLLM enters it through ``hf_alibi_boot.vllm`` (the entry point and the server
  process, which must run before hf_alibi imports transformers).

This file imports nothing: the command line's front loads ``request_checks`` through it before torch is imported.
``hf_alibi.serve.serve`` and the other names of ``server.py`` load that module on first use.
"""

from __future__ import annotations

_SERVER_NAMES = ("serve", "serving_class", "native_loader", "check_server_version", "MissingServingExtras")
__all__ = list(_SERVER_NAMES)


def __getattr__(name: str):
    if name in _SERVER_NAMES:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
