"""The architectures hf_alibi converts: the built-in rows (``hf_alibi.patches``), user rows, and the Auto registration.

Registering an architecture makes ``Alibi<Config>``, a subclass of the type's config class, and
registers it with ``AutoConfig`` under ``"alibi_" + model_type``. For each of the type's transformers
model classes (``GPT2Model``, ``GPT2LMHeadModel``, ...) it makes a subclass ``Alibi<Class>``
(``core.conversion.alibi_model_class``) and registers it with the Auto classes: for a user's row at once,
for a built-in row when the row is first used (``patch_model``, ``hf_alibi.models.Alibi<Class>``, or
the first ``Alibi<Config>`` made, which transformers always makes before it looks a model class up).
That is what lets ``AutoModelForCausalLM.from_pretrained`` rebuild a converted checkpoint after
``import hf_alibi`` without importing the modeling code of every type at import. Nothing of
transformers is modified: only new names are added.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import transformers
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig

from ..core.architectures import REGISTERED, Architecture, find_architecture
from ..core.compat import auto_class_names
from ..core.config import MODEL_TYPE_PREFIX, alibi_config_class
from ..core.conversion import alibi_model_class
from ..core.strategies import BUILTIN_STRATEGIES, STRATEGIES
from ..native import NativeArchitecture
from .planning import builtin_rows

MODELS_MODULE = "hf_alibi.models"
# The built-in rows, as hf_alibi.patches lists them (one module per strategy), and the model types trained with ALiBi
# (hf_alibi.patches.native): nothing to convert, patch_model runs their attention on hf_alibi's paths
# (hf_alibi.native); they keep their config class and type, so nothing is registered for them.
ARCHITECTURES: dict[str, Architecture]
NATIVE_ARCHITECTURES: dict[str, NativeArchitecture]
ARCHITECTURES, NATIVE_ARCHITECTURES = builtin_rows()

# model_type -> Alibi<Config> (made at registration); model_type -> {transformers class: Alibi class}
# (made when the row is first used)
_CONFIG_BY_TYPE: dict[str, type] = {}
_CLASSES: dict[str, dict[type, type]] = {}
# The bases every Alibi<Class> gets besides its transformers class: given by hf_alibi/__init__.py
# (hf_alibi.hub.saving's AlibiPreTrainedMixin), not imported here, so the registry depends on the core only.
_MODEL_BASES: tuple[type, ...] = ()


def set_model_bases(*bases: type) -> None:
    """The mixins of every ``Alibi<Class>`` made from now on (``hf_alibi`` gives the saving mixin at import).

    >>> set_model_bases(AlibiPreTrainedMixin)  # doctest: +SKIP
    """
    global _MODEL_BASES
    _MODEL_BASES = tuple(bases)


def supported_model_types() -> list[str]:
    """The ``model_type`` values :func:`hf_alibi.patch_model` can convert.

    >>> "llama" in hf_alibi.supported_model_types()  # doctest: +SKIP
    True
    """
    return sorted(REGISTERED)


def native_model_types() -> list[str]:
    """The ``model_type`` values trained with ALiBi that :func:`hf_alibi.patch_model` runs on hf_alibi's attention
    without converting them (their config and type stay).

    >>> hf_alibi.native_model_types()  # doctest: +SKIP
    ['bloom', 'falcon', 'mpt']
    """
    return sorted(NATIVE_ARCHITECTURES)


def get_native_architecture(model_type: str) -> NativeArchitecture | None:
    """The row of a model type trained with ALiBi (BLOOM, MPT, Falcon), or ``None``.

    >>> hf_alibi.get_native_architecture("mpt").slopes  # doctest: +SKIP
    'mpt'
    """
    return NATIVE_ARCHITECTURES.get(model_type)


def get_architecture(model_type: str) -> Architecture:
    """The registered row of ``model_type``, or a ``ValueError`` that names the supported types.

    >>> hf_alibi.get_architecture("gpt2").strategy  # doctest: +SKIP
    'absolute'
    """
    row = find_architecture(model_type)
    if row is None and model_type in NATIVE_ARCHITECTURES:
        raise ValueError(
            f"model_type={model_type!r} was trained with ALiBi: there is nothing to convert. Load it with "
            "transformers and call hf_alibi.patch_model(model) (no options) to run its attention on hf_alibi's paths."
        )
    if row is None:
        raise ValueError(
            f"hf_alibi cannot convert model_type={model_type!r}. Supported model types: "
            f"{', '.join(supported_model_types())} (trained with ALiBi, run as they are: "
            f"{', '.join(native_model_types())}). To add one, describe it in a row and call "
            "hf_alibi.register_architecture(hf_alibi.Architecture(model_type=..., strategy=...))."
        )
    return row


def alibi_classes(model_type: str) -> dict[type, type]:
    """transformers class -> ``Alibi<Class>`` for a registered ``model_type`` (made on first use)."""
    classes = _CLASSES.get(model_type)
    if classes is None:  # the row is looked up (an error for an unknown type) only to make them
        classes = _CLASSES[model_type] = _model_classes(get_architecture(model_type), _CONFIG_BY_TYPE[model_type])
    return classes


class _RegistersModelClasses:
    """Base of every ``Alibi<Config>`` the registry makes: the first config made of a type registers
    the type's ``Alibi<Class>`` models with the Auto classes (see the module docstring)."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._register_model_classes()

    def __setstate__(self, state: dict) -> None:
        # unpickled (in another process: vLLM's workers, DataLoader workers), no __post_init__ runs: register there too
        # (PretrainedConfig has no __setstate__ of its own: checked on 5.19 and 5.24; a copy in a traced forward, T5's,
        # comes here too, and the registration is then a dict look-up)
        self.__dict__.update(state)
        self._register_model_classes()

    def _register_model_classes(self) -> None:
        base_type = type(self).model_type.removeprefix(MODEL_TYPE_PREFIX)
        if base_type not in _CLASSES:
            alibi_classes(base_type)


