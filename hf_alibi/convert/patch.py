"""``patch_model``: convert a transformers model to ALiBi, in place.

The conversion options (``sinks``, ``slope_scale``, ``slopes``, ``rotary_max_wavelength``, ``position_mean``,
``table_max_wavelength``) are declared once, as fields of :class:`hf_alibi.AlibiSettings` (``core.settings.option``):
the keywords of :func:`patch_model`, :func:`settings_for` and the functions :func:`takes_options` marks, the
presets (:data:`PRESETS`), the CLI's flags and ``hf-alibi info``'s line all come from there.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..core.architectures import Architecture
from ..core.config import get_settings
from ..core.conversion import check_fits, check_sinks_fit, convert
from ..core.names import is_alibi
from ..core.partitions import whole_shape, whole_weights
from ..core.settings import AlibiSettings, conversion_options, preset_name
from ..core.strategies import add_position_means, find_modules, position_mean_edits, table_rows
from ..native import NativeArchitecture, patch_native
from . import planning
from .planning import applies as _applies
from .planning import check_heads, encoder_variant_for, resolve_options  # noqa: F401  (resolve_options: its old home)
from .registry import alibi_classes, get_architecture, get_native_architecture

OPTIONS: tuple[str, ...] = tuple(f.name for f in conversion_options())
# Named settings for patch_model(preset=...), from the options' declarations (core/settings.py: presets). "pretrained":
# for a pretrained checkpoint (no training after the conversion, or before recovery). The planner's (no torch).
PRESETS: dict[str, dict[str, Any]] = planning.PRESETS


def takes_options(function: Callable) -> Callable:
    """Give ``function`` (whose last parameter is ``**options``) the conversion options as keyword-only
    parameters: its signature lists them (default None: the preset's value, else the paper's) and an unknown
    keyword is a ``TypeError``, as for a written-out signature.

    >>> "sinks" in inspect.signature(patch_model).parameters
    True
    """
    signature = inspect.signature(function)
    params = list(signature.parameters.values())
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD, f"{function.__name__} takes **options"
    declared = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=f.type if str(f.type).endswith("None") else f"{f.type} | None",
        )
        for f in conversion_options()
        if f.name not in signature.parameters
    ]
    known = {p.name for p in params[:-1]} | set(OPTIONS)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{function.__name__}() got an unexpected keyword argument {unknown[0]!r}")
        return function(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*params[:-1], *declared])  # no other keyword
    return wrapper


@dataclass(frozen=True)
class ConversionPlan:
    """One conversion, planned once from the original config and the options (:func:`plan_conversion`), before
    anything changes: the settings ``config.json`` will hold and the architecture row. :meth:`for_model` completes it
    with what only the model tells: its ``Alibi<Class>``, the learned table's rows (``table_max_wavelength``), each
    position table's mean (``position_mean``: measured once, added by :func:`patch_model` after every check) and
    whether the settings fit it (sinks, per-layer slopes). :func:`settings_for`, :func:`patch_model`, the checkpoint
    jobs and :func:`hf_alibi.recover.recover` read it.

    >>> plan = plan_conversion(llama_config, preset="pretrained")  # doctest: +SKIP
    >>> patch_model(model, plan=plan.with_slopes(hf_alibi.fit_slopes(model, ids, sinks=plan.settings.sinks)))
    """

    settings: AlibiSettings
    row: Architecture
    config: PretrainedConfig = field(repr=False, compare=False)  # the original's, as planned from
    given: dict = field(repr=False, compare=False)  # heads, encoder_variant, preset and the options as given
    alibi_class: type | None = None  # with the model (for_model)
    mean_edits: tuple = field(default=(), repr=False)  # (embedding, fp32 mean) pairs, with the model
    completed_for: weakref.ref | None = field(default=None, repr=False, compare=False)  # that model

    def with_slopes(self, slopes) -> ConversionPlan:
        """This plan with ``slopes`` given: fitted by the original (:func:`hf_alibi.fit_slopes`) after planning,
        with the plan's sinks. Before :meth:`for_model`."""
        return plan_conversion(self.config, **{**self.given, "slopes": slopes})

    def _weight_reads(self, config) -> tuple[bool, bool]:
        """Which weights' values this conversion reads: (the learned table's periodic part, its mean folded)."""
        fields, settings = {f.name: f for f in conversion_options()}, self.settings
        keeps_table = settings.table_max_wavelength is not None and _applies(
            fields["table_max_wavelength"], self.row, config
        )
        mean = settings.position_mean
        folds_mean = type(mean) is int and mean > 0 and _applies(fields["position_mean"], self.row, config)
        return keeps_table, folds_mean  # a bad mean: checked as the settings were made

    def reads_weights(self, config) -> bool:
        """True where the conversion reads weight values (not only shapes): it cannot run on the meta device."""
        return any(self._weight_reads(config))

    def for_model(self, model: PreTrainedModel) -> ConversionPlan:
        """The plan completed with ``model`` (of the planned type, not converted yet): one-line ``ValueError`` where
        it does not fit; nothing changes."""
        if self.completed_for is not None:  # measured once: the plan as completed, for that model only
            if self.completed_for() is not model:
                raise ValueError(
                    "This plan was completed for another model (its position means are that model's): complete the "
                    "plan made before for_model with this one."
                )
            return self
        config, row, settings = model.config, self.row, self.settings
        if config.model_type != settings.base_model_type:
            raise ValueError(
                f"This plan converts a {settings.base_model_type} model, not {config.model_type}: plan it from this "
                "model's config (hf_alibi.plan_conversion(model.config, ...))."
            )
        classes = alibi_classes(config.model_type)
        alibi_cls = classes.get(type(model))
        if alibi_cls is None:
            raise ValueError(
                f"hf_alibi has no ALiBi class for {type(model).__name__}; for model_type {config.model_type!r} "
                f"it converts: {', '.join(sorted(cls.__name__ for cls in classes))}."
            )
        with whole_weights(model, "plan.for_model", reads=self.reads_weights(config)):  # read whole, or refused
            return self._completed(model, row, settings, alibi_cls)

    def _completed(self, model: PreTrainedModel, row, settings: AlibiSettings, alibi_cls: type) -> ConversionPlan:
        config = model.config
        changes, edits = {}, ()
        keeps_table, folds_mean = self._weight_reads(config)
        if keeps_table:
            changes["table_rows"] = _table_rows(model, row)
        if folds_mean:
            mean = settings.position_mean
            try:
                edits = position_mean_edits(model.base_model, row.position, mean)
            except ValueError:
                if self.given.get("position_mean") is not None:
                    raise
                changes["position_mean"] = 0  # the preset's value, where the table's owner cannot take it
        if changes:
            settings = dataclasses.replace(settings, **changes)  # checked again as it is made
        check_fits(model, settings, row)  # the strategy, sinks for this kind of model, per-layer slopes
        completed = weakref.ref(model)
        return dataclasses.replace(
            self, settings=settings, alibi_class=alibi_cls, mean_edits=edits, completed_for=completed
        )


