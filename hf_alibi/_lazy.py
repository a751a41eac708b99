"""Lazy names for hf_alibi's packages (PEP 562), as transformers' ``_LazyModule`` gives them: a package's
``__init__`` lists where each public name lives and imports nothing, so the command line answers without torch and
``import hf_alibi.<wing>`` costs nothing until a name is used. One loose module beside the wings because every
package's ``__init__`` uses it, the top-level one included, and ``core/`` (copied into checkpoints) must not."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Collection, Mapping


def lazy_names(
    package: str, homes: Mapping[str, str], submodules: Collection[str] | bool = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package named ``package``.

    ``homes`` maps each lazy name to the module that defines it, relative to the package (``"patch"`` or
    ``".patch"``; ``"..convert.positions"`` for a sibling wing's); that module is imported on the name's first use,
    and each use reads it there (nothing is cached, so the name always is the defining module's). ``submodules``:
    the submodules that ``package.<name>`` gives without an import first, as when the ``__init__`` imported them;
    ``True``: any public one that exists."""

    listed = () if isinstance(submodules, bool) else tuple(submodules)

    def is_submodule(name: str) -> bool:
        if submodules is True:
            return not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None
        return name in listed

    def __getattr__(name: str):
        home = homes.get(name)
        if home is not None:
            return getattr(importlib.import_module(home if home.startswith(".") else f".{home}", package), name)
        if is_submodule(name):
            return importlib.import_module(f".{name}", package)  # as ``import package.name`` gives it
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes, *listed})

    return __getattr__, __dir__
