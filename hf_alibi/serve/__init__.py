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

This file imports nothing but the lazy-name helper (``hf_alibi/_lazy.py``): the command line's front loads
``request_checks`` through it before torch is imported.
``hf_alibi.serve.serve`` and the other names of ``server.py`` load that module on first use.
"""

from __future__ import annotations

from .._lazy import lazy_names

_SERVER_NAMES = ("serve", "serving_class", "native_loader", "check_server_version", "MissingServingExtras")
__all__ = list(_SERVER_NAMES)


__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SERVER_NAMES, "server"))
