"""hf_alibi: ALiBi (Press, Smith and Lewis, "Train Short, Test Long") for transformers models.

Importing registers hf_alibi's attention functions and model types with transformers (new names
only); it never patches anything. Converting is explicit: :func:`patch_model`.
"""

import sys

if sys.argv[:1] == ["-m"]:  # `python -m hf_alibi` imports this first: its help and errors answer before torch
    from hf_alibi_boot import answer_module_run

    answer_module_run(__name__)

from . import models  # noqa: F401  (the home of the Alibi<Class> classes; transformers reads it by name)
from .core.architectures import Architecture
from .core.bias import AlibiBias, set_attention_path
from .core.config import get_settings
from .core.dispatch import register_backends
from .core.names import is_alibi
from .core.settings import AlibiSettings
from .core.slopes import alibi_bias, get_slopes, get_slopes_list
from .core.version import __version__
from .fit import fit_slopes
from .gguf import export_gguf
from .hub.saving import AlibiPreTrainedMixin
from .patch import ConversionPlan, patch_model, plan_conversion
from .registry import (
    ARCHITECTURES,
    get_architecture,
    get_native_architecture,
    native_model_types,
    register_architecture,
    register_builtin_architectures,
    set_model_bases,
    supported_model_types,
)

register_backends()
set_model_bases(AlibiPreTrainedMixin)  # given to the registry, which imports nothing of hub/
register_builtin_architectures()

__all__ = [
    "ARCHITECTURES",
    "AlibiBias",
    "AlibiSettings",
    "Architecture",
    "ConversionPlan",
    "__version__",
    "alibi_bias",
    "export_gguf",
    "fit_slopes",
    "get_architecture",
    "get_native_architecture",
    "get_settings",
    "get_slopes",
    "get_slopes_list",
    "is_alibi",
    "native_model_types",
    "patch_model",
    "plan_conversion",
    "register_architecture",
    "set_attention_path",
    "supported_model_types",
]


# Names that moved keep an alias for one release (CONTRIBUTING: deprecated names)
_MOVED = {"is_alibi_config": "is_alibi", "is_alibi_model": "is_alibi"}


def __getattr__(name: str):
    if name in _MOVED:
        import warnings

        warnings.warn(
            f"hf_alibi.{name} is now hf_alibi.{_MOVED[name]} (it takes a model, a config or config.json as a dict); "
            "the old name goes in the next release.",
            FutureWarning,
            stacklevel=2,
        )
        return globals()[_MOVED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
