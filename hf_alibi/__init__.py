"""hf_alibi: ALiBi (Press, Smith and Lewis, "Train Short, Test Long") for transformers models.

Importing registers hf_alibi's attention functions and model types with transformers (new names
only); it never patches anything. Converting is explicit: :func:`patch_model`.
"""

from .attention import AlibiBias, register_backends, set_attention_path
from .config import AlibiSettings, get_settings, is_alibi_config
from .patch import is_alibi_model, patch_model
from .registry import ArchitectureSpec, get_spec, register_architecture, supported_model_types
from .slopes import alibi_bias, get_slopes, get_slopes_list
from .version import __version__

register_backends()

from . import patches  # noqa: E402,F401  (registers the built-in architectures)

__all__ = [
    "AlibiBias",
    "AlibiSettings",
    "ArchitectureSpec",
    "__version__",
    "alibi_bias",
    "get_settings",
    "get_slopes",
    "get_slopes_list",
    "get_spec",
    "is_alibi_config",
    "is_alibi_model",
    "patch_model",
    "register_architecture",
    "set_attention_path",
    "supported_model_types",
]
