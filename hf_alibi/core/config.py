"""The config classes that carry the ALiBi settings (:mod:`.settings`) in config.json.

A converted model's config is an ``Alibi<Base>Config``: a subclass of the original config class
with its own ``model_type`` (``"alibi_" + base``) and one extra field, ``alibi``, holding
:class:`AlibiSettings` as a dict. The distinct ``model_type`` is what keeps plain transformers from
ever loading the checkpoint as the original architecture with fresh position embeddings.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

from .compat import (
    AttnImplementationOverride,
    auto_class_names,
    config_class_validators,
    drop_config_validators,
    store_attn_implementation,
    store_output_attentions,
    stored_attn_implementation,
    stored_output_attentions,
)
from .names import (
    ENGINE_GRANT,
    FOREIGN,
    LENGTH_FIELDS,
    MODEL_TYPE_PREFIX,
    REFUSED_BACKENDS,
    RUNNING_BACKENDS,
    alibi_name,
    base_name,
    check_backend,
    is_alibi,
)
from .settings import AlibiSettings


def _reported_name(stored: str | dict | None) -> str | dict | None:
    # the name transformers dispatches on for a stored one: alibi_<backend>, or the refusal of a foreign name
    if isinstance(stored, str) and base_name(stored) not in (*RUNNING_BACKENDS, *REFUSED_BACKENDS):
        return alibi_name(FOREIGN)  # written past the setter: dispatched to a refusal that names it
    return alibi_name(base_name(stored))


# stored name -> reported name (a pure function of the name, kept: a dict read instead of four calls)
_REPORTED: dict[str, str] = {}
_FOREIGN_NAME = alibi_name(FOREIGN)

# Written in config.json in place of the sizes of the removed position path (GPT-2's n_positions,
# T5's relative_attention_num_buckets, ...), followed by how to load the checkpoint. The original
# config classes require an int there, so plain transformers refuses the checkpoint with this text
# instead of silently building the original architecture with freshly initialised position embeddings.
REMOVED_FIELD_MARKER = "removed by hf_alibi: this is an ALiBi checkpoint"
# What the removed LENGTH fields answer in memory: transformers' "no maximum" (its tokenizers'
# VERY_LARGE_INTEGER, int(1e30)), a number other libraries can compare (sentence-transformers takes
# min(model_max_length, max_position_embeddings); generate caps max_length by it; rope validation compares
# original_max_position_embeddings with it), where None raised TypeError. config.json keeps the marker.
NO_MAXIMUM = int(1e30)
# Auto classes named in the marker's advice, most specific first.
_ADVISED_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel")


def removed_field_marker(base_model_type: str, architecture: str | None = None) -> str:
    """The marker text for a checkpoint of ``base_model_type``: what it is and which class loads it.

    >>> removed_field_marker("gpt2", "AlibiGPT2LMHeadModel").startswith(REMOVED_FIELD_MARKER)
    True
    """
    names = auto_class_names(base_model_type)
    architecture = architecture if architecture and architecture.startswith("Alibi") else None
    # the Auto class that maps to the saved class, else the most specific one the type has
    auto = next((a for a, c in names.items() if architecture and "Alibi" + c == architecture), None)
    auto = auto or next((name for name in _ADVISED_AUTO_CLASSES if name in names), "AutoModel")
    direct = f" or hf_alibi.models.{architecture}.from_pretrained(path)" if architecture else ""
    # hf_alibi is installed from its source (no package index serves it); the checkpoint's own code needs neither
    return (
        f"{REMOVED_FIELD_MARKER} (model_type {MODEL_TYPE_PREFIX}{base_model_type}), which the original "
        f"{base_model_type} classes cannot load. Load it with {auto}.from_pretrained(path, trust_remote_code=True), "
        "which runs the code saved with it, or with hf_alibi installed from its source (pip install -e . in a "
        f"checkout of hf_alibi): `import hf_alibi`, then {auto}.from_pretrained(path){direct}"
    )


def removed_value(name: str) -> int | None:
    """What the removed config field ``name`` answers in memory: :data:`NO_MAXIMUM` for a length, else None.

    >>> removed_value("max_position_embeddings") == NO_MAXIMUM, removed_value("relative_attention_num_buckets")
    (True, None)
    """
    return NO_MAXIMUM if name in LENGTH_FIELDS else None


def alibi_model_type(base_model_type: str) -> str:
    return MODEL_TYPE_PREFIX + base_model_type


def get_settings(config: PretrainedConfig) -> AlibiSettings:
    if not is_alibi(config):
        raise ValueError(f"{type(config).__name__} (model_type={config.model_type!r}) is not an ALiBi config.")
    return AlibiSettings.from_dict(config.alibi)


class AlibiConfigMixin(AttnImplementationOverride):
    """Makes every attention dispatch of the model go through hf_alibi.

    transformers reads the config's attention implementation to pick the attention function and the
    mask function (``compat.AttnImplementationOverride``). Here it always answers ``"alibi_<backend>"``
    while storing the plain backend, so ``model.set_attn_implementation("eager")`` (or anything else
    that sets it) switches the backend and keeps the bias: ALiBi cannot be dropped by accident.
    """

    alibi: dict | None = None
    reported_names = _REPORTED  # the memo compat's getter reads first
    # Fields of the base config that size the removed position path (set per class; None: found
    # in config.json by the marker, for remote code that has no row of the architecture).
    removed_fields: tuple[str, ...] | None = ()

    def __post_init__(self, **kwargs):
        # config.json holds the marker string in the removed fields: None in memory. A class made
        # without knowing its removed fields (remote code for a user's row) finds them by the marker.
        names = self.removed_fields
        if names is None:
            names = tuple(
                k for k, v in vars(self).items() if isinstance(v, str) and v.startswith(REMOVED_FIELD_MARKER)
            )
            self.__dict__["_alibi_removed_fields"] = names
        for name in names:
            if isinstance(getattr(self, name, None), str):
                setattr(self, name, removed_value(name))
        super().__post_init__(**kwargs)

    def alibi_removed_fields(self) -> tuple[str, ...]:
        """The base config's fields that sized the removed position path."""
        if self.removed_fields is not None:
            return self.removed_fields
        return self.__dict__.get("_alibi_removed_fields", ())

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop("_alibi_removed_fields", None)
        output.pop(ENGINE_GRANT, None)
        names = self.alibi_removed_fields()
        if names:
            base_type = (self.alibi or {}).get("base_model_type", self.model_type.removeprefix(MODEL_TYPE_PREFIX))
            marker = removed_field_marker(base_type, (getattr(self, "architectures", None) or [None])[0])
            for name in names:
                output[name] = marker
        return output

    def reported_attn_implementation(self, stored):
        if stored is not None and stored == self.__dict__.get(ENGINE_GRANT):
            return stored  # the granted engine's own function (it applies the bias): never memoised by name
        if not isinstance(stored, str):
            return _reported_name(stored)
        reported = _REPORTED.get(stored)
        if reported is None:
            reported = _reported_name(stored)
            if reported != _FOREIGN_NAME:  # a foreign name is asked again: it may be granted to an engine later
                _REPORTED[stored] = reported
        return reported

    def accepted_attn_implementation(self, value):
        if isinstance(value, dict):
            return value
        if value is not None and value == self.__dict__.get(ENGINE_GRANT):
            return value  # stored as it is: reported as it is (reported_attn_implementation)
        check_backend(value)  # another engine's function would run the model without its bias: refused here
        return base_name(value)

    @property
    def output_attentions(self):
        return stored_output_attentions(self)

    @output_attentions.setter
    def output_attentions(self, value: bool):
        backend = base_name(stored_attn_implementation(self))
        if value and backend is None:
            backend = "eager"
            store_attn_implementation(self, backend)
        _check_output_attentions(value, backend)
        store_output_attentions(self, value)

    def validate(self) -> None:
        """transformers' checks of this config (``save_pretrained`` runs them), each as the base class
        runs it, except ``validate_output_attentions``: that one compares the attention implementation with
        ``"eager"``, and here it answers ``"alibi_eager"``, so it is made against the plain backend.
        (A validator's error comes out as its own ValueError / TypeError, not wrapped.)
        """
        for validator in config_class_validators(type(self)):
            if validator.__name__ == "validate_output_attentions":
                _check_output_attentions(self.output_attentions, base_name(stored_attn_implementation(self)))
            else:
                validator(self)


