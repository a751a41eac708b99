"""Recovery's settings, declared once (:class:`RecoverySettings`), checked before anything loads.

Every setting of :func:`hf_alibi.recover.recover` is one field of :class:`RecoverySettings`, made with
:func:`setting`: its help, its ``hf-alibi recover`` flag (:func:`add_setting_flags`), its check (run when the object
is made), and whether the :class:`~hf_alibi.recover.DistillationTrainer` takes it (``scripts/run_clm.py``'s
``distill_*`` fields: :func:`with_distill_fields`). The conversion options (``sinks``, ``slope_scale``, ...) stay
declared in :mod:`hf_alibi.core.settings`; they join :class:`RecoverySettings` as fields from there.

The checks that need the teacher's length or several settings at once are :func:`check_settings`, for
:func:`~hf_alibi.recover.recover` and ``hf-alibi recover`` (which checks before loading the model: the teacher's
length limit comes from its config); the lengths themselves are :mod:`hf_alibi.recover.lengths`'.

This module imports only the standard library and :mod:`hf_alibi.core.settings` (neither torch nor transformers):
``hf-alibi recover --help`` builds its flags from it before the library loads (tests/cli/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..convert.planning import check_fit_slopes
from ..core.names import ENCODER_VARIANTS
from ..core.settings import conversion_options, flag_spellings, preset_name, presets
from .lengths import EVAL_FACTORS, MAX_DEFAULT_LENGTH, MAX_EVAL_LENGTH

HIDDEN_LAYERS = ("last", "all")  # the hidden-state loss on the last layer, or the mean over every layer's output

# The learning rate when none is given, by how far the conversion starts from the original; LoRA: LORA_FACTOR x
# the full rate (docs/measurements.md).
DEFAULT_LEARNING_RATES = {"causal": 1e-5, "encoder": 1e-4, "seq2seq": 1e-4, "paper": 2e-4}
LORA_FACTOR = 20.0

Check = Callable[[str, Any], None]  # (name, value): a one-line ValueError for a bad value, else nothing


def setting(
    default: Any,
    help: str,
    *,
    flag: dict[str, Any] | None = None,
    check: Check | None = None,
    distill: bool = False,
):
    """A recovery setting, declared once as a field of :class:`RecoverySettings`: a keyword of
    :func:`~hf_alibi.recover.recover` and :func:`~hf_alibi.recover.recover_checkpoint`; with ``flag`` (the
    ``argparse.add_argument`` keywords: ``type``, ``help``, ``choices``, ...) the ``hf-alibi recover`` flags
    ``--name-with-dashes`` and ``--name_with_underscores``, default ``default``; ``check(name, value)`` runs when
    the settings are made; ``distill``: a keyword of :class:`~hf_alibi.recover.DistillationTrainer`, so also
    ``scripts/run_clm.py``'s ``--distill_<name>``.
    """
    metadata = {"help": help, "flag": flag, "check": check, "distill": distill, "conversion": False}
    return field(default=default, metadata=metadata)


def at_least(floor: int) -> Check:
    """The check of an integer setting that is at least ``floor`` (None: the default, allowed)."""

    def check(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < floor):
            raise ValueError(f"{name} must be an integer >= {floor}, got {value!r} (--{name}).")

    return check


def positive_number(name: str, value: Any) -> None:
    if value is not None and not (_finite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r} (--{name}).")


def _share(name: str, value: Any) -> None:
    if not (_finite(value) and 0 <= value <= 1):
        raise ValueError(f"{name} must be between 0 and 1 (the share of the LM loss), got {value!r} (--{name}).")


def _at_least_zero(name: str, value: Any) -> None:
    if not (_finite(value) and value >= 0):
        raise ValueError(f"{name} must be >= 0, got {value!r} (--{name}).")


def _hidden_layers(name: str, value: Any) -> None:
    if value not in HIDDEN_LAYERS:
        raise ValueError(f"{name} must be one of {HIDDEN_LAYERS}, got {value!r}.")


def _known_preset(name: str, value: Any) -> None:
    if value is not None and value not in presets():  # "paper" among them: the paper's method
        raise ValueError(f"Unknown preset {value!r}; known: {sorted(presets())} (--preset).")


def _fraction(name: str, value: Any) -> None:
    if not (_finite(value) and 0 < value < 1):
        raise ValueError(f"eval_fraction must be between 0 and 1, got {value}.")


def _factors(name: str, value: Any) -> None:
    if not value or not all(isinstance(f, int) and not isinstance(f, bool) and f >= 1 for f in value):
        raise ValueError(f"eval_factors must be integers >= 1 (multiples of length), got {value!r}.")


def _deepspeed_config(name: str, value: Any) -> None:
    if value is not None:
        from ..train.distributed import check_deepspeed_config  # the same check as run_clm.py's

        check_deepspeed_config(value)


def _with_conversion_options(cls: type) -> type:
    """The conversion options (:func:`hf_alibi.core.settings.conversion_options`, declared there once) as fields
    of ``cls``, default None (the preset's value, else the paper's), with their own flags; checked by the conversion
    (``hf_alibi.convert.patch.settings_for``), as :func:`hf_alibi.patch_model` checks them."""
    annotations = cls.__dict__["__annotations__"]
    for option in conversion_options():
        annotations[option.name] = option.type if str(option.type).endswith("None") else f"{option.type} | None"
        flag = {"type": option.metadata["parse"], "help": option.metadata["flag_help"]}
        help = f"{option.metadata['help']} None: the preset's value, else the paper's."
        metadata = {"help": help, "flag": flag, "check": None, "distill": False, "conversion": True}
        setattr(cls, option.name, field(default=None, metadata=metadata))
    return cls


@dataclass(frozen=True)
@_with_conversion_options
class RecoverySettings:
    """Every setting of :func:`~hf_alibi.recover.recover`, declared once: each field's help, its ``hf-alibi
    recover`` flag and its check are in its declaration (:func:`setting`); a bad value is a one-line
    ``ValueError`` when the object is made. The conversion options (``sinks``, ``slope_scale``, ...) are fields too,
    declared in :class:`hf_alibi.core.settings.AlibiSettings`.

    Example:
        >>> settings = RecoverySettings(max_steps=300, lora_rank=16)
        >>> settings.max_steps, settings.preset, settings.sinks
        (300, 'pretrained', None)
        >>> RecoverySettings(max_steps=0)
        Traceback (most recent call last):
        ValueError: max_steps must be an integer >= 1, got 0 (--max_steps).
    """

    length: int | None = setting(
        None,
        "Training length; default min(original maximum, 512) (the cap is printed when it bites). More than the "
        "original maximum is refused: the teacher cannot run there.",
        flag={"type": int, "help": "training length (default: the original maximum, at most 512)"},
        check=at_least(1),
    )
    max_steps: int = setting(500, "Optimizer steps (AdamW, cosine schedule).", flag={"type": int}, check=at_least(1))
    batch_size: int = setting(8, "Blocks per step.", flag={"type": int}, check=at_least(1))
    learning_rate: float | None = setting(
        None,
        "Peak learning rate; default by how close the conversion starts (default_learning_rate): with the preset "
        "1e-5 for causal LMs, 1e-4 for encoders and encoder-decoders; 2e-4 with the paper's conversion; x 20 with "
        "LoRA.",
        flag={"type": float, "help": "default: 1e-5 causal, 1e-4 encoders (the preset); 2e-4 (--preset paper); x 20 "
              "with LoRA"},
        check=positive_number,
    )  # fmt: skip
    warmup_steps: int | None = setting(
        None, "Linear warm-up steps (default: 5% of the steps).", flag={"type": int}, check=at_least(0)
    )
    weight_decay: float = setting(0.01, "AdamW's weight decay.", flag={"type": float}, check=_at_least_zero)
    lm_weight: float = setting(
        0.0,
        "Share of the ordinary LM / MLM loss in the loss (0: distillation only).",
        flag={"type": float, "help": "share of the LM/MLM loss (0..1)"},
        check=_share,
        distill=True,
    )
    temperature: float = setting(
        1.0,
        "Temperature of the distillation KL (causal LMs): both distributions softened by it, the KL scaled by its "
        "square.",
        flag={"type": float, "help": "KL temperature (causal LMs)"},
        check=positive_number,
        distill=True,
    )
    hidden_layers: str = setting(
        "last",
        "Hidden-state loss layers (encoders, models without an LM head): 'last' or 'all' (the mean over layers).",
        flag={"choices": HIDDEN_LAYERS},
        check=_hidden_layers,
        distill=True,
    )
    heads: int | None = setting(
        None,
        "Number of attention heads (hf_alibi.patch_model's; must match the config, checked).",
        flag={"type": int, "help": "number of heads (must match the config; checked)"},
    )
    encoder_variant: str | None = setting(
        None,
        "Bidirectional bias of encoders (hf_alibi.patch_model's; default symmetric).",
        flag={"choices": ENCODER_VARIANTS, "help": "bidirectional bias (default symmetric)"},
    )
    warm_start_steps: int = setting(
        0,
        "Keep the original learned position table (a frozen copy) added to the student's input embeddings, faded "
        "linearly to zero over these first steps.",
        flag={"type": int},
        check=at_least(0),
        distill=True,
    )
    attention_only_steps: int = setting(
        0, "Train only the attention weights during these first steps.", flag={"type": int}, check=at_least(0),
        distill=True,
    )  # fmt: skip
    preset: str | None = setting(
        "pretrained",
        "Conversion preset (its values: hf_alibi.convert.patch.PRESETS); 'paper' or None: the paper's method (kept as "
        "None).",
        flag={"help": "conversion preset (hf_alibi.convert.patch.PRESETS); 'paper': the paper's ALiBi"},
        check=_known_preset,
    )
    fit_slopes: bool | None = setting(
        None,
        "Slopes fitted per layer and head by the teacher on the first min(original maximum, 1024) training tokens "
        "(hf_alibi.fit_slopes) instead of the preset's uniform scale. Default: with a preset and no slopes / "
        "slope_scale given, on the models it can fit (decoder-only and encoders).",
        flag={
            "action": argparse.BooleanOptionalAction,
            "help": "slopes fitted per layer and head by SRC on the training text (default: with a preset)",
        },
    )
    lora_rank: int = setting(
        0,
        "0 trains every weight; R > 0 trains LoRA adapters of rank R on the attention and MLP projections only, "
        "merged into the weights at the end (the student is a normal converted model).",
        flag={"type": int, "help": "LoRA rank (0: train every weight)"},
        check=at_least(0),
    )
    eval_fraction: float = setting(
        0.05, "Share of the text held out for the agreement figures (unless eval_texts is given).", check=_fraction
    )
    max_eval_tokens: int = setting(8192, "Most held-out tokens the agreement is measured on.", check=at_least(1))
    eval_factors: tuple[int, ...] = setting(
        EVAL_FACTORS, "Agreement at these multiples of length (up to max_eval_length).", check=_factors
    )
    max_eval_length: int | None = setting(
        MAX_EVAL_LENGTH,
        "Longest agreement length in tokens (None: no cap; the lengths left out are printed).",
        flag={"type": int, "help": "longest agreement length (tokens)"},
        check=at_least(1),
    )
    eval_every: int | None = setting(
        None,
        "Agreement every this many steps (default max_steps // 4), also at 0 and at the end.",
        flag={"type": int, "help": "default: max steps / 4"},
        check=at_least(0),
    )
    deepspeed: str | None = setting(
        None,
        "A DeepSpeed config (configs/deepspeed/zero2.json, zero3.json): the student trains partitioned (ZeRO-2: its "
        "optimizer state and gradients; ZeRO-3: its weights too), the teacher stays whole on every process. Launch "
        "several processes (torchrun, deepspeed); on CPUs DS_ACCELERATOR=cpu (gloo). Not with lora_rank.",
        flag={"type": str, "metavar": "CONFIG", "help": "DeepSpeed config (ZeRO-2 / ZeRO-3; docs/recovery.md)"},
        check=_deepspeed_config,
    )
    fsdp: bool = setting(
        False,
        "FSDP2 (torch's fully_shard, through the Trainer: configs/fsdp/fsdp2.json): the student's weights, gradients "
        "and optimizer state sharded over the processes (each module of the model's _no_split_modules one unit), the "
        "teacher whole on every process. Launch several processes (torchrun); on CPUs over gloo. Not with lora_rank "
        "or deepspeed.",
        flag={"action": "store_true", "help": "FSDP2 over the launched processes (docs/recovery.md)"},
    )
    shard_teacher: bool = setting(
        False,
        "With fsdp: the teacher sharded over the processes too (FSDP2, each forward gathering one layer at a time), "
        "for a teacher too large for one device; default: whole on every process (no gathering per step). "
        "recover() shards the teacher it is given in place: pass a copy to keep yours whole.",
        flag={
            "action": "store_true",
            "help": "with --fsdp: shard the teacher too (too large for one device)",
        },
    )
    seed: int = setting(0, "The Trainer's seed.", flag={"type": int})
    progress: bool = setting(True, "The Trainer's progress bar.")
    output_dir: str | None = setting(
        None, "Where the Trainer's checkpoints go (needed by save_steps; CLI: --checkpoint-dir)."
    )
    save_steps: int | None = setting(
        None,
        "A Trainer checkpoint every this many steps, in output_dir.",
        flag={"type": int, "help": "Trainer checkpoint every N steps"},
        check=at_least(1),
    )
    resume_from_checkpoint: str | bool | None = setting(
        None,
        "Resume from a Trainer checkpoint (a checkpoint-N folder, or True: the last in output_dir); the run ends "
        "where the uninterrupted one would.",
        flag={"metavar": "CHECKPOINT"},
    )

    def __post_init__(self):
        # a list is accepted (and kept hashable, as a frozen dataclass should be)
        object.__setattr__(self, "eval_factors", tuple(self.eval_factors))
        object.__setattr__(self, "preset", preset_name(self.preset))  # the paper's method: None, as patch_model's
        for declared in dataclasses.fields(self):
            check = declared.metadata["check"]
            if check is not None:
                check(declared.name, getattr(self, declared.name))

    def conversion_options(self) -> dict[str, Any]:
        """The conversion options given (not None), as :func:`hf_alibi.patch_model`'s keywords."""
        options = (f.name for f in dataclasses.fields(self) if f.metadata["conversion"])
        return {name: getattr(self, name) for name in options if getattr(self, name) is not None}

    def distillation_arguments(self) -> dict[str, Any]:
        """The :class:`~hf_alibi.recover.DistillationTrainer`'s keywords (the fields declared ``distill``)."""
        return {f.name: getattr(self, f.name) for f in distill_settings()}


