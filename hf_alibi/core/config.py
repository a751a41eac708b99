"""The ALiBi settings persisted in config.json, and the config classes that carry them.

A converted model's config is an ``Alibi<Base>Config``: a subclass of the original config class
with its own ``model_type`` (``"alibi_" + base``) and one extra field, ``alibi``, holding
:class:`AlibiSettings` as a dict. The distinct ``model_type`` is what keeps plain transformers from
ever loading the checkpoint as the original architecture with fresh position embeddings.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
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
from .names import FOREIGN, REFUSED_BACKENDS, RUNNING_BACKENDS, alibi_name, base_name, check_backend
from .slopes import ENCODER_VARIANTS
from .version import __version__

MODEL_TYPE_PREFIX = "alibi_"
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
LENGTH_FIELDS = frozenset({"n_positions", "max_position_embeddings", "n_ctx"})
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
    direct = f" or hf_alibi.models.{architecture}" if architecture else ""
    return (
        f"{REMOVED_FIELD_MARKER} (model_type {MODEL_TYPE_PREFIX}{base_model_type}), which the original "
        f"{base_model_type} classes cannot load. With hf_alibi: `import hf_alibi` (pip install hf_alibi), then "
        f"load it with {auto}.from_pretrained{direct}, not the original class. Without hf_alibi: "
        "load it with trust_remote_code=True"
    )


@dataclass(frozen=True)
class OriginalLength:
    """A preset's wavelength bound as a multiple of the original ``max_position_embeddings`` (the rotary bound on
    rotary rows, the table's on encoders' learned tables)."""

    times: float = 1.0


def slope_list(text: str) -> list[float]:
    """``--slopes a,b,...`` as numbers.

    >>> slope_list("0.5,0.25")
    [0.5, 0.25]
    """
    return [float(part) for part in text.split(",")]


slope_list.__name__ = "comma-separated slopes"  # what argparse calls a bad value


def option(
    default,
    help: str,
    *,
    flag_help: str,
    parse: Callable[[str], Any],
    presets: dict[str, Any] | None = None,
    applies: Callable[[Any, Any], bool] | None = None,
    describe: Callable[[AlibiSettings], str | None] | None = None,
):
    """A conversion option, declared once as a field of :class:`AlibiSettings` (saved in config.json):
    :func:`hf_alibi.patch_model`, ``settings_for``, ``recover`` and the checkpoint jobs take it as a keyword,
    ``hf-alibi convert`` and ``recover`` as ``--name-with-dashes`` (``parse``, ``flag_help``), each preset in
    ``presets`` sets it (an :class:`OriginalLength`: that multiple of the original length) where
    ``applies(row, original config)``, and ``hf-alibi info`` says it with ``describe(settings)`` (None: nothing).
    Its checks are :func:`check_pretrained_options`' (the one place).
    """
    metadata = {"help": help, "option": True, "flag_help": flag_help, "parse": parse}
    metadata.update(presets=presets or {}, applies=applies, describe=describe)
    return field(default=default, metadata=metadata)


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
    architecture: dict | None = field(
        default=None,
        metadata={
            "help": "The architecture row the model was converted with (architectures.Architecture as a dict), "
            "so that the checkpoint rebuilds the same way wherever it is loaded."
        },
    )
    hf_alibi_version: str = field(default=__version__, metadata={"help": "hf_alibi version that converted it."})
    # The conversion options: the one declaration (see option()). The defaults are the paper's method, which is
    # what checkpoints without these keys were made with; "pretrained" is the preset for pretrained checkpoints.
    sinks: int = option(
        0,
        "The first `sinks` real tokens of each sequence carry no distance penalty (bias 0 for every query that may "
        "see them), so a pretrained model keeps its attention sink. 0: the paper.",
        flag_help="first N tokens carry no distance penalty",
        parse=int,
        presets={"pretrained": 1},
        applies=lambda row, config: not getattr(config, "is_encoder_decoder", False),  # one mask places them
        describe=lambda s: f"sinks: {s.sinks}",
    )
    slope_scale: float = option(
        1.0,
        "Multiplies the paper's slopes (1.0: the paper).",
        flag_help="multiplies the paper's slopes",
        parse=float,
        presets={"pretrained": 0.01},
        describe=lambda s: (
            None
            if s.slopes is not None
            else "slopes: the paper's" + ("" if s.slope_scale == 1.0 else f" x {s.slope_scale:g}")
        ),
    )
    slopes: list[float] | list[list[float]] | None = option(
        None,
        "Explicit slopes (positive) instead of the paper's x slope_scale: one per head for every layer, or one such "
        "list per self-attention layer, in the model's order (hf_alibi.fit_slopes).",
        flag_help="explicit slopes a,b,... (one per head)",
        parse=slope_list,
        describe=lambda s: None if s.slopes is None else "slopes: explicit (--slopes)",
    )
    rotary_max_wavelength: float | None = option(
        None,
        "Rotary rows only: keep the rotary frequencies whose wavelength 2*pi/inv_freq is at most this (the others "
        "are removed: cos=1, sin=0). None: remove the rotary embedding entirely.",
        flag_help="rotary: keep wavelengths <= X",
        parse=float,
        presets={"pretrained": OriginalLength(8.0)},
        applies=lambda row, config: row.strategy == "rotary",
        describe=lambda s: (
            None
            if (s.architecture or {}).get("strategy") != "rotary"
            else "rotary frequencies: "
            + ("removed" if s.rotary_max_wavelength is None else f"kept up to wavelength {s.rotary_max_wavelength:g}")
        ),
    )
    position_mean: int = option(
        0,
        "Absolute rows only: the mean of the first `position_mean` rows of the removed position table was added to "
        "the token-type (else token) embeddings at conversion, a weight edit recorded here (the saved weights carry "
        "it; nothing is redone on load). 0: the table just goes (the paper).",
        flag_help="learned tables: fold the mean of the first N rows in",
        parse=int,
        presets={"pretrained": 128},
        applies=lambda row, config: row.strategy == "absolute",
        describe=lambda s: (
            f"position table's mean (first {s.position_mean} rows) kept in the embeddings" if s.position_mean else None
        ),
    )
    table_max_wavelength: float | None = option(
        None,
        "Encoder absolute rows only: keep the learned position table's Fourier components of wavelength at most "
        "this (tokens), repeated past the table; the others (and its mean) are removed. None: the table goes "
        "entirely (the paper).",
        flag_help="encoders' tables: keep wavelengths <= X (0: none)",
        parse=float,
        presets={"pretrained": OriginalLength(1.0)},
        applies=lambda row, config: row.strategy == "absolute" and row.bidirectional,  # encoders' tables only
        describe=lambda s: (
            None
            if s.table_max_wavelength is None
            else f"position table's wavelengths <= {s.table_max_wavelength:g} kept ({s.table_rows} rows, repeated)"
        ),
    )
    table_rows: int = field(
        default=0,
        metadata={"help": "The retained table's rows (its period), set with table_max_wavelength."},
    )

    def __post_init__(self):
        if self.encoder_variant is not None and self.encoder_variant not in ENCODER_VARIANTS:
            raise ValueError(
                f"encoder_variant must be one of {ENCODER_VARIANTS} (or None for decoder-only models), "
                f"got {self.encoder_variant!r}."
            )
        check_pretrained_options(
            self.heads, self.sinks, self.rotary_max_wavelength, self.slope_scale, self.slopes, self.architecture,
            self.position_mean, self.table_max_wavelength, self.table_rows,
        )  # fmt: skip
        if self.slopes is not None:  # JSON gives a list; kept as floats, fp32 is made from them per device
            object.__setattr__(self, "slopes", _as_floats(self.slopes))

    def to_dict(self) -> dict[str, Any]:
        return dict(sorted(dataclasses.asdict(self).items()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlibiSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Unknown ALiBi settings {sorted(unknown)} in config.alibi; known: {sorted(known)}.")
        return cls(**data)


def conversion_options() -> tuple[dataclasses.Field, ...]:
    """The conversion options (fields declared with :func:`option`), in their order.

    >>> [f.name for f in conversion_options()][:2]
    ['sinks', 'slope_scale']
    """
    return tuple(f for f in dataclasses.fields(AlibiSettings) if f.metadata.get("option"))


def describe_options(settings: AlibiSettings) -> str:
    """The options of ``settings`` as one line (``hf-alibi info``), each as its declaration says it.

    >>> describe_options(AlibiSettings("gpt2", 4))
    "sinks: 0; slopes: the paper's"
    """
    parts = (f.metadata["describe"](settings) for f in conversion_options() if f.metadata["describe"])
    return "; ".join(part for part in parts if part)


def _as_floats(slopes):
    if is_per_layer(slopes):
        return [[float(s) for s in layer] for layer in slopes]
    return [float(s) for s in slopes]


def is_per_layer(slopes) -> bool:
    """Whether ``slopes`` holds one list per layer (else one slope per head for every layer)."""
    return bool(slopes) and isinstance(slopes, (list, tuple)) and isinstance(slopes[0], (list, tuple))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_pretrained_options(
    heads: int,
    sinks: int,
    rotary_max_wavelength: float | None,
    slope_scale: float,
    slopes: list[float] | None,
    architecture: dict | None = None,
    position_mean: int = 0,
    table_max_wavelength: float | None = None,
    table_rows: int = 0,
) -> None:
    """One-line ``ValueError`` for a bad option of :class:`AlibiSettings` (``architecture``: the row as a dict).

    >>> check_pretrained_options(4, sinks=-1, rotary_max_wavelength=None, slope_scale=1.0, slopes=None)
    Traceback (most recent call last):
    ValueError: sinks must be an integer >= 0 (the number of first tokens exempt from the bias), got -1.
    """
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise ValueError(
            f"sinks must be an integer >= 0 (the number of first tokens exempt from the bias), got {sinks!r}."
        )
    if not _is_number(slope_scale) or slope_scale <= 0:
        raise ValueError(
            f"slope_scale must be a finite number > 0 (it multiplies the paper's slopes), got {slope_scale!r}."
        )
    if slopes is not None:
        for index, layer in enumerate(slopes if is_per_layer(slopes) else [slopes]):
            where = f" (layer {index})" if is_per_layer(slopes) else ""
            if isinstance(layer, (str, bytes)) or not hasattr(layer, "__len__") or len(layer) != heads:
                count = len(layer) if hasattr(layer, "__len__") else type(layer).__name__
                raise ValueError(
                    f"slopes must list one slope per head{where}: {heads} numbers, got {count} (or one such list "
                    "per layer)."
                )
            if not all(_is_number(s) and s > 0 for s in layer):
                raise ValueError(
                    f"slopes must be finite numbers > 0 (the bias is -slope * distance){where}, got {list(layer)}."
                )
        if slope_scale != 1.0:
            raise ValueError("Pass either slopes or slope_scale, not both (scale the slopes you pass instead).")
    if not isinstance(position_mean, int) or isinstance(position_mean, bool) or position_mean < 0:
        raise ValueError(
            f"position_mean must be an integer >= 0 (how many first rows of the position table to average), "
            f"got {position_mean!r}."
        )
    strategy = (architecture or {}).get("strategy")
    if position_mean and strategy not in (None, "absolute"):
        model_type = (architecture or {}).get("model_type")
        raise ValueError(
            f"position_mean applies to learned absolute position tables only; {model_type} has a {strategy!r} "
            "position path. Leave it 0."
        )
    if table_max_wavelength is not None:
        if not _is_number(table_max_wavelength) or table_max_wavelength < 2:
            raise ValueError(
                "table_max_wavelength must be a number >= 2 (a wavelength in tokens), or 0 / None to remove the "
                f"table, got {table_max_wavelength!r}."
            )
        if strategy not in (None, "absolute") or not (architecture or {}).get("bidirectional", True):
            model_type = (architecture or {}).get("model_type")
            raise ValueError(
                "table_max_wavelength applies to encoders with a learned position table (bert, roberta); "
                f"{model_type} is {'a decoder' if strategy == 'absolute' else f'a {strategy!r} row'}. Leave it None."
            )
    if not isinstance(table_rows, int) or isinstance(table_rows, bool) or table_rows < 0:
        raise ValueError(f"table_rows must be an integer >= 0, got {table_rows!r}.")
    if rotary_max_wavelength is not None:
        if not _is_number(rotary_max_wavelength) or rotary_max_wavelength <= 0:
            raise ValueError(
                "rotary_max_wavelength must be a number > 0 (a wavelength in tokens) or None, "
                f"got {rotary_max_wavelength!r}."
            )
        strategy = (architecture or {}).get("strategy", "rotary")
        if strategy != "rotary":
            model_type = (architecture or {}).get("model_type")
            raise ValueError(
                f"rotary_max_wavelength applies to rotary models only; {model_type} has a {strategy!r} position "
                "path. Leave it None."
            )


def removed_value(name: str) -> int | None:
    """What the removed config field ``name`` answers in memory: :data:`NO_MAXIMUM` for a length, else None.

    >>> removed_value("max_position_embeddings") == NO_MAXIMUM, removed_value("relative_attention_num_buckets")
    (True, None)
    """
    return NO_MAXIMUM if name in LENGTH_FIELDS else None


def alibi_model_type(base_model_type: str) -> str:
    return MODEL_TYPE_PREFIX + base_model_type


def is_alibi_config(config: PretrainedConfig) -> bool:
    return getattr(config, "alibi", None) is not None and str(config.model_type).startswith(MODEL_TYPE_PREFIX)


def get_settings(config: PretrainedConfig) -> AlibiSettings:
    if not is_alibi_config(config):
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
        names = self.alibi_removed_fields()
        if names:
            base_type = (self.alibi or {}).get("base_model_type", self.model_type.removeprefix(MODEL_TYPE_PREFIX))
            marker = removed_field_marker(base_type, (getattr(self, "architectures", None) or [None])[0])
            for name in names:
                output[name] = marker
        return output

    def reported_attn_implementation(self, stored):
        if isinstance(stored, str) and base_name(stored) not in (*RUNNING_BACKENDS, *REFUSED_BACKENDS):
            return alibi_name(FOREIGN)  # written past the setter: dispatched to a refusal that names it
        return alibi_name(base_name(stored))

    def accepted_attn_implementation(self, value):
        if isinstance(value, dict):
            return value
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
        runs it, except ``validate_output_attentions``: that one compares ``_attn_implementation`` with
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


_CONFIG_CLASSES: dict[tuple[type, str], type] = {}


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
    cls = _CONFIG_CLASSES.get((base_config_class, module))
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
        _CONFIG_CLASSES[(base_config_class, module)] = cls
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