@takes_options
def plan_conversion(
    config, heads: int | None = None, encoder_variant: str | None = None, *, preset: str | None = None, **options
) -> ConversionPlan:
    """The conversion :func:`patch_model` would make of a model of the original ``config``, or the one-line
    ``ValueError`` it would raise: every argument is checked here, once, before any model is loaded or changed
    (``hf-alibi convert`` plans from SRC's config.json first).

    >>> plan_conversion(GPT2Config(n_head=4), preset="pretrained").settings.sinks  # doctest: +SKIP
    1
    """
    row = get_architecture(config.model_type)
    given = {"heads": heads, "encoder_variant": encoder_variant, "preset": preset, **options}
    heads = check_heads(heads, config.num_attention_heads)  # the planner's rules (hf_alibi.convert.planning), no torch
    encoder_variant = encoder_variant_for(row, encoder_variant)
    settings = AlibiSettings(  # checks the options (check_pretrained_options) as it is made
        base_model_type=config.model_type,
        heads=heads,
        encoder_variant=encoder_variant,
        architecture=row.to_dict(),
        **resolve_options(config, row, preset, **options),
    )
    check_sinks_fit(config, settings)
    return ConversionPlan(settings, row, config, given)


@takes_options
def settings_for(
    config, heads: int | None = None, encoder_variant: str | None = None, *, preset: str | None = None, **options
) -> AlibiSettings:
    """The settings :func:`patch_model` would store for a model of the original ``config`` (before what only the
    weights tell: :meth:`ConversionPlan.for_model`): :func:`plan_conversion`'s.

    >>> settings_for(GPT2Config(n_head=4), preset="pretrained").sinks  # doctest: +SKIP
    1
    """
    return plan_conversion(config, heads, encoder_variant, preset=preset, **options).settings