def recovery_settings(settings: RecoverySettings | None = None, /, **overrides: Any) -> RecoverySettings:
    """``settings`` (default: :class:`RecoverySettings`' defaults) with ``overrides``, checked; an unknown name is a
    ``TypeError`` that lists the known ones.

    >>> recovery_settings(RecoverySettings(max_steps=300), lora_rank=16).lora_rank
    16
    """
    known = [f.name for f in dataclasses.fields(RecoverySettings)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument {unknown[0]!r}: no such recovery setting; known: {', '.join(known)}."
        )
    if settings is not None and not isinstance(settings, RecoverySettings):
        raise TypeError(f"settings must be a RecoverySettings, got {type(settings).__name__}.")
    return dataclasses.replace(settings or RecoverySettings(), **overrides)


def flag_settings() -> tuple[dataclasses.Field, ...]:
    """The settings that ``hf-alibi recover`` takes as flags, in their order."""
    return tuple(f for f in dataclasses.fields(RecoverySettings) if f.metadata["flag"] is not None)


def distill_settings() -> tuple[dataclasses.Field, ...]:
    """The settings the :class:`~hf_alibi.recover.DistillationTrainer` takes (``run_clm.py``'s ``distill_*``)."""
    return tuple(f for f in dataclasses.fields(RecoverySettings) if f.metadata["distill"])


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """The recovery settings as ``hf-alibi recover`` flags (``--max-steps``, also ``--max_steps``), from their
    declarations; the conversion options' flags among them."""
    for declared in flag_settings():
        parser.add_argument(
            *flag_spellings(declared.name), dest=declared.name, default=declared.default, **declared.metadata["flag"]
        )


