"""Exporting converted models to other runtimes: ``gguf`` (:func:`export_gguf`: one GGUF file for llama.cpp; its
checks before the library loads, :func:`~hf_alibi.export.gguf.check_output_file`, import neither torch nor
transformers: the command line asks them).

>>> from hf_alibi.export import export_gguf  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:  # the homes of the lazy names
    from .gguf import OUTTYPES, GGUFExportError, check_exportable, export_gguf  # noqa: F401

_HOMES = dict.fromkeys(["OUTTYPES", "GGUFExportError", "check_exportable", "export_gguf"], "gguf")
__all__ = sorted(_HOMES)


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
