"""``hf-alibi convert`` as a library function: a checkpoint folder or Hub id in, a converted checkpoint folder out
(:func:`convert_checkpoint`), every input checked before anything loads, OUT written in a staging folder beside it
and renamed at the end; bad input is a :class:`hf_alibi.hub.checkpoints.CheckpointError`. :func:`plan_source` (the
conversion of SRC planned from its config.json) is recovery's too (:func:`hf_alibi.recover.recover_checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from ..core.settings import FIT_TOKENS
from ..hub.checkpoints import CheckpointError, Source, check_output, open_source, staged_output
from ..hub.folder import write_converted
from .fit import fit_slopes
from .patch import ConversionPlan, patch_model, plan_conversion, takes_options
from .planning import check_fit_slopes, original_length


@takes_options
def convert_checkpoint(
    src: str,
    out: str | os.PathLike,
    heads: int | None = None,
    encoder_variant: str | None = None,
    overwrite: bool = False,
    fit_file: str | os.PathLike | None = None,
    fit_scale: float | None = None,
    fit_tokens: int = FIT_TOKENS,
    preset: str | None = None,
    **options,
) -> Path:
    """Convert the checkpoint ``src`` to ALiBi into the folder ``out`` (what ``hf-alibi convert`` does).

    ``preset`` and the conversion ``options`` are :func:`hf_alibi.patch_model`'s. Every argument is checked
    before the model is loaded; bad input is a :class:`CheckpointError`. The folder is written next to ``out``
    first and moved in place at the end, so a failure leaves no half-written ``out`` (and with ``overwrite`` the old
    one stays until the new one is complete).
    It holds SRC's companion files (:func:`hf_alibi.hub.write_converted`).

    ``fit_file``: a text file; the slopes are fitted per layer and head on its first ``fit_tokens`` tokens (at most
    the original length) by the original (:func:`hf_alibi.fit_slopes`, ``scale`` ``fit_scale``) and given to
    ``patch_model`` as ``slopes``.

    >>> convert_checkpoint("my-gpt2", "gpt2-alibi", preset="pretrained")  # doctest: +SKIP
    """

    out = Path(out)
    check_output(src, out, overwrite)
    source = open_source(src)  # resolved once, carried to the last write
    model_cls = source.model_class()
    plan = plan_source(source, heads, encoder_variant, preset, options)
    text = fit_text(fit_file, fit_scale, fit_tokens, options)
    src_has_tokenizer = source.has_tokenizer()
    if text is not None and src_has_tokenizer is False:
        raise CheckpointError(f"--fit-slopes tokenizes the text with SRC's tokenizer, but SRC {src!r} has none.")
    with staged_output(out) as staging:  # made first: a place that cannot be written fails before loading
        try:
            model = model_cls.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(
                f"Could not load the model from SRC {src!r} as {model_cls.__name__}: {error}"
            ) from error
        tokenizer = None
        if src_has_tokenizer is not False:
            try:
                tokenizer = AutoTokenizer.from_pretrained(src)
            except Exception as error:
                if src_has_tokenizer or text is not None:
                    raise CheckpointError(
                        f"SRC {src!r} has tokenizer files that could not be loaded: {error}"
                    ) from error
        if text is not None:
            longest = min(fit_tokens, original_length(model.config) or fit_tokens)  # fitted inside its length
            ids = tokenizer(text, truncation=True, max_length=longest, return_tensors="pt")["input_ids"]
            try:
                scale = {} if fit_scale is None else {"scale": fit_scale}
                plan = plan.with_slopes(fit_slopes(model, ids, sinks=plan.settings.sinks, **scale))
            except ValueError as error:
                raise CheckpointError(str(error)) from error
        try:
            patch_model(model, plan=plan)
        except ValueError as error:
            raise CheckpointError(str(error)) from error
        write_converted(staging, model, source, tokenizer)
    return out


def plan_source(source: Source, heads, encoder_variant, preset, options: dict) -> ConversionPlan:
    """The conversion of SRC (:func:`hf_alibi.convert.patch.plan_conversion` on its config), planned before anything
    loads; a :class:`CheckpointError` for a config transformers cannot build or a bad option."""
    try:
        config = AutoConfig.for_model(**source.config)
    except Exception as error:
        raise CheckpointError(
            f"SRC {source.name!r} has a config.json transformers cannot build a config from: {error}"
        ) from error
    try:
        return plan_conversion(config, heads, encoder_variant, preset=preset, **options)
    except ValueError as error:
        raise CheckpointError(str(error)) from error


def fit_text(fit_file, fit_scale, fit_tokens: int, options: dict) -> str | None:
    """The text of ``--fit-slopes`` (None without it), every flag checked before anything loads."""
    if fit_file is None:
        if fit_scale is not None:
            raise CheckpointError(
                "--fit-scale applies to --fit-slopes only: pass --fit-slopes --fit-text TEXT_FILE too."
            )
        return None
    try:
        check_fit_slopes(True, options)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    if fit_scale is not None and not fit_scale > 0:
        raise CheckpointError(
            f"--fit-scale must be > 0 (the slope of a head is C / its mean distance), got {fit_scale}."
        )
    if fit_tokens < 2:
        raise CheckpointError(f"--fit-tokens must be at least 2, got {fit_tokens}.")
    path = Path(fit_file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"--fit-text {str(path)!r} could not be read as UTF-8 text ({error}).") from error
    if not text.strip():
        raise CheckpointError(f"--fit-text {str(path)!r} holds no text. Pass text like the model's inputs.")
    return text
