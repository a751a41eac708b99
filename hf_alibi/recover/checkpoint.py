"""``hf-alibi recover`` as a library function: the original checkpoint (a folder or Hub id) in, a converted copy
distilled from it (:func:`hf_alibi.recover.recover`) written as a converted checkpoint folder out
(:func:`recover_checkpoint`); every input checked before anything loads, bad input a
:class:`hf_alibi.hub.checkpoints.CheckpointError`.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer

from ..convert.checkpoint import plan_source
from ..convert.positions import original_length
from ..hub.checkpoints import CheckpointError, check_output, is_alibi, open_source, staged_output
from ..hub.folder import write_converted

if TYPE_CHECKING:
    from .settings import RecoverySettings


def recover_checkpoint(
    src: str,
    out: str | os.PathLike,
    train_file: str | os.PathLike,
    *,
    validation_file: str | os.PathLike | None = None,
    overwrite: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    settings: RecoverySettings | None = None,
    **overrides: Any,
):
    """What ``hf-alibi recover SRC OUT --train_file F`` does: load the original checkpoint ``src``, convert
    a copy, distil (:func:`hf_alibi.recover.recover` with ``settings``, a :class:`~hf_alibi.recover.RecoverySettings`,
    and ``overrides``, settings by name over it), and write ``out`` as a
    normal converted checkpoint (weights, config with the ALiBi settings, remote code, tokenizer) whose
    model card says how it was recovered, plus ``recovery.json`` (settings and agreement history).
    With ``save_steps`` the Trainer's checkpoints go to ``checkpoint_dir`` (default ``OUT.checkpoints``, kept
    after the run); ``resume_from_checkpoint`` (a ``checkpoint-N`` folder, or a folder holding them: the
    last) continues an interrupted run.

    Every input is checked before training, and ``out`` is written into a staging folder next to it and
    renamed at the end: a failure leaves no half-written ``out``. Raises
    :class:`hf_alibi.hub.checkpoints.CheckpointError` (a ``ValueError``) for bad input, before anything is
    loaded or trained: OUT is checked and its staging folder made first.

    Example:
        >>> recover_checkpoint("my-gpt2", "gpt2-alibi", "notes.txt", settings=RecoverySettings(max_steps=300))
    """
    # on use: hf_alibi.recover loads transformers' Trainer, which the other jobs do not need
    from ..train.distributed import check_launch, close_process_group, launch_rank
    from .api import recover
    from .blocks import read_texts, token_stream
    from .lengths import check_text_length, resolve_lengths
    from .settings import check_settings, recovery_settings
    from .summary import recovery_card_section

    out = Path(out)
    check_output(src, out, overwrite)
    source = open_source(src)  # resolved once, carried to the last write
    config_dict = source.config
    if is_alibi(config_dict):
        raise CheckpointError(
            f"SRC {src!r} is already an ALiBi checkpoint (model_type {config_dict['model_type']!r}); recover needs "
            "the original checkpoint it was converted from (the teacher)."
        )
    original = original_length(config_dict)
    try:  # every setting, before the tokenizer or the model loads: the teacher's limit is in config.json
        settings = recovery_settings(settings, **overrides)
        if settings.save_steps or settings.resume_from_checkpoint is not None:  # the Trainer's checkpoints go there
            settings = replace(settings, output_dir=str(checkpoint_dir or out.with_name(out.name + ".checkpoints")))
        check_settings(original, settings)
        lengths = resolve_lengths(original, settings.length, max_eval_length=settings.max_eval_length)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    # the conversion's checks too, before anything loads; recover() converts the teacher with this plan
    plan = plan_source(
        source, settings.heads, settings.encoder_variant, settings.preset, settings.conversion_options()
    )
    if settings.resume_from_checkpoint is not None:
        settings = replace(settings, resume_from_checkpoint=_checkpoint_to_resume(settings.resume_from_checkpoint))
    model_cls = source.model_class()
    texts = read_texts(train_file)
    eval_texts = read_texts(validation_file) if validation_file is not None else None
    if source.has_tokenizer() is False:
        raise CheckpointError(
            f"SRC {src!r} has no tokenizer files; recover needs the model's tokenizer to read the text."
        )
    try:  # one process, or several with DDP (torchrun); a sharded launch refused before anything loads
        check_launch(settings.deepspeed, settings.fsdp)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    main = launch_rank() == 0  # several processes: rank 0 alone stages and writes OUT, the others train with it
    with staged_output(out) if main else nullcontext() as staging:  # made first: an OUT that cannot be written fails
        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(f"Could not load the tokenizer of SRC {src!r}: {error}") from error
        stream = token_stream(texts, tokenizer)
        eval_stream = token_stream(eval_texts, tokenizer) if eval_texts is not None else None
        length = lengths.length
        if eval_stream is None:
            enough = stream.numel() >= 2 * length + 1
        else:
            enough = stream.numel() >= length and eval_stream.numel() >= length + 1
        try:  # before the model loads (recover() checks the split it makes with the same function)
            check_text_length(stream.numel(), length, enough or not length)
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        try:
            teacher = model_cls.from_pretrained(src)
        except Exception as error:
            raise CheckpointError(
                f"Could not load the model from SRC {src!r} as {model_cls.__name__}: {error}"
            ) from error
        try:
            result = recover(teacher, stream, tokenizer, settings, eval_texts=eval_stream, plan=plan)
        except CheckpointError:
            raise
        except ValueError as error:
            raise CheckpointError(str(error)) from error
        result.info["teacher"] = src

        # as hf-alibi convert (SRC's companions kept), the card with how it was recovered
        if main:
            write_converted(staging, result.student, source, tokenizer, recovery=recovery_card_section(result))
            (staging / "recovery.json").write_text(
                json.dumps({"info": result.info, "history": result.history}, indent=2, default=str) + "\n"
            )
    close_process_group()  # every rank waits for OUT, then the process group closes cleanly
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