def settings_from_flags(args: argparse.Namespace) -> RecoverySettings:
    """The :class:`RecoverySettings` of a parsed ``hf-alibi recover`` command line (:func:`add_setting_flags`)."""
    return RecoverySettings(**{f.name: getattr(args, f.name) for f in flag_settings()})


def with_distill_fields(cls: type) -> type:
    """Give a dataclass-to-be (``scripts/run_clm.py``'s ``ModelArguments``) the Trainer's settings as
    ``distill_<name>`` fields, from their declarations (type, default, help; parsed by ``HfArgumentParser``, whose
    metadata must hold only ``add_argument`` keywords). Use it below ``@dataclass``."""
    annotations = cls.__dict__["__annotations__"]
    for declared in distill_settings():
        flag = declared.metadata["flag"]
        name = "distill_" + declared.name
        annotations[name] = flag.get("type", str)
        metadata = {"help": declared.metadata["help"], **({"choices": flag["choices"]} if "choices" in flag else {})}
        setattr(cls, name, field(default=declared.default, metadata=metadata))
    return cls


def distill_settings_of(arguments: Any) -> RecoverySettings:
    """The :class:`RecoverySettings` of an object with :func:`with_distill_fields`' fields, checked: each declared
    check runs on the ``distill_<name>`` value first, so that its message names the flag run_clm.py took."""
    values = {f.name: getattr(arguments, "distill_" + f.name) for f in distill_settings()}
    for declared in distill_settings():
        if declared.metadata["check"] is not None:
            declared.metadata["check"]("distill_" + declared.name, values[declared.name])
    return RecoverySettings(**values)


