"""What a conversion will do, from a config alone: the rules of the options, written once, with no torch.

:func:`hf_alibi.plan_conversion` (the library, :mod:`hf_alibi.convert.patch`) and ``hf-alibi convert``'s checks before
the library loads (:mod:`hf_alibi.cli.checks`, from SRC's config.json read as JSON) both call these, so each rule has
one home: the head count (:func:`check_heads`), the encoder variant (:func:`encoder_variant_for`) and the option values
as stored (:func:`resolve_options`: a preset's, where each option applies, the explicit ones over them, an explicit
``table_max_wavelength=0`` removing the table). The values' own checks are the settings' (``AlibiSettings``, made
with them: :func:`~hf_alibi.core.settings.check_pretrained_options`).

Imports only the standard library and hf_alibi's modules that import neither torch nor transformers
(``tests/cli/test_cli_startup.py``: ``hf-alibi`` calls this before torch loads). ``config`` is a ``PretrainedConfig``
or any object with its fields as attributes (:func:`config_fields`: config.json's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from ..core.architectures import find_architecture
from ..core.names import ENCODER_VARIANTS, LENGTH_FIELDS, MODEL_TYPE_PREFIX, SYMMETRIC, is_alibi
from ..core.settings import FITTED, FittedSlopes, TimesOriginalLength, conversion_options, flag_spellings, presets
from ..patches import absolute, native, relative, rotary

# Named settings for patch_model(preset=...), from the options' declarations (core/settings.py: presets)
PRESETS: dict[str, dict[str, Any]] = presets()
# config.json's names of the head count (transformers' attribute_map aliases of num_attention_heads)
HEAD_FIELDS = ("num_attention_heads", "n_head", "n_heads", "num_heads")


class HeadsMismatch(ValueError):
    """``heads`` given that is not the model's head count (``given``, ``found``): ALiBi needs one slope per head."""

    def __init__(self, given: int, found: int):
        self.given, self.found = given, found
        super().__init__(
            f"heads={given} does not match the model's {found} attention heads (config.num_attention_heads); ALiBi "
            f"needs one slope per head. Pass heads={found} or omit it."
        )


def builtin_rows() -> tuple[dict[str, Any], dict[str, Any]]:
    """The built-in rows (``hf_alibi.patches``, plain data: read without torch), the one loader of them: the
    converted types' ``Architecture`` rows and the ``NativeArchitecture`` rows of the types trained with ALiBi, each
    by ``model_type``.

    >>> converted, trained_with_alibi = builtin_rows()
    >>> converted["gpt2"].strategy, sorted(trained_with_alibi)
    ('absolute', ['bloom', 'falcon', 'mpt'])
    """
    converted = {row.model_type: row for module in (absolute, relative, rotary) for row in module.ROWS}
    return converted, {row.model_type: row for row in native.ROWS}


def config_heads(config: Mapping[str, Any]) -> int | None:
    """The attention head count a config.json (as a dict) gives, under any of transformers' names for it, else
    ``None``.

    >>> config_heads({"model_type": "gpt2", "n_head": 4})
    4
    """
    return next((config[name] for name in HEAD_FIELDS if isinstance(config.get(name), int)), None)


def config_fields(config: Mapping[str, Any]) -> SimpleNamespace:
    """config.json's fields as attributes, as the options' declarations read a config (``applies``), with its head
    count as ``num_attention_heads`` (:func:`config_heads`)."""
    return SimpleNamespace(**{**config, "num_attention_heads": config_heads(config)})


def check_heads(heads: int | None, found: int | None) -> int | None:
    """``heads`` as given, else the model's ``found``; :class:`HeadsMismatch` where both are known and differ.

    >>> check_heads(None, 12), check_heads(12, 12)
    (12, 12)
    """
    if heads is None:
        return found
    if found is not None and heads != found:
        raise HeadsMismatch(heads, found)
    return heads


def encoder_variant_for(row, encoder_variant: str | None) -> str | None:
    """The encoder variant a conversion of ``row`` stores: a bidirectional row's (default symmetric), ``None`` for a
    decoder-only one; a one-line ``ValueError`` for a variant it cannot take.

    >>> encoder_variant_for(get_architecture("bert"), None)  # doctest: +SKIP
    'symmetric'
    """
    if row.bidirectional:
        encoder_variant = SYMMETRIC if encoder_variant is None else encoder_variant
        if encoder_variant not in ENCODER_VARIANTS:
            raise ValueError(f"encoder_variant must be one of {ENCODER_VARIANTS}, got {encoder_variant!r}.")
        return encoder_variant
    if encoder_variant is not None:
        raise ValueError(
            f"encoder_variant={encoder_variant!r} applies to bidirectional attention only; {row.model_type} is "
            "decoder-only, its self-attention is causal. Omit encoder_variant."
        )
    return None


