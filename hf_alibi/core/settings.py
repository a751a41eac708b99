"""The ALiBi settings persisted in config.json (``config.alibi``), and the one declaration of the conversion options.

:class:`AlibiSettings` is what a converted model needs to be rebuilt. Its fields made with :func:`option` are the
conversion options: everything else (``patch_model``'s keywords, the presets, the CLI's flags, ``hf-alibi info``)
reads them from here. :func:`check_pretrained_options` is the one place their values are checked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .names import ENCODER_VARIANTS
from .version import __version__


@dataclass(frozen=True)
class TimesOriginalLength:
    """A preset's wavelength bound given as ``times`` the original length (``positions.original_length``: the
    rotary bound on rotary rows, the table's on encoders' learned tables); a multiplier, not a length."""

    times: float = 1.0


def slope_list(text: str) -> list[float]:
    """``--slopes a,b,...`` as numbers.

    >>> slope_list("0.5,0.25")
    [0.5, 0.25]
    """
    return [float(part) for part in text.split(",")]


slope_list.__name__ = "comma-separated slopes"  # what argparse calls a bad value


class FittedSlopes(list):
    """Per-layer slopes that :func:`hf_alibi.fit_slopes` measured (a list of lists, one per self-attention layer):
    given as ``slopes``, the settings record them as fitted (``slopes_source``), so ``hf-alibi info`` says so."""


def option(
    default,
    help: str,
    *,
    flag_help: str,
    parse: Callable[[str], Any],
    presets: dict[str, Any] | None = None,
    applies: Callable[[Any, Any], bool] | None = None,
    describe: Callable[[AlibiSettings], str | None] | None = None,
    refusal: str | None = None,
):
    """A conversion option, declared once as a field of :class:`AlibiSettings` (saved in config.json):
    :func:`hf_alibi.patch_model`, ``settings_for``, ``recover`` and the checkpoint jobs take it as a keyword,
    ``hf-alibi convert`` and ``recover`` as ``--name-with-dashes`` (``parse``, ``flag_help``), each preset in
    ``presets`` sets it (an :class:`TimesOriginalLength`: that multiple of the original length) where
    ``applies(row, original config)``, and ``hf-alibi info`` says it with ``describe(settings)`` (None: nothing).
    Its checks are :func:`check_pretrained_options`' (the one place): a value other than the default where
    ``applies(row, None)`` is False is refused with ``refusal`` (formatted with ``model_type``, ``strategy`` and
    ``kind``; None: the option is not refused by row, as sinks, which fit by the model's config).
    """
    metadata = {"help": help, "option": True, "flag_help": flag_help, "parse": parse}
    metadata.update(presets=presets or {}, applies=applies, describe=describe, refusal=refusal)
    return field(default=default, metadata=metadata)


FITTED = "fit_slopes"  # AlibiSettings.slopes_source of slopes that fit_slopes measured
# the tokens fit_slopes measures the original's attention on where none are given (hf-alibi convert --fit-tokens,
# recover; at most the original length): SmolLM2-135M past its 8k read better with slopes fitted on 4096 tokens than
# on 1024 (docs/pretrained.md); eager attention keeps one layer's heads x T^2 map at a time
FIT_TOKENS = 4096
# the preset for reading past a pretrained model's length: "pretrained", with the rotary window at half the original
# length instead of the knee (docs/pretrained.md)
LONG = "long"


def rotary_only(name: str, leave: str) -> dict:
    """An option of rotary rows only: where it applies, and the one line where it is given to another row."""
    return dict(
        applies=lambda row, config: row.strategy == "rotary",
        refusal=f"{name} applies to rotary models only; {{model_type}} has a {{strategy!r}} position path. "
        f"Leave it {leave}.",
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
        presets={"pretrained": 1, LONG: 1},
        applies=lambda row, config: not getattr(config, "is_encoder_decoder", False),  # one mask places them
        describe=lambda s: f"sinks: {s.sinks}",
    )
    slope_scale: float = option(
        1.0,
        "Multiplies the paper's slopes (1.0: the paper).",
        flag_help="multiplies the paper's slopes",
        parse=float,
        presets={"pretrained": 0.01, LONG: 0.01},
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
        describe=lambda s: (
            None
            if s.slopes is None
            else "slopes: fitted per layer and head on text (fit_slopes)"
            if s.slopes_source == FITTED
            else "slopes: explicit (--slopes)"
        ),
    )
    rotary_max_wavelength: float | None = option(
        None,
        "Rotary rows only: keep the rotary frequencies whose wavelength 2*pi/inv_freq is at most this (the others "
        "are removed: cos=1, sin=0). None: remove the rotary embedding entirely.",
        flag_help="rotary: keep wavelengths <= X",
        parse=float,
        # every frequency of a usual model (2 pi theta)
        presets={"pretrained": TimesOriginalLength(1024.0), LONG: TimesOriginalLength(1024.0)},
        **rotary_only("rotary_max_wavelength", leave="None"),
        describe=lambda s: (
            None
            if (s.architecture or {}).get("strategy") != "rotary"
            else "rotary frequencies: "
            + ("removed" if s.rotary_max_wavelength is None else f"kept up to wavelength {s.rotary_max_wavelength:g}")
        ),
    )
    rotary_knee: float | None = option(
        None,
        "Rotary rows only: the position (tokens; the original length in the preset) past which the kept rotary "
        "frequencies of wavelength longer than it, which never completed a turn in training, turn rotary_stretch "
        "times slower (inside it nothing changes). None: they turn on as trained.",
        flag_help="rotary: slow the long wavelengths past position X",
        parse=float,
        presets={"pretrained": TimesOriginalLength(1.0), LONG: TimesOriginalLength(1.0)},
        **rotary_only("rotary_knee", leave="None"),
        describe=lambda s: (
            None
            if s.rotary_knee is None or s.rotary_stretch == 1.0
            else f"rotary wavelengths > {s.rotary_knee:g} turn {s.rotary_stretch:g}x slower past position "
            f"{s.rotary_knee:g}"
        ),
    )
    rotary_stretch: float = option(
        1.0,
        "Rotary rows only: how many times slower the long-wavelength rotary frequencies turn past rotary_knee "
        "(1.0: not slowed).",
        flag_help="rotary: how much slower past the knee",
        parse=float,
        presets={"pretrained": 2.0},
        **rotary_only("rotary_stretch", leave="1"),
        describe=lambda s: None,  # said with rotary_knee
    )
    rotary_interpolation: float = option(
        1.0,
        "Rotary rows only: the kept rotary frequencies of wavelength longer than rotary_knee (the original length) "
        "turn this many times slower at every position (YaRN's fully interpolated part, without its ramp or "
        "temperature): past the original length they stay within the angles training saw, at the price of their "
        "angles inside it. With rotary_stretch too, the knee's position is interpolated. 1.0: as trained.",
        flag_help="rotary: interpolate the long wavelengths Xx everywhere",
        parse=float,
        **rotary_only("rotary_interpolation", leave="1"),
        describe=lambda s: (
            None
            if s.rotary_knee is None or s.rotary_interpolation == 1.0
            else f"rotary wavelengths > {s.rotary_knee:g} interpolated {s.rotary_interpolation:g}x at every position"
        ),
    )
    rotary_window: int | None = option(
        None,
        "Rotary rows only: query-key distance (tokens; the original length is the natural choice) below which "
        "every rotary angle is as trained; a pair at distance d >= rotary_window reads the kept frequencies of "
        "wavelength longer than rotary_knee, and its ALiBi penalty, at distance W + (d - W) / rotary_window_stretch "
        "(a knee in distance, not position: neighbours keep their angles everywhere). Runs on eager and sdpa past "
        "the window; other kernels, vLLM and llama.cpp refuse there. None: no window.",
        flag_help="rotary: keep every angle below distance X",
        parse=int,
        presets={LONG: TimesOriginalLength(0.5)},
        **rotary_only("rotary_window", leave="None"),
        describe=lambda s: (
            None
            if s.rotary_window is None
            else f"rotary wavelengths > {s.rotary_knee:g} and the penalty read distance W + (d - W) / "
            f"{s.rotary_window_stretch:g} past distance W = {s.rotary_window}"
        ),
    )
    rotary_window_stretch: float = option(
        1.0,
        "Rotary rows only: how many times slower the long-wavelength rotary frequencies turn with distance past "
        "rotary_window (1.0: not slowed).",
        flag_help="rotary: how much slower past the window",
        parse=float,
        presets={LONG: 3.0},
        **rotary_only("rotary_window_stretch", leave="1"),
        describe=lambda s: None,  # said with rotary_window
    )
    position_mean: int = option(
        0,
        "Absolute rows only: the mean of the first `position_mean` rows of the removed position table was added to "
        "the token-type (else token) embeddings at conversion, a weight edit recorded here (the saved weights carry "
        "it; nothing is redone on load). 0: the table just goes (the paper).",
        flag_help="learned tables: fold the mean of the first N rows in",
        parse=int,
        presets={"pretrained": 128, LONG: 128},
        applies=lambda row, config: row.strategy == "absolute",
        refusal="position_mean applies to learned absolute position tables only; {model_type} has a {strategy!r} "
        "position path. Leave it 0.",
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
        presets={"pretrained": TimesOriginalLength(1.0), LONG: TimesOriginalLength(1.0)},
        applies=lambda row, config: row.strategy == "absolute" and row.bidirectional,  # encoders' tables only
        refusal="table_max_wavelength applies to encoders with a learned position table (bert, roberta); "
        "{model_type} is {kind}. Leave it None.",
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
    slopes_source: str | None = field(
        default=None,
        metadata={
            "help": "Where explicit slopes came from: 'fit_slopes' (measured per layer and head on text by the "
            "original, hf_alibi.fit_slopes / --fit-slopes), or None (given as they are, or none given)."
        },
    )

    def __post_init__(self):
        if self.encoder_variant is not None and self.encoder_variant not in ENCODER_VARIANTS:
            raise ValueError(
                f"encoder_variant must be one of {ENCODER_VARIANTS} (or None for decoder-only models), "
                f"got {self.encoder_variant!r}."
            )
        check_pretrained_options(
            self.heads, self.sinks, self.rotary_max_wavelength, self.slope_scale, self.slopes, self.architecture,
            self.position_mean, self.table_max_wavelength, self.table_rows, self.rotary_knee, self.rotary_stretch,
            self.rotary_interpolation, self.rotary_window, self.rotary_window_stretch,
        )  # fmt: skip
        if self.slopes_source not in (None, FITTED) or (self.slopes_source and self.slopes is None):
            raise ValueError(f"slopes_source must be None or {FITTED!r} (with slopes), got {self.slopes_source!r}.")
        if self.slopes is not None:  # JSON gives a list; kept as floats, fp32 is made from them per device
            object.__setattr__(self, "slopes", _as_floats(self.slopes))

    def slopes_in_use(self) -> list:
        """The slopes the converted model runs with: the explicit ``slopes`` (one per head, or a list per layer),
        else the paper's times ``slope_scale``.

        >>> AlibiSettings("gpt2", heads=2, slope_scale=0.5).slopes_in_use()
        [0.03125, 0.001953125]
        """
        from .slopes import scaled_slopes_list  # on use: slopes.py imports torch, which the CLI's parser must not load

        return scaled_slopes_list(self.heads, self.slope_scale, self.slopes)

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


def flag_spellings(name: str) -> tuple[str, ...]:
    """The command-line flags of a declared setting: ``--name-with-dashes``, also ``--name_with_underscores``.

    >>> flag_spellings("slope_scale"), flag_spellings("sinks")
    (('--slope-scale', '--slope_scale'), ('--sinks',))
    """
    dashed = "--" + name.replace("_", "-")
    return (dashed, "--" + name) if "_" in name else (dashed,)


def presets() -> dict[str, dict[str, Any]]:
    """The named presets of ``patch_model(preset=...)``, gathered from the options' declarations (each option's
    ``presets``): the one place to change when better values are measured (docs/measurements.md). ``"paper"`` is
    the paper's method, every option at its default (the same as no preset), so that every entry point that takes
    a preset takes the same names.

    >>> presets()["pretrained"]["sinks"], presets()["paper"]
    (1, {})
    """
    named: dict[str, dict[str, Any]] = {PAPER: {}}
    for option in conversion_options():
        for name, value in option.metadata["presets"].items():
            named.setdefault(name, {})[option.name] = value
    return named


PAPER = "paper"  # the preset that is the paper's method: every option at its default, as no preset


def preset_name(preset: str | None) -> str | None:
    """A preset's one spelling: ``None`` for the paper's method (``"paper"`` or no preset), else its name.

    >>> preset_name("paper"), preset_name(None), preset_name("pretrained")
    (None, None, 'pretrained')
    """
    return None if preset == PAPER else preset


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
    rotary_knee: float | None = None,
    rotary_stretch: float = 1.0,
    rotary_interpolation: float = 1.0,
    rotary_window: int | None = None,
    rotary_window_stretch: float = 1.0,
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
    if table_max_wavelength is not None:
        if not _is_number(table_max_wavelength) or table_max_wavelength < 2:
            raise ValueError(
                "table_max_wavelength must be a number >= 2 (a wavelength in tokens), or 0 / None to remove the "
                f"table, got {table_max_wavelength!r}."
            )
    if not isinstance(table_rows, int) or isinstance(table_rows, bool) or table_rows < 0:
        raise ValueError(f"table_rows must be an integer >= 0, got {table_rows!r}.")
    if rotary_max_wavelength is not None:
        if not _is_number(rotary_max_wavelength) or rotary_max_wavelength <= 0:
            raise ValueError(
                "rotary_max_wavelength must be a number > 0 (a wavelength in tokens) or None, "
                f"got {rotary_max_wavelength!r}."
            )
    if rotary_knee is not None and (not _is_number(rotary_knee) or rotary_knee < 1):
        raise ValueError(f"rotary_knee must be a number >= 1 (a position in tokens) or None, got {rotary_knee!r}.")
    if not _is_number(rotary_stretch) or rotary_stretch < 1:
        raise ValueError(f"rotary_stretch must be a finite number >= 1 (1: not slowed), got {rotary_stretch!r}.")
    if rotary_stretch != 1.0 and (rotary_knee is None or rotary_max_wavelength is None):
        raise ValueError(
            "rotary_stretch slows kept rotary frequencies past rotary_knee: give rotary_knee (e.g. the original "
            "length) and keep the rotary frequencies (rotary_max_wavelength), or leave rotary_stretch 1."
        )
    if not _is_number(rotary_interpolation) or rotary_interpolation < 1:
        raise ValueError(
            f"rotary_interpolation must be a finite number >= 1 (1: not interpolated), got {rotary_interpolation!r}."
        )
    if rotary_interpolation != 1.0 and (rotary_knee is None or rotary_max_wavelength is None):
        raise ValueError(
            "rotary_interpolation slows the kept rotary frequencies of wavelength > rotary_knee: give rotary_knee "
            "(e.g. the original length) and keep the rotary frequencies (rotary_max_wavelength), or leave "
            "rotary_interpolation 1."
        )
    if rotary_window is not None and (
        not isinstance(rotary_window, int) or isinstance(rotary_window, bool) or rotary_window < 1
    ):
        raise ValueError(
            f"rotary_window must be an integer >= 1 (a distance in tokens) or None, got {rotary_window!r}."
        )
    if not _is_number(rotary_window_stretch) or rotary_window_stretch < 1:
        raise ValueError(
            f"rotary_window_stretch must be a finite number >= 1 (1: not slowed), got {rotary_window_stretch!r}."
        )
    if rotary_window is not None:
        if rotary_knee is None or rotary_max_wavelength is None:
            raise ValueError(
                "rotary_window slows the kept rotary frequencies of wavelength > rotary_knee with distance: give "
                "rotary_knee (e.g. the original length) and keep the rotary frequencies (rotary_max_wavelength), "
                "or leave rotary_window None."
            )
        if rotary_stretch != 1.0 or rotary_interpolation != 1.0:
            raise ValueError(
                "rotary_window maps distances, rotary_stretch and rotary_interpolation positions: use one, "
                "e.g. rotary_stretch=1 with rotary_window (the preset's knee has rotary_stretch 2)."
            )
    elif rotary_window_stretch != 1.0:
        raise ValueError("rotary_window_stretch applies past rotary_window: give rotary_window too, or leave it 1.")
    if architecture is not None:  # where each option applies: its declaration's applies / refusal
        row = type("Row", (), {"bidirectional": False, **architecture})  # the row's fields as attributes
        given = dict(
            sinks=sinks, slope_scale=slope_scale, slopes=slopes, position_mean=position_mean,
            rotary_max_wavelength=rotary_max_wavelength, table_max_wavelength=table_max_wavelength,
            rotary_knee=rotary_knee, rotary_stretch=rotary_stretch, rotary_interpolation=rotary_interpolation,
            rotary_window=rotary_window, rotary_window_stretch=rotary_window_stretch,
        )  # fmt: skip
        for option in conversion_options():
            applies, refusal = option.metadata["applies"], option.metadata["refusal"]
            if refusal and given[option.name] != option.default and not applies(row, None):
                kind = "a decoder" if row.strategy == "absolute" else f"a {row.strategy!r} row"
                raise ValueError(refusal.format(model_type=row.model_type, strategy=row.strategy, kind=kind))