def default_learning_rate(kind: str, preset: str | None, lora_rank: int = 0) -> float:
    """The learning rate :func:`recover` uses when none is given (:data:`DEFAULT_LEARNING_RATES`); ``preset``: as
    :attr:`RecoverySettings.preset` holds it (None: the paper's method).

    >>> default_learning_rate("causal", "pretrained"), default_learning_rate("causal", "pretrained", lora_rank=16)
    (1e-05, 0.0002)
    >>> default_learning_rate("encoder", None)
    0.0002
    """
    rate = DEFAULT_LEARNING_RATES["paper" if preset is None else kind]
    return rate * LORA_FACTOR if lora_rank else rate


def check_settings(
    original: int | None = None, settings: RecoverySettings | None = None, /, **overrides: Any
) -> RecoverySettings:
    """The checks of the recovery settings: each field's (:class:`RecoverySettings`), then those that need the
    teacher's maximum length ``original`` (which ``length`` may not pass: it could not run there) or several
    settings at once. One-line ``ValueError`` for the first bad one; returns the settings.

    >>> check_settings(32, length=64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: length 64 is longer than the original model's 32 positions: the teacher cannot run there. ...
    """
    settings = recovery_settings(settings, **overrides)
    length = settings.length
    if length is not None and original and length > original:
        raise ValueError(
            f"length {length} is longer than the original model's {original} positions: the teacher cannot run "
            f"there. Pass --length {original} or less (the recovered model runs longer after)."
        )
    max_eval_length = settings.max_eval_length
    effective = length or (min(original, MAX_DEFAULT_LENGTH) if original else None)
    if max_eval_length is not None and effective and max_eval_length < effective:
        raise ValueError(
            f"max_eval_length {max_eval_length} is shorter than the training length {effective}: pass at least "
            f"{effective} (--max_eval_length)."
        )
    sharding = "deepspeed" if settings.deepspeed else "fsdp" if settings.fsdp else None
    if sharding and settings.lora_rank:
        raise ValueError(
            f"lora_rank does not run with {sharding} yet (its adapters would be merged from partitioned weights): "
            f"train every weight (lora_rank 0), or distil LoRA adapters without --{sharding}."
        )
    if settings.deepspeed and settings.fsdp:
        raise ValueError("deepspeed and fsdp both shard the student: choose one (--deepspeed CONFIG or --fsdp).")
    if settings.shard_teacher and not settings.fsdp:
        raise ValueError(
            "shard_teacher shards the teacher with FSDP2 over the processes of fsdp: add --fsdp (a ZeRO-3 teacher is "
            "not built: under --deepspeed the teacher is whole on every process)."
        )
    if settings.save_steps and not settings.output_dir:
        raise ValueError("save_steps needs output_dir (where the Trainer checkpoints go).")
    check_fit_slopes(settings.fit_slopes, settings.conversion_options())
    if settings.fit_slopes and settings.preset is None:
        raise ValueError("fit_slopes needs the pretrained preset (sinks, retained rotary): drop preset='paper'.")
    return settings


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
