"""The ALiBi settings persisted in config.json, and the config classes that carry them.

A converted model's config is an ``Alibi<Base>Config``: a subclass of the original config class
with its own ``model_type`` (``"alibi_" + base``) and one extra field, ``alibi``, holding
:class:`AlibiSettings` as a dict. The distinct ``model_type`` is what keeps plain transformers from
ever loading the checkpoint as the original architecture with fresh position embeddings.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

from .attention import alibi_name, base_name
from .slopes import ENCODER_VARIANTS
from .version import __version__

MODEL_TYPE_PREFIX = "alibi_"
# Written in config.json in place of the sizes of the removed position path (GPT-2's n_positions,
# T5's relative_attention_num_buckets, ...). The original config classes require an int there, so
# plain transformers refuses the checkpoint with this text instead of silently building the
# original architecture with freshly initialised position embeddings.
REMOVED_FIELD_MARKER = (
    "removed by hf_alibi: this is an ALiBi checkpoint. `pip install hf_alibi` and `import hf_alibi` "
    "before loading it, or load it with trust_remote_code=True"
)


@dataclass(frozen=True)
class AlibiSettings:
    """What a converted model needs to be rebuilt; stored as ``config.alibi``."""

    base_model_type: str = field(metadata={"help": "model_type of the architecture that was converted, e.g. 'gpt2'."})
    heads: int = field(metadata={"help": "Number of attention heads the slopes are computed for."})
    encoder_variant: str | None = field(
        default=None,
        metadata={
            "help": "Bias of bidirectional self-attention: 'symmetric', 'nonsymmetric' or 'learned'. "
            "None for decoder-only models, whose self-attention is causal."
        },
    )
    hf_alibi_version: str = field(default=__version__, metadata={"help": "hf_alibi version that converted it."})

    def __post_init__(self):
        if self.encoder_variant is not None and self.encoder_variant not in ENCODER_VARIANTS:
            raise ValueError(
                f"encoder_variant must be one of {ENCODER_VARIANTS} (or None for decoder-only models), "
                f"got {self.encoder_variant!r}."
            )

    def to_dict(self) -> dict[str, Any]:
        return dict(sorted(dataclasses.asdict(self).items()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlibiSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Unknown ALiBi settings {sorted(unknown)} in config.alibi; known: {sorted(known)}.")
        return cls(**data)


def alibi_model_type(base_model_type: str) -> str:
    return MODEL_TYPE_PREFIX + base_model_type


def is_alibi_config(config: PretrainedConfig) -> bool:
    return getattr(config, "alibi", None) is not None and str(config.model_type).startswith(MODEL_TYPE_PREFIX)


def get_settings(config: PretrainedConfig) -> AlibiSettings:
    if not is_alibi_config(config):
        raise ValueError(f"{type(config).__name__} (model_type={config.model_type!r}) is not an ALiBi config.")
    return AlibiSettings.from_dict(config.alibi)


class AlibiConfigMixin:
    """Makes every attention dispatch of the model go through hf_alibi.

    transformers reads ``config._attn_implementation`` to pick the attention function and the
    mask function. Here it always answers ``"alibi_<backend>"`` while storing the plain backend,
    so ``model.set_attn_implementation("eager")`` (or anything else that sets it) switches the
    backend and keeps the bias: ALiBi cannot be dropped by accident.
    """

    alibi: dict | None = None
    # Fields of the base config that size the removed position path (set per class).
    removed_fields: tuple[str, ...] = ()

    def __post_init__(self, **kwargs):
        for name in self.removed_fields:
            if isinstance(getattr(self, name, None), str):  # the marker read back from config.json
                setattr(self, name, None)
        super().__post_init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        for name in self.removed_fields:
            output[name] = REMOVED_FIELD_MARKER
        return output

    @property
    def _attn_implementation(self):
        return alibi_name(base_name(self._attn_implementation_internal))

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        PretrainedConfig._attn_implementation.fset(self, value if isinstance(value, dict) else base_name(value))

    @property
    def output_attentions(self):
        return self._output_attentions

    @output_attentions.setter
    def output_attentions(self, value: bool):
        backend = base_name(self._attn_implementation_internal)
        if value and backend is None:
            self._attn_implementation_internal = backend = "eager"
        if value and backend != "eager":
            raise ValueError(
                f"output_attentions needs the eager backend, this model uses {backend!r}: "
                "call model.set_attn_implementation('eager') first."
            )
        self._output_attentions = value


_CONFIG_CLASSES: dict[type, type] = {}


def alibi_config_class(
    base_config_class: type[PretrainedConfig], base_model_type: str, removed_fields: tuple[str, ...] = ()
) -> type[PretrainedConfig]:
    """The ``Alibi<Base>Config`` subclass of ``base_config_class`` (made once, then cached).

    ``removed_fields`` are the base config's sizes of the removed position path: here they may be
    ``None`` (in memory) or the marker (in config.json), never silently an int the base reads.
    """
    if issubclass(base_config_class, AlibiConfigMixin):  # already one (e.g. T5's stack configs on reload)
        return base_config_class
    cls = _CONFIG_CLASSES.get(base_config_class)
    if cls is None:
        name = "Alibi" + base_config_class.__name__
        annotations = {"alibi": dict | None, **{field_name: int | str | None for field_name in removed_fields}}
        namespace = {
            "model_type": alibi_model_type(base_model_type),
            "__module__": "hf_alibi.models",
            "__qualname__": name,
            "__annotations__": annotations,
            "alibi": None,
            "removed_fields": tuple(removed_fields),
            **{field_name: None for field_name in removed_fields},
            "__doc__": f"{base_config_class.__name__} with ALiBi settings (``alibi``), made by hf_alibi.",
        }
        cls = type(name, (AlibiConfigMixin, base_config_class), namespace)
        # The base class's strict validators demand an int in the removed fields: not here.
        cls.__validators__ = {k: v for k, v in cls.__validators__.items() if k not in removed_fields}
        _CONFIG_CLASSES[base_config_class] = cls
    return cls


def alibi_config_copy(
    config: PretrainedConfig, base_model_type: str, removed_fields: tuple[str, ...], alibi: dict[str, Any]
) -> PretrainedConfig:
    """A deep copy of ``config`` as its ``Alibi<Config>`` class: ``alibi`` set, removed fields ``None``.

    A copy, since another model built from the same config object must not change with this one.
    """
    new = copy.deepcopy(config)
    new.__class__ = alibi_config_class(type(config), base_model_type, removed_fields)
    if "model_type" in vars(new):  # a config read from config.json holds its model_type per instance
        new.model_type = type(new).model_type
    new.alibi = dict(alibi)
    for name in removed_fields:
        setattr(new, name, None)
    return new


def rebind_config(root, old: PretrainedConfig, new: PretrainedConfig) -> None:
    """Point every submodule of ``root`` that holds ``old`` as its ``config`` at ``new``."""
    for module in root.modules():
        if getattr(module, "config", None) is old:
            module.config = new
