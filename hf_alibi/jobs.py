"""The checkpoint jobs: a folder or Hub id in, a converted checkpoint folder out (what the CLI runs).

:func:`recover_checkpoint` (``hf-alibi recover``) loads the original, distils it into a converted copy
(:func:`hf_alibi.recover.recover`) and writes the result. Every input is checked before anything loads;
OUT is written in a staging folder beside it and renamed at the end; bad input is a
:class:`hf_alibi.checkpoints.CheckpointError`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from .checkpoints import (
    CheckpointError,
    check_output,
    has_tokenizer,
    is_alibi,
    model_class_for,
    read_config,
    staged_output,
)
from .hub.folder import write_converted
from .positions import original_length


def recover_checkpoint(
    src: str,
    out: str | os.PathLike,
    train_file: str | os.PathLike,
    *,
    validation_file: str | os.PathLike | None = None,
    overwrite: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    **settings: Any,
):
    """What ``hf-alibi recover SRC OUT --train_file F`` does: load the original checkpoint ``src``, convert
    a copy, distil (:func:`hf_alibi.recover.recover`, ``settings`` are its keyword arguments), and write ``out`` as a
    normal converted checkpoint (weights, config with the ALiBi settings, remote code, tokenizer) whose
    model card says how it was recovered, plus ``recovery.json`` (settings and agreement history).
    With ``save_steps`` the Trainer's checkpoints go to ``checkpoint_dir`` (default ``OUT.checkpoints``, kept
    after the run); ``resume_from_checkpoint`` (a ``checkpoint-N`` folder, or a folder holding them: the
    last) continues an interrupted run.

    Every input is checked before training, and ``out`` is written into a staging folder next to it and
    renamed at the end: a failure leaves no half-written ``out``. Raises
    :class:`hf_alibi.checkpoints.CheckpointError` (a ``ValueError``) for bad input, before anything is
    loaded or trained: OUT is checked and its staging folder made first.

    Example:
        >>> recover_checkpoint("my-gpt2", "gpt2-alibi", "notes.txt", max_steps=300)
    """
    # on use: hf_alibi.recover loads transformers' Trainer, which the other jobs do not need
    from .recover.api import recover
    from .recover.blocks import read_texts, token_stream
    from .recover.settings import check_settings, resolve_lengths
    from .recover.summary import recovery_card_section

    out = Path(out)
    check_output(src, out, overwrite)
    config_dict = read_config(src)
    if is_alibi(config_dict):
        raise CheckpointError(
            f"SRC {src!r} is already an ALiBi checkpoint (model_type {config_dict['model_type']!r}); recover needs "
            "the original checkpoint it was converted from (the teacher)."
        )
    original = original_length(config_dict)
    try:  # every setting, before the tokenizer or the model loads: the teacher's limit is in config.json
        check_settings(original, **settings)
        lengths = resolve_lengths(original, settings.get("length"), max_eval_length=settings.get("max_eval_length"))
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    resume = settings.get("resume_from_checkpoint")
    if resume is not None:
        settings["resume_from_checkpoint"] = _checkpoint_to_resume(resume)
    if settings.get("save_steps") or resume is not None:
        settings["output_dir"] = str(checkpoint_dir or out.with_name(out.name + ".checkpoints"))
    model_cls = model_class_for(config_dict)
    texts = read_texts(train_file)
    eval_texts = read_texts(validation_file) if validation_file is not None else None
    if has_tokenizer(src) is False:
        raise CheckpointError(
            f"SRC {src!r} has no tokenizer files; recover needs the model's tokenizer to read the text."
        )
    with staged_output(out) as staging:  # made first: a place that cannot be written fails before training
        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(f"Could not load the tokenizer of SRC {src!r}: {error}") from error
        stream = token_stream(texts, tokenizer)
        eval_stream = token_stream(eval_texts, tokenizer) if eval_texts is not None else None
        length = lengths.length
        if eval_stream is None:
            too_short = length and stream.numel() < 2 * length + 1
        else:
            too_short = length and (stream.numel() < length or eval_stream.numel() < length + 1)
        if too_short:
            raise CheckpointError(
                f"The text is too short: {stream.numel()} tokens, but recovering at length {length} needs at least "
                f"one training window of {length} tokens and a held-out slice of {length + 1}. "
                "Pass more text, or --length."
            )
        try:
            teacher = model_cls.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(
                f"Could not load the model from SRC {src!r} as {model_cls.__name__}: {error}"
            ) from error
        try:
            result = recover(teacher, stream, tokenizer, eval_texts=eval_stream, **settings)
        except CheckpointError:
            raise
        except ValueError as error:
            raise CheckpointError(str(error)) from error
        result.info["teacher"] = src

        # as hf-alibi convert (SRC's companions kept), the card with how it was recovered
        write_converted(staging, result.student, src, tokenizer, recovery=recovery_card_section(result))
        (staging / "recovery.json").write_text(
            json.dumps({"info": result.info, "history": result.history}, indent=2, default=str) + "\n"
        )
    return out, result


def _checkpoint_to_resume(path: str | os.PathLike) -> str:
    """A Trainer checkpoint folder (``checkpoint-N``), or the last one in a folder of them; else an error."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(path).expanduser()
    if (folder / "trainer_state.json").is_file():
        return str(folder)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        raise CheckpointError(
            f"--resume_from_checkpoint {str(path)!r} is neither a Trainer checkpoint (checkpoint-N with "
            "trainer_state.json) nor a folder holding one. Pass the folder --save_steps wrote to."
        )
    return last