def _check_output_attentions(value: bool, backend: str | None) -> None:
    if value and backend not in ("eager", None):
        raise ValueError(
            f"output_attentions needs the eager backend, this model uses {backend!r}: "
            "call model.set_attn_implementation('eager') first (or set config.output_attentions = False)."
        )


_MADE_CONFIG_CLASSES: dict[tuple[type, str], type] = {}


def alibi_config_class(
    base_config_class: type[PretrainedConfig],
    base_model_type: str,
    removed_fields: tuple[str, ...] | None = (),
    module: str = __name__,
    bases: tuple[type, ...] = (),
) -> type[PretrainedConfig]:
    """The ``Alibi<Base>Config`` subclass of ``base_config_class`` (made once per module, then cached).

    ``removed_fields`` are the base config's sizes of the removed position path: in memory they answer
    :func:`removed_value` (a length: :data:`NO_MAXIMUM`; the base builds its layers with a placeholder
    instead), in config.json the marker, so the original classes refuse the checkpoint.
    ``None`` means unknown (remote code loading a user's row): the fields holding the marker are
    found when the config is read, and the base class's strict type validators are all dropped.
    ``module`` is the ``__module__`` the class reports (where it can be imported from); ``bases`` go
    first (hf_alibi's registry adds one that registers the model classes when a config is made).
    """
    if issubclass(base_config_class, AlibiConfigMixin):  # already one (e.g. T5's stack configs on reload)
        return base_config_class
    cls = _MADE_CONFIG_CLASSES.get((base_config_class, module))
    if cls is None:
        name = "Alibi" + base_config_class.__name__
        known = removed_fields or ()
        annotations = {"alibi": dict | None, **{field_name: int | str | None for field_name in known}}
        namespace = {
            "model_type": alibi_model_type(base_model_type),
            "__module__": module,
            "__qualname__": name,
            "__annotations__": annotations,
            "alibi": None,
            "removed_fields": None if removed_fields is None else tuple(removed_fields),
            **{field_name: removed_value(field_name) for field_name in known},
            "__doc__": f"{base_config_class.__name__} with ALiBi settings (``alibi``), made by hf_alibi.",
        }
        cls = type(name, (*bases, AlibiConfigMixin, base_config_class), namespace)
        # The base class's strict validators demand an int in the removed fields: not here.
        drop_config_validators(cls, None if removed_fields is None else known)
        _MADE_CONFIG_CLASSES[(base_config_class, module)] = cls
    return cls


def alibi_config_copy(
    config: PretrainedConfig, config_class: type[PretrainedConfig], alibi: dict[str, Any]
) -> PretrainedConfig:
    """A deep copy of ``config`` as ``config_class`` (its ``Alibi<Config>``): ``alibi`` set, removed fields
    cleared (:func:`removed_value`: lengths answer :data:`NO_MAXIMUM`, the others ``None``).

    A copy, since another model built from the same config object must not change with this one.
    """
    new = copy.deepcopy(config)
    new.__class__ = config_class
    if "model_type" in vars(new):  # a config read from config.json holds its model_type per instance
        new.model_type = config_class.model_type
    new.alibi = dict(alibi)
    for name in new.alibi_removed_fields():
        setattr(new, name, removed_value(name))
    return new


def rebind_config(root, old: PretrainedConfig, new: PretrainedConfig) -> None:
    """Point every submodule of ``root`` that holds ``old`` as its ``config`` at ``new``."""
    for module in root.modules():
        if getattr(module, "config", None) is old:
            module.config = new
