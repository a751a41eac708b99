"""``patch_model``: convert a transformers model to ALiBi, in place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .core.config import AlibiSettings, get_settings, is_alibi_config
from .core.modeling import check_sinks_fit, check_slopes_fit, convert, self_attentions, sinks_fit
from .core.slopes import ENCODER_VARIANTS, SYMMETRIC
from .core.strategies import find_modules, fold_position_mean, table_rows
from .registry import alibi_classes, get_architecture


@dataclass(frozen=True)
class OriginalLength:
    """A preset's wavelength bound as a multiple of the original ``max_position_embeddings`` (the rotary bound on
    rotary rows, the table's on encoders' learned tables)."""

    times: float = 1.0


# Named settings for patch_model(preset=...): the one table to change when better values are measured.
# "pretrained": for a pretrained checkpoint (no training after the conversion, or before recovery); how each
# value was measured: docs/measurements.md.
PRESETS: dict[str, dict] = {
    "pretrained": {
        "sinks": 1,
        "rotary_max_wavelength": OriginalLength(8.0),
        "slope_scale": 0.01,
        "position_mean": 128,
        "table_max_wavelength": OriginalLength(1.0),
    },
}


def resolve_options(
    config,
    row,
    preset: str | None = None,
    *,
    sinks: int | None = None,
    rotary_max_wavelength: float | None = None,
    slope_scale: float | None = None,
    slopes: list[float] | None = None,
    position_mean: int | None = None,
    table_max_wavelength: float | None = None,
) -> dict:
    """The pretrained options ``patch_model`` stores: the preset's, overridden by the explicit ones.

    ``config`` is the ORIGINAL config (its ``max_position_embeddings`` is cleared by the conversion);
    a preset's rotary bound is a multiple of that length on rotary rows and ``None`` on the others, its
    ``position_mean`` applies to absolute rows only, its ``sinks`` to models other than encoder-decoders (T5).
    Explicit ``slopes`` drop a preset's ``slope_scale``.

    >>> resolve_options(llama_config, get_architecture("llama"), "pretrained")  # doctest: +SKIP
    {'sinks': 1, 'rotary_max_wavelength': 65536.0, 'slope_scale': 0.01, 'position_mean': 0, 'slopes': None}
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; known: {sorted(PRESETS)} (or None: the paper's method).")
    values = {
        "sinks": 0, "rotary_max_wavelength": None, "slope_scale": 1.0, "position_mean": 0, "slopes": None,
        "table_max_wavelength": None,
    }  # fmt: skip
    values.update(PRESETS.get(preset, {}))
    if row.strategy != "absolute":
        values["position_mean"] = 0
    if not sinks_fit(config):
        values["sinks"] = 0  # not built there yet (an explicit value is refused): a preset leaves them out
    length = getattr(config, "max_position_embeddings", None)
    applies = {
        "rotary_max_wavelength": row.strategy == "rotary",
        "table_max_wavelength": row.strategy == "absolute" and row.bidirectional,  # encoders' tables only
    }
    for name, here in applies.items():  # a preset's bound: a multiple of the length, where the row has the path
        if isinstance(values[name], OriginalLength):
            values[name] = values[name].times * length if here and length else None
    explicit = dict(
        sinks=sinks, rotary_max_wavelength=rotary_max_wavelength, slope_scale=slope_scale, slopes=slopes,
        position_mean=position_mean, table_max_wavelength=table_max_wavelength,
    )  # fmt: skip
    values.update({name: value for name, value in explicit.items() if value is not None})
    if type(values["table_max_wavelength"]) in (int, float) and values["table_max_wavelength"] == 0:  # explicit 0:
        # the table goes entirely, whatever the preset says
        values["table_max_wavelength"] = None
    if slopes is not None and slope_scale is None:
        values["slope_scale"] = 1.0
    if values["slopes"] is not None:
        values["slopes"] = list(values["slopes"])
    return values


def settings_for(
    config,
    heads: int | None = None,
    encoder_variant: str | None = None,
    *,
    preset: str | None = None,
    sinks: int | None = None,
    rotary_max_wavelength: float | None = None,
    slope_scale: float | None = None,
    slopes: list[float] | None = None,
    position_mean: int | None = None,
    table_max_wavelength: float | None = None,
) -> AlibiSettings:
    """The settings :func:`patch_model` would store for a model of the original ``config``, or the
    one-line ``ValueError`` it would raise: every argument is checked here, before any model is loaded
    (``hf-alibi convert`` calls it on SRC's config first).

    >>> settings_for(GPT2Config(n_head=4), preset="pretrained").sinks  # doctest: +SKIP
    1
    """
    row = get_architecture(config.model_type)
    config_heads = config.num_attention_heads
    if heads is None:
        heads = config_heads
    if heads != config_heads:
        raise ValueError(
            f"heads={heads} does not match the model's {config_heads} attention heads "
            f"(config.num_attention_heads); ALiBi needs one slope per head. Pass heads={config_heads} or omit it."
        )
    if row.bidirectional:
        encoder_variant = SYMMETRIC if encoder_variant is None else encoder_variant
        if encoder_variant not in ENCODER_VARIANTS:
            raise ValueError(f"encoder_variant must be one of {ENCODER_VARIANTS}, got {encoder_variant!r}.")
    elif encoder_variant is not None:
        raise ValueError(
            f"encoder_variant={encoder_variant!r} applies to bidirectional attention only; "
            f"{config.model_type} is decoder-only, its self-attention is causal. Omit encoder_variant."
        )
    options = resolve_options(
        config, row, preset, sinks=sinks, rotary_max_wavelength=rotary_max_wavelength, slope_scale=slope_scale,
        slopes=slopes, position_mean=position_mean, table_max_wavelength=table_max_wavelength,
    )  # fmt: skip
    settings = AlibiSettings(  # checks the options (check_pretrained_options) as it is made
        base_model_type=config.model_type,
        heads=heads,
        encoder_variant=encoder_variant,
        architecture=row.to_dict(),
        **options,
    )
    check_sinks_fit(config, settings)
    return settings


def is_alibi_model(model: PreTrainedModel) -> bool:
    """True when ``model`` was converted by hf_alibi (or loaded from such a checkpoint)."""
    return is_alibi_config(model.config)


def patch_model(
    model: PreTrainedModel,
    heads: int | None = None,
    encoder_variant: str | None = None,
    *,
    preset: str | None = None,
    sinks: int | None = None,
    rotary_max_wavelength: float | None = None,
    slope_scale: float | None = None,
    slopes: list[float] | None = None,
    position_mean: int | None = None,
    table_max_wavelength: float | None = None,
) -> PreTrainedModel:
    """Convert ``model`` to ALiBi in place and return it.

    The position path is removed (GPT-2's ``wpe``, a rotary embedding, BERT's table, T5's relative
    bias: inputs of any length run, position ids are ignored) and every self-attention layer adds the
    ALiBi bias through transformers' attention interface, for the backend the model uses (``eager``,
    ``sdpa``, ``flex_attention``, ``flash_attention_2``). Only this instance changes: its class
    becomes ``Alibi<Class>`` and its config ``Alibi<Config>`` with ``config.alibi``, so
    ``save_pretrained`` writes ``model_type="alibi_<type>"`` and, after ``import hf_alibi``,
    ``AutoModel*.from_pretrained`` rebuilds the same model. Every weight that is not removed is kept.

    Args:
        model: a model of a registered architecture (:func:`hf_alibi.supported_model_types`).
        heads: number of attention heads; must equal the config's (checked, since slopes are
            computed for it). Defaults to the config's.
        encoder_variant: bias of bidirectional self-attention (``"symmetric"``, the default;
            ``"nonsymmetric"``; ``"learned"``). An error for decoder-only models.
        preset: ``None`` (the paper's method) or a name in :data:`PRESETS`: ``"pretrained"`` keeps
            more of what a pretrained checkpoint knew (attention sinks, the short-wavelength rotary
            frequencies, smaller slopes). The keyword arguments below override the preset's values.
        sinks: the first ``sinks`` real tokens of each sequence carry no distance penalty.
        rotary_max_wavelength: rotary rows: keep the rotary frequencies of wavelength ``<=`` this
            (tokens); ``None`` removes the rotary embedding entirely.
        slope_scale: multiplies the paper's slopes. slopes: explicit per-head slopes instead.
        position_mean: absolute rows (a learned table): add the mean of the table's first N rows to the
            token-type (else token) embeddings before the table goes, so every token keeps its average
            offset (a weight edit; the preset's value is left out where the model cannot take it).
        table_max_wavelength: encoders' learned tables (BERT, RoBERTa): keep the table's Fourier components of
            wavelength ``<=`` this (tokens), continued past the table; ``0`` (or no preset) removes the table.
        All of them are saved in ``config.alibi`` and rebuilt on load.

    Raises:
        ValueError: unsupported architecture, wrong ``heads``, an encoder variant for a
            decoder-only model, or a model that is already ALiBi (patching twice is an error, so
            that a second call with other settings can never be silently ignored). The model is
            left untouched when this raises.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> import hf_alibi
        >>> model = hf_alibi.patch_model(GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32)))
        >>> model.config.model_type
        'alibi_gpt2'
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"patch_model expects a transformers PreTrainedModel, got {type(model).__name__}.")
    config = model.config
    if is_alibi_config(config):
        raise ValueError(
            f"This model is already an ALiBi model ({get_settings(config)}); patch_model converts a "
            "model once. Load the original checkpoint again to convert it with other settings."
        )
    settings = settings_for(
        config, heads, encoder_variant, preset=preset, sinks=sinks, rotary_max_wavelength=rotary_max_wavelength,
        slope_scale=slope_scale, slopes=slopes, position_mean=position_mean, table_max_wavelength=table_max_wavelength,
    )  # fmt: skip
    row = get_architecture(config.model_type)
    classes = alibi_classes(config.model_type)
    alibi_cls = classes.get(type(model))
    if alibi_cls is None:
        raise ValueError(
            f"hf_alibi has no ALiBi class for {type(model).__name__}; for model_type {config.model_type!r} "
            f"it converts: {', '.join(sorted(cls.__name__ for cls in classes))}."
        )
    check_slopes_fit(settings, len(self_attentions(model.base_model, row)))  # before anything changes
    if settings.table_max_wavelength is not None:
        settings = dataclasses.replace(settings, table_rows=_table_rows(model, row))
    if settings.position_mean:
        try:  # raises before it changes anything
            fold_position_mean(model.base_model, row.position, settings.position_mean)
        except ValueError:
            if position_mean is not None:
                raise
            settings = dataclasses.replace(settings, position_mean=0)  # the preset's value, where it cannot fold
    # Everything is validated: from here on the instance changes (its config becomes a copy).
    convert(model, settings, row, alibi_cls)
    return model


def _table_rows(model: PreTrainedModel, row) -> int:
    """The used rows of the model's learned position table(s), for ``table_max_wavelength`` (one-line
    ``ValueError`` where a table is not an embedding, or the tables differ)."""
    counts = set()
    for path in row.position:
        for _, _, table in find_modules(model.base_model, path):
            if not isinstance(getattr(table, "weight", None), torch.Tensor) or table.weight.dim() != 2:
                raise ValueError(
                    f"table_max_wavelength needs a learned table of shape (rows, width) at {path!r}; "
                    f"{type(table).__name__} has none. Leave it None."
                )
            counts.add(table_rows(table)[1])
    if len(counts) != 1:
        raise ValueError(f"table_max_wavelength needs one table length, found {sorted(counts)}. Leave it None.")
    return counts.pop()
