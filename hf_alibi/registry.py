"""The architectures hf_alibi converts: the built-in table, user rows, and the Auto registration.

Registering an architecture makes, for each of its transformers classes (``GPT2Model``,
``GPT2LMHeadModel``, ...), a subclass ``Alibi<Class>`` (``core.modeling.alibi_model_class``) and
registers it with the Auto classes under ``"alibi_" + model_type``. That is what lets
``AutoModelForCausalLM.from_pretrained`` rebuild a converted checkpoint after ``import hf_alibi``.
Nothing of transformers is modified: only new names are added.
"""

from __future__ import annotations

from collections.abc import Callable

import transformers
from torch import nn
from transformers import AutoConfig

from .core.architectures import ARCHITECTURES, Architecture
from .core.compat import auto_class_names
from .core.config import alibi_config_class
from .core.modeling import alibi_model_class
from .core.strategies import STRATEGIES
from .hub.saving import AlibiPreTrainedMixin

MODELS_MODULE = "hf_alibi.models"

# model_type -> its row; model_type -> {transformers class: Alibi class}
_ROWS: dict[str, Architecture] = {}
_CLASSES: dict[str, dict[type, type]] = {}
BUILTIN_STRATEGIES = frozenset(STRATEGIES)


def supported_model_types() -> list[str]:
    """The ``model_type`` values :func:`hf_alibi.patch_model` can convert."""
    return sorted(_ROWS)


def get_architecture(model_type: str) -> Architecture:
    """The registered row of ``model_type``, or a ``ValueError`` that names the supported types."""
    row = _ROWS.get(model_type)
    if row is None:
        raise ValueError(
            f"hf_alibi cannot convert model_type={model_type!r}. Supported model types: "
            f"{', '.join(supported_model_types())}. To add one, describe it in a row and call "
            "hf_alibi.register_architecture(hf_alibi.Architecture(model_type=..., strategy=...))."
        )
    return row


def alibi_classes(model_type: str) -> dict[type, type]:
    """transformers class -> ``Alibi<Class>`` for a registered ``model_type``."""
    get_architecture(model_type)
    return _CLASSES[model_type]


def _base_classes(row: Architecture) -> dict[type, list[str]]:
    """transformers' classes for the row's type mapped to the Auto classes that load them."""
    classes: dict[type, list[str]] = {getattr(transformers, name): [] for name in row.extra_classes}
    for auto_name, class_name in auto_class_names(row.model_type).items():
        if hasattr(transformers, class_name):
            classes.setdefault(getattr(transformers, class_name), []).append(auto_name)
    return classes


def register_architecture(
    row: Architecture, strategy: Callable[[nn.Module, tuple[str, ...]], None] | None = None
) -> Architecture:
    """Make ``row.model_type`` convertible by :func:`hf_alibi.patch_model` and loadable by Auto classes.

    ``row`` says where the position path and the self-attention modules are and which strategy
    removes the path (``"absolute"``, ``"rotary"``, ``"relative"``). Where none fits, pass
    ``strategy(base_model, position_paths)`` and a new name in ``row.strategy``: such checkpoints
    then need that code to load (no remote code is written for them).

    >>> hf_alibi.register_architecture(hf_alibi.Architecture("mistral", "rotary"))  # doctest: +SKIP
    """
    if not isinstance(row, Architecture):
        raise TypeError(f"register_architecture takes an hf_alibi.Architecture row, got {type(row).__name__}.")
    if row.model_type in _ROWS:
        raise ValueError(f"model_type {row.model_type!r} is already registered with hf_alibi.")
    if strategy is not None:
        if row.strategy in BUILTIN_STRATEGIES:
            raise ValueError(f"{row.strategy!r} is a built-in strategy; give the custom one a new name.")
        STRATEGIES[row.strategy] = strategy
    if row.strategy not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {row.strategy!r} for {row.model_type!r}: use one of {sorted(STRATEGIES)}, "
            "or pass strategy=... to register_architecture."
        )
    base_classes = _base_classes(row)
    if not base_classes:
        raise ValueError(f"transformers has no model classes for model_type {row.model_type!r}.")
    base_config_cls = next(iter(base_classes)).config_class
    config_cls = alibi_config_class(base_config_cls, row.model_type, row.removed_config_fields, MODELS_MODULE)
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    classes = {}
    for base_cls, auto_names in base_classes.items():
        alibi_cls = alibi_model_class(base_cls, config_cls, MODELS_MODULE, bases=(AlibiPreTrainedMixin,))
        classes[base_cls] = alibi_cls
        for auto_name in auto_names:
            getattr(transformers, auto_name).register(config_cls, alibi_cls, exist_ok=True)
    _ROWS[row.model_type] = row
    _CLASSES[row.model_type] = classes
    return row


def class_named(name: str) -> type | None:
    """A registered ``Alibi<Class>`` or ``Alibi<Config>`` by name (``hf_alibi.models`` answers with it)."""
    for classes in _CLASSES.values():
        for alibi_cls in classes.values():
            if alibi_cls.__name__ == name:
                return alibi_cls
            if alibi_cls.config_class.__name__ == name:
                return alibi_cls.config_class
    return None


def register_builtin_architectures() -> None:
    for row in ARCHITECTURES.values():
        if row.model_type not in _ROWS:
            register_architecture(row)


def is_builtin_strategy(row: Architecture) -> bool:
    return row.strategy in BUILTIN_STRATEGIES
