"""Converting: what a conversion will do (the planner, no torch) and doing it, for the library and the command line
alike, so every option rule is written once.

Modules, one job each: ``planning`` (the option values as stored, the head count, the encoder variant, the built-in
rows read without torch: :func:`~hf_alibi.convert.planning.builtin_rows`), ``patch`` (:func:`plan_conversion`,
:func:`patch_model`), ``registry`` (supported types, :func:`register_architecture`, the Auto registration),
``models`` (the importable home of the ``Alibi<Class>`` classes, named ``hf_alibi.models``), ``positions`` (the
original length, the position table), ``fit`` (:func:`fit_slopes`), ``checkpoint``
(:func:`~hf_alibi.convert.checkpoint.convert_checkpoint`: a folder or Hub id in, a converted folder out, what
``hf-alibi convert`` runs; not named here, as it reaches hub/, which reads this package's rows).

Names resolve on first use (PEP 562): the command line imports ``planning`` without torch.

>>> from hf_alibi.convert import patch_model  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:  # the homes of the lazy names
    from .fit import fit_slopes  # noqa: F401
    from .patch import ConversionPlan, patch_model, plan_conversion  # noqa: F401
    from .planning import builtin_rows, resolve_options  # noqa: F401
    from .positions import original_length  # noqa: F401
    from .registry import get_architecture, register_architecture, supported_model_types  # noqa: F401

_HOMES = {
    "fit_slopes": "fit",
    **dict.fromkeys(["ConversionPlan", "patch_model", "plan_conversion"], "patch"),
    **dict.fromkeys(["builtin_rows", "resolve_options"], "planning"),
    "original_length": "positions",
    **dict.fromkeys(["get_architecture", "register_architecture", "supported_model_types"], "registry"),
}
__all__ = sorted(_HOMES)


__getattr__, __dir__ = lazy_names(__name__, _HOMES, submodules=True)
