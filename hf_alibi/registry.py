"""One spec per architecture, the dispatch by ``config.model_type``, and the Alibi classes.

Registering an architecture makes, for each of its transformers classes (``GPT2Model``,
``GPT2LMHeadModel``, ...), a subclass ``Alibi<Class>`` whose ``__init__`` applies the spec's
conversion, and registers it with the Auto classes under ``"alibi_" + model_type``. That is what
lets ``AutoModelForCausalLM.from_pretrained`` rebuild a converted checkpoint after
``import hf_alibi``. Nothing of transformers is modified: only new names are added.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto import modeling_auto

from .attention import release_shared_masks
from .config import AlibiSettings, alibi_config_class, get_settings
from .hub import AlibiPreTrainedMixin

# The Auto classes an ALiBi model can be loaded with, when transformers maps the base type there.
AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForMultipleChoice",
    "AutoModelForPreTraining",
    "AutoModelForNextSentencePrediction",
    "AutoModelForTextEncoding",
)


@dataclass
class ArchitectureSpec:
    """How to convert one architecture.

    Args:
        model_type: transformers' ``config.model_type`` (``"gpt2"``).
        convert: ``convert(model, settings)`` removes the position path of ``model`` in place and
            puts an ``AlibiBias`` on each self-attention layer (``layer.alibi``). It runs on a
            freshly built model too, so it must not depend on weight values.
        bidirectional: the architecture has bidirectional self-attention (BERT, T5's encoder), so
            ``encoder_variant`` applies.
        causal: the architecture has causal self-attention (GPT-2, GPT-NeoX, T5's decoder).
        removed_config_fields: config fields that size the removed position path
            (``("n_positions",)``). A converted config holds ``None`` there and config.json a
            marker that the original config class rejects, so plain transformers can never load
            the checkpoint as the original architecture. While an ALiBi model is built they hold
            a placeholder of 1, since the original ``__init__`` still sizes the table it then drops.
        extra_classes: model classes outside transformers' Auto mappings (``GPT2DoubleHeadsModel``).
        placeholder_size: ``placeholder_size(config)`` is the value the removed fields hold while an
            ALiBi model is built, when 1 does not do (RoBERTa's position table has a padding row,
            so it needs ``pad_token_id + 1`` rows).
    """

    model_type: str
    convert: Callable[[PreTrainedModel, AlibiSettings], None]
    bidirectional: bool = False
    causal: bool = True
    removed_config_fields: tuple[str, ...] = ()
    extra_classes: tuple[type[PreTrainedModel], ...] = ()
    placeholder_size: Callable[[PretrainedConfig], int] | None = None
    alibi_classes: dict[type, type] = field(default_factory=dict, repr=False)

    def apply(self, model: PreTrainedModel, settings: AlibiSettings) -> None:
        """Convert ``model`` in place: the spec's surgery, then position ids are ignored."""
        self.convert(model, settings)
        model.base_model.register_forward_pre_hook(_drop_position_ids, with_kwargs=True)
        # the bias mask the layers shared lives for one forward only
        model.base_model.register_forward_hook(release_shared_masks)


def _drop_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # ALiBi has no position index: position ids would only reach transformers' packed-sequence
    # detection and change the mask, so they are dropped before the base model sees them.
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = None
    return args, kwargs


_REGISTRY: dict[str, ArchitectureSpec] = {}


def supported_model_types() -> list[str]:
    """The ``model_type`` values :func:`hf_alibi.patch_model` can convert."""
    return sorted(_REGISTRY)


def get_spec(model_type: str) -> ArchitectureSpec:
    spec = _REGISTRY.get(model_type)
    if spec is None:
        raise ValueError(
            f"hf_alibi cannot convert model_type={model_type!r}. Supported model types: "
            f"{', '.join(supported_model_types())}. To add one, write a convert function and call "
            "hf_alibi.register_architecture(ArchitectureSpec(model_type=..., convert=...))."
        )
    return spec


def _base_classes(model_type: str, extra: tuple[type, ...]) -> dict[type, list[str]]:
    """transformers' classes for ``model_type`` mapped to the Auto classes that load them."""
    classes: dict[type, list[str]] = {cls: [] for cls in extra}
    for auto_name in AUTO_CLASSES:
        mapping = getattr(modeling_auto, auto_name)._model_mapping._model_mapping
        class_name = mapping.get(model_type)
        if isinstance(class_name, str) and hasattr(transformers, class_name):
            classes.setdefault(getattr(transformers, class_name), []).append(auto_name)
    return classes


def _make_alibi_class(base_cls: type[PreTrainedModel], config_cls: type, spec: ArchitectureSpec) -> type:
    def __init__(self, config, *args, **kwargs):
        settings = get_settings(config)
        size = 1 if spec.placeholder_size is None else spec.placeholder_size(config)
        with _placeholder_sizes(config, spec.removed_config_fields, size):
            base_cls.__init__(self, config, *args, **kwargs)
        spec.apply(self, settings)

    name = "Alibi" + base_cls.__name__
    # AlibiPreTrainedMixin: save_pretrained / push_to_hub also write the remote code and auto_map.
    return type(
        name,
        (AlibiPreTrainedMixin, base_cls),
        {
            "__init__": __init__,
            "config_class": config_cls,
            "__module__": "hf_alibi.models",
            "__qualname__": name,
            "__doc__": f"{base_cls.__name__} with ALiBi instead of position embeddings (made by hf_alibi).",
        },
    )


@contextmanager
def _placeholder_sizes(config, names: tuple[str, ...], size: int = 1):
    saved = {name: getattr(config, name) for name in names}
    for name in names:
        setattr(config, name, size)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def register_architecture(spec: ArchitectureSpec) -> ArchitectureSpec:
    """Make ``spec.model_type`` convertible by :func:`hf_alibi.patch_model` and loadable by Auto classes.

    >>> from hf_alibi import ArchitectureSpec, register_architecture
    >>> register_architecture(ArchitectureSpec(model_type="my_arch", convert=my_convert))  # doctest: +SKIP
    """
    if spec.model_type in _REGISTRY:
        raise ValueError(f"model_type {spec.model_type!r} is already registered with hf_alibi.")
    base_classes = _base_classes(spec.model_type, spec.extra_classes)
    if not base_classes:
        raise ValueError(f"transformers has no model classes for model_type {spec.model_type!r}.")
    base_config_cls = next(iter(base_classes)).config_class
    config_cls = alibi_config_class(base_config_cls, spec.model_type, spec.removed_config_fields)
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    for base_cls, auto_names in base_classes.items():
        alibi_cls = _make_alibi_class(base_cls, config_cls, spec)
        spec.alibi_classes[base_cls] = alibi_cls
        setattr(_models_namespace(), alibi_cls.__name__, alibi_cls)
        for auto_name in auto_names:
            getattr(transformers, auto_name).register(config_cls, alibi_cls, exist_ok=True)
    setattr(_models_namespace(), config_cls.__name__, config_cls)
    _REGISTRY[spec.model_type] = spec
    return spec


def _models_namespace():
    from . import models

    return models