def _base_class_names(row: Architecture) -> dict[str, list[str]]:
    """Names of transformers' model classes for the row's type -> the Auto classes that load them
    (from transformers' name tables: nothing is imported)."""
    names: dict[str, list[str]] = {name: [] for name in row.extra_classes}
    for auto_name, class_name in auto_class_names(row.model_type).items():
        names.setdefault(class_name, []).append(auto_name)
    return names


def _model_classes(row: Architecture, config_cls: type) -> dict[type, type]:
    """Make the row's ``Alibi<Class>`` models and register them with their Auto classes."""
    classes = {}
    for class_name, auto_names in _base_class_names(row).items():
        if class_name in row.extra_classes:
            base_cls = getattr(transformers, class_name)  # named by the row: an error if missing
        elif (base_cls := getattr(transformers, class_name, None)) is None:
            continue  # an Auto table may name a class this transformers lacks
        alibi_cls = alibi_model_class(base_cls, config_cls, MODELS_MODULE, bases=_MODEL_BASES)
        classes[base_cls] = alibi_cls
        for auto_name in auto_names:
            getattr(transformers, auto_name).register(config_cls, alibi_cls, exist_ok=True)
    return classes


def _config_class(row: Architecture) -> type:
    """The row's ``Alibi<Config>``, from transformers' config class of the type (a light import)."""
    try:
        base_config_cls = CONFIG_MAPPING[row.model_type] if _base_class_names(row) else None
    except KeyError:
        base_config_cls = None
    if base_config_cls is None:
        raise ValueError(f"transformers has no model classes for model_type {row.model_type!r}.")
    # the classes name MODELS_MODULE as their module: it must be loaded (pickle and transformers read it through
    # sys.modules; transformers reads the file of a class's module to decide whether set_attn_implementation may
    # switch it). By name, not an import statement: hf_alibi.models (convert/models.py) imports this module.
    importlib.import_module(MODELS_MODULE)
    return alibi_config_class(
        base_config_cls, row.model_type, row.removed_config_fields, MODELS_MODULE, bases=(_RegistersModelClasses,)
    )


def register_architecture(
    row: Architecture, strategy: Callable[[nn.Module, tuple[str, ...]], None] | None = None
) -> Architecture:
    """Make ``row.model_type`` convertible by :func:`hf_alibi.patch_model` and loadable by Auto classes.

    ``row`` says where the position path and the self-attention modules are and which strategy
    removes the path (``"absolute"``, ``"rotary"``, ``"relative"``). Where none fits, pass
    ``strategy(base_model, position_paths)`` (or ``strategy(base_model, position_paths, settings)``, to read
    the :class:`AlibiSettings`) and a new name in ``row.strategy``: such checkpoints
    then need that code to load (no remote code is written for them).

    >>> hf_alibi.register_architecture(hf_alibi.Architecture("mistral", "rotary"))  # doctest: +SKIP
    """
    _register(row, strategy)
    alibi_classes(row.model_type)  # a user's row: its classes now, so a row that fits no class fails here
    return row


def _register(row: Architecture, strategy: Callable | None = None) -> None:
    if not isinstance(row, Architecture):
        raise TypeError(f"register_architecture takes an hf_alibi.Architecture row, got {type(row).__name__}.")
    if row.model_type in REGISTERED:
        raise ValueError(f"model_type {row.model_type!r} is already registered with hf_alibi.")
    if strategy is not None:
        if row.strategy in BUILTIN_STRATEGIES:
            raise ValueError(f"{row.strategy!r} is a built-in strategy; give the custom one a new name.")
        STRATEGIES[row.strategy] = _takes_settings(strategy)
    if row.strategy not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {row.strategy!r} for {row.model_type!r}: use one of {sorted(STRATEGIES)}, "
            "or pass strategy=... to register_architecture."
        )
    config_cls = _config_class(row)
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    _CONFIG_BY_TYPE[row.model_type] = config_cls
    REGISTERED[row.model_type] = row


def _takes_settings(strategy: Callable) -> Callable:
    """A strategy as ``apply`` calls it, ``(base_model, position_paths, settings)``: one written for the first two
    only is called without the settings."""
    try:
        inspect.signature(strategy).bind(None, None, None)
    except TypeError:
        return lambda base, paths, settings=None: strategy(base, paths)
    return strategy


def class_named(name: str) -> type | None:
    """A registered ``Alibi<Class>`` or ``Alibi<Config>`` by name (``hf_alibi.models`` answers with it)."""
    for config_cls in _CONFIG_BY_TYPE.values():
        if config_cls.__name__ == name:
            return config_cls
    base_name = name.removeprefix("Alibi")
    for model_type, row in REGISTERED.items():
        if name.startswith("Alibi") and base_name in _base_class_names(row):
            return next((c for c in alibi_classes(model_type).values() if c.__name__ == name), None)
    return None


def register_builtin_architectures() -> None:
    """Register the rows of ``hf_alibi.patches`` (idempotent); their model classes are made on first use."""
    for row in ARCHITECTURES.values():
        if REGISTERED.get(row.model_type) != row:
            _register(row)
