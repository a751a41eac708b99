"""hf_alibi: ALiBi (Press, Smith and Lewis, "Train Short, Test Long") for transformers models.

Importing hf_alibi is light: the public names below are resolved on first use (PEP 562 ``__getattr__``, as
transformers' ``_LazyModule`` does), so the command line (``hf-alibi``, ``python -m hf_alibi``: hf_alibi/cli/) answers
its help and errors without torch. What importing promises still holds: hf_alibi's attention functions and model
types are registered with transformers (new names only; nothing is patched) as soon as transformers is there, so
``AutoModelForCausalLM.from_pretrained(converted_folder)`` works after ``import hf_alibi``, whichever of the two was
imported first (:func:`_register`). Converting is explicit: :func:`patch_model`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING

from ._lazy import lazy_names

if TYPE_CHECKING:  # the homes of the lazy names (tests/test_imports.py reads them from here)
    from .convert.fit import fit_slopes  # noqa: F401
    from .convert.patch import ConversionPlan, patch_model, plan_conversion  # noqa: F401
    from .convert.registry import (  # noqa: F401
        ARCHITECTURES,
        get_architecture,
        get_native_architecture,
        native_model_types,
        register_architecture,
        register_builtin_architectures,
        set_model_bases,
        supported_model_types,
    )
    from .core.architectures import Architecture  # noqa: F401
    from .core.bias import AlibiBias, set_attention_path  # noqa: F401
    from .core.config import get_settings  # noqa: F401
    from .core.dispatch import register_backends  # noqa: F401
    from .core.names import is_alibi  # noqa: F401
    from .core.settings import AlibiSettings  # noqa: F401
    from .core.slopes import alibi_bias, get_slopes, get_slopes_list  # noqa: F401
    from .core.version import __version__  # noqa: F401
    from .export.gguf import export_gguf  # noqa: F401
    from .hub.saving import AlibiPreTrainedMixin  # noqa: F401

# public name -> the module that holds it (imported on first use)
_HOMES = {
    "Architecture": "core.architectures",
    "AlibiBias": "core.bias",
    "set_attention_path": "core.bias",
    "get_settings": "core.config",
    "register_backends": "core.dispatch",
    "is_alibi": "core.names",
    "AlibiSettings": "core.settings",
    "alibi_bias": "core.slopes",
    "get_slopes": "core.slopes",
    "get_slopes_list": "core.slopes",
    "__version__": "core.version",
    "fit_slopes": "convert.fit",
    "export_gguf": "export.gguf",
    "AlibiPreTrainedMixin": "hub.saving",
    "ConversionPlan": "convert.patch",
    "patch_model": "convert.patch",
    "plan_conversion": "convert.patch",
    **dict.fromkeys(
        ["ARCHITECTURES", "get_architecture", "get_native_architecture", "native_model_types"], "convert.registry"
    ),
    **dict.fromkeys(
        ["register_architecture", "register_builtin_architectures", "set_model_bases", "supported_model_types"],
        "convert.registry",
    ),
}

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
# Modules that moved into their wings: old name -> (new name, warns). ``import hf_alibi.<old>`` gives the module at its
# new name, the same object (_Aliases). One name stays without a warning: hf_alibi.models, the name the Alibi<Class>
# classes carry (their __module__: pickles and user code name it).
_MOVED_MODULES = {
    "models": ("convert.models", False),
    "data": ("train.data", True),
    "jobs": ("cli.jobs", True),
    "evaluation": ("evaluate.lengths", True),
    "patch": ("convert.patch", True),
    "planning": ("convert.planning", True),
    "registry": ("convert.registry", True),
    "positions": ("convert.positions", True),
    "fit": ("convert.fit", True),
    "gguf": ("export.gguf", True),
    "checkpoints": ("hub.checkpoints", True),
    "distributed": ("train.distributed", True),
    "training": ("train.length_scaling", True),
}


_names, __dir__ = lazy_names(__name__, _HOMES, submodules=True)


def __getattr__(name: str):
    if name in _MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the module at its new name (_Aliases)
    if name in _MOVED:
        warnings.warn(
            f"hf_alibi.{name} is now hf_alibi.{_MOVED[name]} (it takes a model, a config or config.json as a dict); "
            "the old name goes in the next release.",
            FutureWarning,
            stacklevel=2,
        )
        return _names(_MOVED[name])
    return _names(name)


# ------------------------------------------------------------------------------------------------- registration

_state = {"registered": False, "registering": False}


def _register() -> None:
    """Register hf_alibi with transformers (idempotent): the ``alibi_<backend>`` attention functions, the saving
    mixin of every ``Alibi<Class>``, the built-in rows' ``Alibi<Config>`` types (their model classes are made on
    first use: hf_alibi/convert/registry.py). Imports torch and transformers."""
    if _state["registered"] or _state["registering"]:
        return
    _state["registering"] = True
    if _WATCH in sys.meta_path:
        sys.meta_path.remove(_WATCH)
    try:
        from .convert.registry import register_builtin_architectures, set_model_bases
        from .core.dispatch import register_backends
        from .hub.saving import AlibiPreTrainedMixin

        register_backends()
        set_model_bases(AlibiPreTrainedMixin)  # given to the registry, which imports nothing of hub/
        register_builtin_architectures()
        _state["registered"] = True
    finally:
        _state["registering"] = False


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _AfterImport(importlib.abc.Loader):
    """A module's own loader, then :func:`_register` once transformers is imported and nothing of transformers or
    hf_alibi is half imported (registering imports both: it must not meet a module whose body has not run)."""

    def __init__(self, loader, name: str):
        self._loader, self.module_name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if "transformers" not in sys.modules or _state["registered"] or _state["registering"]:
            return
        for name, other in list(sys.modules.items()):
            if name != self.module_name and name.partition(".")[0] in _WATCHED and _initializing(other):
                return  # that module's own loader registers once its body has run
        _register()

    def __getattr__(self, name: str):  # get_source, get_resource_reader, is_package, ...: the module's loader's
        return getattr(self._loader, name)


_WATCHED = ("transformers", "hf_alibi")


class _Watch(importlib.abc.MetaPathFinder):
    """Until hf_alibi is registered: each module of transformers and hf_alibi is loaded by its own loader wrapped in
    :class:`_AfterImport`, so that the first one whose import ends with transformers there registers hf_alibi."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterImport(spec.loader, name)
                return spec
        return None


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import hf_alibi.<old name>`` of a module that moved (:data:`_MOVED_MODULES`): the module at its new name, the
    same object (what is set on one is set on the other), with a ``FutureWarning`` where the old name goes."""

    def find_spec(self, name, path=None, target=None):
        package, _, old = name.partition(".")
        if package != __name__ or old not in _MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new, warns = _MOVED_MODULES[spec.name.partition(".")[2]]
        if warns:
            warnings.warn(
                f"{spec.name} is now {__name__}.{new}; the old name goes in the next release.",
                FutureWarning,
                stacklevel=2,
            )
        return importlib.import_module(f"{__name__}.{new}")

    def exec_module(self, module) -> None:
        pass  # the module at its new name has run


_WATCH = _Watch()
if not any(isinstance(finder, _Aliases) for finder in sys.meta_path):
    sys.meta_path.append(_Aliases())
if "transformers" in sys.modules and not _initializing(sys.modules["transformers"]):
    _register()  # transformers came first: as before, importing hf_alibi registers
else:
    sys.meta_path.insert(0, _WATCH)