def applies(option: dataclasses.Field, row, config) -> bool:
    """Whether a conversion option applies to ``row`` and the original ``config`` (its declaration's ``applies``;
    None: everywhere). Without a row (a type hf_alibi does not convert) everything applies: nothing to compare."""
    where = option.metadata["applies"]
    return where is None or row is None or where(row, config)


def resolve_options(config, row, preset: str | None = None, **explicit) -> dict:
    """The option values ``patch_model`` stores: the preset's, overridden by the explicit ones (None: not given).

    ``config`` is the ORIGINAL config (its ``max_position_embeddings`` is cleared by the conversion). A preset's
    value applies where its option's declaration says (``applies``: the rotary bound on rotary rows, the mean on
    absolute rows, sinks on models other than encoder-decoders ...; else the paper's value); an
    :class:`TimesOriginalLength` is that multiple of the original length. Explicit ``slopes`` drop a preset's
    ``slope_scale``; an explicit ``table_max_wavelength=0`` removes the table. ``row`` may be None (an unknown type:
    the explicit values over the defaults, as ``hf-alibi convert`` checks them before the job says what it is).

    >>> resolve_options(llama_config, get_architecture("llama"), "pretrained")  # doctest: +SKIP
    {'sinks': 1, 'slope_scale': 0.01, 'slopes': None, 'rotary_max_wavelength': 65536.0, 'position_mean': 0, ...}
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; known: {sorted(PRESETS)} (or None: the paper's method).")
    values = {}
    for f in conversion_options():
        value = PRESETS.get(preset, {}).get(f.name, f.default)
        if not applies(f, row, config):
            value = f.default
        if isinstance(value, TimesOriginalLength):
            length = original_length(config)
            value = value.times * length if length else None
            if value is not None and f.metadata["parse"] is int:  # a count of tokens (rotary_window)
                value = round(value)
        values[f.name] = value
    values.update({name: value for name, value in explicit.items() if value is not None})
    if type(values["table_max_wavelength"]) in (int, float) and values["table_max_wavelength"] == 0:  # explicit 0:
        values["table_max_wavelength"] = None  # the table goes entirely, whatever the preset says
    if explicit.get("slopes") is not None and explicit.get("slope_scale") is None:
        values["slope_scale"] = 1.0
    if values["slopes"] is not None:
        if isinstance(values["slopes"], FittedSlopes):  # measured by fit_slopes: recorded as such
            values["slopes_source"] = FITTED
        values["slopes"] = list(values["slopes"])
    return values


def original_length(config: Mapping[str, Any] | Any) -> int | None:
    """The longest input the original model was built for, from its config (a dict, a ``PretrainedConfig``
    or a model): the row's removed length field less the rows leading its table (RoBERTa's table has
    ``max_position_embeddings`` rows and numbers positions from ``pad_token_id + 1``: 514 - 1 - 1 = 512 for
    roberta-base; a null ``pad_token_id`` counts as 0). None where no length is stated (T5: relative
    positions) and for an ALiBi config (no limit). A type without a row: its stated length as is.

    >>> original_length(GPT2Config(n_positions=48))
    48
    """
    config = getattr(config, "config", config)  # a model: its config
    if is_alibi(config):  # its length fields answer "no maximum" (core.config.NO_MAXIMUM), not the original's
        return None
    if isinstance(config, Mapping):
        get = config.get
    else:

        def get(key, default=None):
            return getattr(config, key, default)

    model_type = str(get("model_type", "") or "").removeprefix(MODEL_TYPE_PREFIX)
    row = find_architecture(model_type) or builtin_rows()[0].get(model_type)  # registered, else built in (no torch)
    fields = [f for f in row.removed_config_fields if f in LENGTH_FIELDS] if row is not None else LENGTH_FIELDS
    for field in fields:
        value = get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value - (row.leading_rows(config) if row is not None else 0)
    return None


def check_fit_slopes(fit: bool | None, options: dict[str, Any]) -> None:
    """The one error for slopes asked to be fitted and given at once (``options``: the conversion options given),
    for ``hf-alibi convert --fit-slopes`` and :func:`~hf_alibi.recover.recover`'s ``fit_slopes``.

    >>> check_fit_slopes(True, {"slope_scale": 0.1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: --fit-slopes computes the slopes: drop --slope-scale (slope_scale), or fit none ...
    """
    given = [name for name in ("slopes", "slope_scale") if options.get(name) is not None]
    if fit and given:
        raise ValueError(
            f"--fit-slopes computes the slopes: drop {' and '.join(flag_spellings(n)[0] for n in given)} "
            f"({', '.join(given)}), or fit none (recover: --no-fit-slopes, fit_slopes=False)."
        )