@takes_options
def patch_model(
    model: PreTrainedModel,
    heads: int | None = None,
    encoder_variant: str | None = None,
    *,
    preset: str | None = None,
    plan: ConversionPlan | None = None,
    **options,
) -> PreTrainedModel:
    """Convert ``model`` to ALiBi in place and return it.

        The position path is removed (GPT-2's ``wpe``, a rotary embedding, BERT's table, T5's relative
        bias: inputs of any length run, position ids are ignored) and every self-attention layer adds the
        ALiBi bias through transformers' attention interface, for the backend the model uses (``eager``,
        ``sdpa``, ``flex_attention``, ``flash_attention_2``). Only this instance changes: its class
        becomes ``Alibi<Class>`` and its config ``Alibi<Config>`` with ``config.alibi``, so
        ``save_pretrained`` writes ``model_type="alibi_<type>"`` and, after ``import hf_alibi``,
        ``AutoModel*.from_pretrained`` rebuilds the same model. Every weight that is not removed is kept.

        A model trained with ALiBi (:func:`hf_alibi.native_model_types`: BLOOM, MPT with ``attn_config.alibi``,
        Falcon-RW with ``alibi=True``) is not converted: its config, type and weights stay, and only its attention
        moves onto hf_alibi's paths (``sdpa`` by default, the fold), with the model's own slopes; it takes no
        options, and ``save_pretrained`` writes the original format (see ``hf_alibi.native``).

        Args:
            model: a model of a registered architecture (:func:`hf_alibi.supported_model_types`) or one trained
                with ALiBi (:func:`hf_alibi.native_model_types`).
            heads: number of attention heads; must equal the config's (checked, since slopes are
                computed for it). Defaults to the config's.
            encoder_variant: bias of bidirectional self-attention (``"symmetric"``, the default;
                ``"nonsymmetric"``; ``"learned"``). An error for decoder-only models.
            preset: ``None`` (the paper's method) or a name in :data:`PRESETS`: ``"pretrained"`` keeps
                more of what a pretrained checkpoint knew (attention sinks, the short-wavelength rotary
                frequencies, smaller slopes). The conversion options override the preset's values.
            plan: instead of ``heads``, ``encoder_variant``, ``preset`` and the options, the
                :class:`ConversionPlan` made of them (:func:`plan_conversion`, e.g. before the model was loaded).
            **options: the conversion options, keyword-only (None: the preset's value, else the paper's), declared
                as fields of :class:`hf_alibi.AlibiSettings`, saved in ``config.alibi`` and rebuilt on load:

    {options}

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
    native = get_native_architecture(config.model_type)
    if native is not None:  # trained with ALiBi: nothing converted, its attention moved (hf_alibi.native)
        _check_native_arguments(native, config, heads, encoder_variant, preset, options)
        if plan is not None:
            raise ValueError(f"{native.model_type} was trained with ALiBi: it takes no plan. Call patch_model(model).")
        return patch_native(model, native)
    if is_alibi(config):
        raise ValueError(
            f"This model is already an ALiBi model ({get_settings(config)}); patch_model converts a "
            "model once. Load the original checkpoint again to convert it with other settings."
        )
    if plan is None:
        plan = plan_conversion(config, heads, encoder_variant, preset=preset, **options)
    elif (
        heads is not None
        or encoder_variant is not None
        or preset is not None
        or any(value is not None for value in options.values())
    ):
        raise TypeError("patch_model takes a plan or the options it is made from, not both: put them in the plan.")
    # every weight read whole (a ZeRO-3 partition gathered) or a one-line refusal first (core/partitions.py)
    with whole_weights(model, "patch_model", write=True, reads=plan.reads_weights(config)):
        plan = plan.for_model(model)  # every check, once
        # Everything is validated: from here on the instance changes (its weights, then its config, a copy).
        add_position_means(plan.mean_edits)
        convert(model, plan.settings, plan.row, plan.alibi_class)
    return model


def _check_native_arguments(row: NativeArchitecture, config, heads, encoder_variant, preset, options: dict) -> None:
    """One-line ``ValueError`` for an argument of :func:`patch_model` that means nothing for a model trained with
    ALiBi: it keeps its own slopes, heads and causal attention."""
    given = [name for name, value in options.items() if value is not None]
    given += ["preset"] * (preset_name(preset) is not None) + ["encoder_variant"] * (encoder_variant is not None)
    if given:
        raise ValueError(
            f"{', '.join(given)} do(es) not apply to {row.model_type}: it was trained with ALiBi and keeps its own "
            f"slopes. Call hf_alibi.patch_model(model) without options."
        )
    if heads is not None and heads != config.num_attention_heads:
        raise ValueError(
            f"heads={heads} does not match the model's {config.num_attention_heads} attention heads. Omit heads."
        )


def _options_doc() -> str:
    lines = []
    for f in conversion_options():
        lines.append(f"            ``{f.name}``: {f.metadata['help']}")
    return "\n".join(lines)


patch_model.__doc__ = patch_model.__doc__.replace("{options}", _options_doc())


def _table_rows(model: PreTrainedModel, row) -> int:
    """The used rows of the model's learned position table(s), for ``table_max_wavelength`` (one-line
    ``ValueError`` where a table is not an embedding, or the tables differ)."""
    counts = set()
    for path in row.position:
        for _, _, table in find_modules(model.base_model, path):
            if not isinstance(getattr(table, "weight", None), torch.Tensor) or len(whole_shape(table.weight)) != 2:
                raise ValueError(
                    f"table_max_wavelength needs a learned table of shape (rows, width) at {path!r}; "
                    f"{type(table).__name__} has none. Leave it None."
                )
            counts.add(table_rows(table)[1])
    if len(counts) != 1:
        raise ValueError(f"table_max_wavelength needs one table length, found {sorted(counts)}. Leave it None.")
    return counts.pop()
