"""``recover()``: convert a copy of the model and distil the original into it."""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer_callback import PrinterCallback

from ..convert.fit import fit_slopes
from ..convert.patch import ConversionPlan, patch_model, plan_conversion
from ..convert.positions import original_length, position_table
from ..core.config import get_settings
from ..core.names import is_alibi
from ..core.settings import FIT_TOKENS
from ..hub.compat import name_or_path
from ..train.distributed import (
    FSDP2_CONFIG,
    deepspeed_cpu_state,
    fsdp_on_cpu,
    launch_world,
    shard_for_inference,
    unsharded_copy,
)
from .blocks import NO_FRAME, Blocks, as_stream, frame_rows, frame_size, framed_blocks, mlm_collator, special_frame
from .kinds import CAUSAL_MODEL, ENCODER_MODEL, SEQ2SEQ_MODEL, model_kind
from .lengths import check_text_length, resolve_lengths
from .lora import add_lora, merge_lora
from .metrics import agreement, format_agreement
from .settings import RecoverySettings, check_settings, default_learning_rate, recovery_settings
from .trainer import DistillationTrainer


@dataclass
class RecoveryResult:
    """What :func:`recover` returns: the recovered ``student`` (a converted model, eval mode), the
    agreement ``history`` (one dict per evaluation: ``step``, ``tokens`` and :func:`agreement`'s figures)
    and ``info`` (the settings and totals the model card reports)."""

    student: PreTrainedModel
    history: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}

    @property
    def final_line(self) -> str:
        """The last agreement figures as one line (:func:`format_agreement`)."""
        return format_agreement(self.final)


class _AgreementCallback(TrainerCallback):
    def __init__(self, evaluate: Callable[[int], None], every: int):
        self.evaluate, self.every = evaluate, every

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            self.evaluate(state.global_step)


def recover(
    model: PreTrainedModel,
    texts: Sequence[str] | torch.Tensor,
    tokenizer=None,
    settings: RecoverySettings | None = None,
    *,
    eval_texts: Sequence[str] | torch.Tensor | None = None,
    log: Callable[[str], None] | None = print,
    plan: ConversionPlan | None = None,
    **overrides: Any,
) -> RecoveryResult:
    """Convert a copy of ``model`` to ALiBi and distil ``model`` into it on ``texts``.

    Args:
        model: the original (unconverted) model of a registered architecture; it is the teacher and is
            never changed (its weights get no gradients).
        texts: the user's unlabeled text (a list of strings; needs ``tokenizer``), or a 1-d tensor of
            token ids. Cut into blocks of ``length`` tokens; the last ``eval_fraction`` of the tokens
            (or ``eval_texts``) is held out for the agreement figures. For encoders and encoder-decoders
            each block (and each input of the agreement figures) carries the special tokens ``tokenizer``
            adds to a text (``[CLS] ... [SEP]``: :func:`~hf_alibi.recover.blocks.special_frame`), as the model
            reads its inputs; causal LMs read the stream as it is.
        settings: every setting of the recovery, a :class:`~hf_alibi.recover.RecoverySettings` (default: its
            defaults); each field's help there (``length``, ``max_steps``, ``learning_rate``, ``preset``,
            ``fit_slopes``, ``lora_rank``, the levers, the agreement lengths, the Trainer's checkpoints, and the
            conversion options ``sinks``, ``slope_scale``, ...: :func:`hf_alibi.patch_model`'s).
        eval_texts: held-out text for the agreement figures (default: the end of ``texts``).
        log: where the agreement lines go (None: nowhere).
        plan: the conversion already planned from ``settings`` and the teacher's config
            (:func:`hf_alibi.convert.patch.plan_conversion`: :func:`hf_alibi.recover.recover_checkpoint` plans it
            before the teacher loads); default: planned here.
        **overrides: settings by name, over ``settings`` (``recover(model, texts, tokenizer, max_steps=300)``);
            an unknown name is a ``TypeError`` that lists the known ones.

    Returns:
        :class:`RecoveryResult`; ``result.student.save_pretrained(folder)`` writes a normal converted
        checkpoint (use :func:`write_recovery_card` to add how it was recovered to its card).

    Raises:
        ValueError: an ALiBi ``model`` (pass the original), no text, text too short for one training window,
            or bad settings; raised before any training.

    Example:
        >>> settings = RecoverySettings(max_steps=300, lora_rank=16)
        >>> result = recover(AutoModelForCausalLM.from_pretrained("my-gpt2"), texts, tokenizer, settings)
        >>> result.final["ppl"], result.final["ppl_8x"]
    """
    # 1. every check, before any work (the one place: _check)
    settings = recovery_settings(settings, **overrides)  # each field's own check
    original, kind, plan = _check(model, settings, plan)
    preset = settings.preset  # None: the paper's method
    learning_rate = settings.learning_rate
    if learning_rate is None:
        learning_rate = default_learning_rate(kind, preset, settings.lora_rank)
    try:
        lengths = resolve_lengths(original, settings.length, settings.eval_factors, settings.max_eval_length)
    except ValueError as error:
        raise ValueError(f"{model.config.model_type}: {error}") from None
    length, eval_factors = lengths.length, lengths.factors
    max_steps, batch_size = settings.max_steps, settings.batch_size
    say = log or (lambda _: None)
    for note in lengths.notes:
        _write(f"[recover] {note}", say)
    # 2. the text: training blocks and the held-out stream
    # An encoder reads its special tokens around every input ([CLS] ... [SEP]): so do its blocks. A causal LM
    # reads a stream, as it was trained.
    frame = special_frame(tokenizer) if kind != CAUSAL_MODEL else NO_FRAME
    train_stream, blocks, eval_stream = _split_text(
        texts, tokenizer, eval_texts, settings.eval_fraction, settings.max_eval_tokens, length, frame
    )
    # 3. the student: a converted copy (slopes fitted by the teacher, where asked)
    teacher = model
    slopes = _fitted_slopes(teacher, train_stream, frame, preset, settings.fit_slopes, plan)
    student = copy.deepcopy(teacher).requires_grad_(True)
    patch_model(student, plan=plan if slopes is None else plan.with_slopes(slopes))  # none fitted: the options'
    trained = add_lora(student, settings.lora_rank) if settings.lora_rank else student
    # 4. distil, with the agreement at the start, every eval_every steps and at the end
    history: list[dict[str, Any]] = []
    processes = launch_world()  # several processes (DDP): each takes batch_size blocks a step
    tokens_per_step = processes * batch_size * length

    def evaluate(step: int) -> None:
        # ZeRO-3 and FSDP2: on a gathered copy (every rank; a forward of the partitioned student outside the
        # engine's step left its prefetching out of order: the next training step hung)
        student_now = unsharded_copy(trained)  # the model itself when it is neither
        figures = agreement(student_now, teacher, eval_stream, length, eval_factors, kind, frame)
        history.append({"step": step, "tokens": step * tokens_per_step, **figures})
        line = f"[recover] step {step}/{max_steps} ({step * tokens_per_step} tokens): {format_agreement(figures)}"
        _write(line, say)

    teacher_state = (teacher.training, [p.requires_grad for p in teacher.parameters()])
    teacher.eval()
    evaluate(0)
    trainer, scratch = _trainer(trained, teacher, blocks, tokenizer, kind, evaluate, settings, learning_rate)
    if settings.shard_teacher and launch_world() > 1:  # FSDP2 over the Trainer's process group, in place
        shard_for_inference(teacher)
    start = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=settings.resume_from_checkpoint)
    finally:
        if scratch is not None:
            scratch.cleanup()
        teacher.train(teacher_state[0])
        for parameter, flag in zip(teacher.parameters(), teacher_state[1]):  # the trainer froze it; give it back
            parameter.requires_grad_(flag)
    seconds = time.perf_counter() - start
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    evaluate(max_steps)
    # the whole student on every rank (ZeRO-3: its partitions gathered, a collective; else itself), then LoRA merged
    student = merge_lora(unsharded_copy(trained)).eval()
    # 5. what was done, for the card and recovery.json
    info = {
        "teacher": name_or_path(teacher.config) or type(teacher).__name__,
        "kind": kind,
        "loss": _loss_name(kind, settings.hidden_layers, settings.lm_weight, settings.temperature),
        "steps": max_steps,
        "batch_size": batch_size,
        "processes": processes,
        "teacher_sharded": bool(settings.shard_teacher and processes > 1),
        "length": length,
        "tokens": max_steps * tokens_per_step,
        "train_tokens_available": int(len(blocks) * length),
        "special_tokens_per_block": frame_size(frame),
        "epochs": round(max_steps * processes * batch_size / len(blocks), 3),
        "learning_rate": learning_rate,
        "preset": preset or "paper",
        "slopes": _slopes_note(slopes, preset),
        "lora_rank": settings.lora_rank,
        "eval_lengths": [f * length for f in eval_factors],
        "warm_start_steps": settings.warm_start_steps,
        "attention_only_steps": settings.attention_only_steps,
        "encoder_variant": get_settings(student.config).encoder_variant,
        "eval_tokens": int(eval_stream.numel()),
        "train_seconds": round(seconds, 1),
    }
    return RecoveryResult(student=student, history=history, info=info)


def _check(model, settings: RecoverySettings, plan: ConversionPlan | None) -> tuple[int | None, str, ConversionPlan]:
    """Every check of :func:`recover`'s arguments past each setting's own (:class:`RecoverySettings`), before any
    work: one-line ``ValueError`` (``TypeError`` for a model that is no transformers model). Returns the original
    length, the model's kind and the conversion's plan (``plan``, else planned from the settings)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"recover expects a transformers PreTrainedModel, got {type(model).__name__}.")
    if is_alibi(model):
        raise ValueError(
            "recover needs the original model (the teacher), but this one is already ALiBi: pass the checkpoint "
            "it was converted from."
        )
    original = original_length(model)
    check_settings(original, settings)  # those that need the teacher's length, or several settings at once
    if plan is None:
        options = {"preset": settings.preset, **settings.conversion_options()}
        plan = plan_conversion(model.config, settings.heads, settings.encoder_variant, **options)
    if settings.warm_start_steps and position_table(model) is None:
        raise ValueError(
            f"warm_start_steps needs a learned position table; {model.config.model_type} has none "
            "(rotary or relative positions). Use warm_start_steps=0."
        )
    return original, model_kind(model), plan


def _split_text(texts, tokenizer, eval_texts, eval_fraction, max_eval_tokens, length, frame):
    """The training stream, its blocks of ``length`` tokens (``frame`` around each) and the held-out stream
    (``eval_texts``, else the last ``eval_fraction`` of the text); :func:`check_text_length` on them."""
    stream = as_stream(texts, tokenizer, "texts")
    if eval_texts is not None:
        train_stream, eval_stream = stream, as_stream(eval_texts, tokenizer, "eval_texts")
    else:
        held = max(int(stream.numel() * eval_fraction), length + 1)
        train_stream, eval_stream = stream[:-held], stream[-held:]
    eval_stream = eval_stream[: max_eval_tokens + 1]
    blocks = framed_blocks(train_stream, length, frame)
    check_text_length(stream.numel(), length, enough=len(blocks) >= 1 and eval_stream.numel() > length)
    return train_stream, blocks, eval_stream


def _trainer(trained, teacher, blocks, tokenizer, kind, evaluate, settings: RecoverySettings, learning_rate: float):
    """The Trainer that distils ``teacher`` into ``trained`` with ``settings`` (``learning_rate``: theirs, or the
    default for this model), and the temporary folder it writes to when ``settings.output_dir`` is None (else None):
    the caller removes it."""
    lm_weight, max_steps, output_dir = settings.lm_weight, settings.max_steps, settings.output_dir
    labels = lm_weight > 0 and kind != ENCODER_MODEL
    collator = mlm_collator(tokenizer) if lm_weight > 0 and kind == ENCODER_MODEL else default_data_collator
    scratch = tempfile.TemporaryDirectory(prefix="hf_alibi_recover_") if output_dir is None else None
    extra = {}
    if settings.deepspeed:  # the student partitioned; on CPUs accelerate's state made for DeepSpeed on gloo first
        extra = {"deepspeed": settings.deepspeed}
        if deepspeed_cpu_state():
            extra["accelerator_config"] = {"use_configured_state": True}
    elif settings.fsdp:  # the student sharded (FSDP2); on CPUs made FSDP over gloo once the Trainer is (fsdp_on_cpu)
        extra = {"fsdp": "full_shard", "fsdp_config": FSDP2_CONFIG}
    args = TrainingArguments(
        output_dir=output_dir or scratch.name,
        max_steps=max_steps,
        per_device_train_batch_size=settings.batch_size,
        learning_rate=learning_rate,
        warmup_steps=max(1, max_steps // 20) if settings.warmup_steps is None else settings.warmup_steps,
        lr_scheduler_type="cosine",
        weight_decay=settings.weight_decay,
        max_grad_norm=1.0,
        logging_steps=max(1, max_steps // 10),
        save_strategy="steps" if settings.save_steps else "no",
        save_steps=settings.save_steps or 500,
        report_to="none",
        seed=settings.seed,
        disable_tqdm=not settings.progress,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available() and not settings.deepspeed,
        dataloader_num_workers=0,
        **extra,
    )
    every = max_steps // 4 if settings.eval_every is None else settings.eval_every
    trainer = DistillationTrainer(
        model=trained, args=args, train_dataset=Blocks(blocks, labels), data_collator=collator, teacher=teacher,
        kind=kind, callbacks=[_AgreementCallback(evaluate, every)], **settings.distillation_arguments(),
    )  # fmt: skip
    if not settings.progress:
        trainer.remove_callback(PrinterCallback)
    fsdp_on_cpu(trainer)
    return trainer, scratch


def _fitted_slopes(teacher, stream, frame, preset, fit, plan: ConversionPlan) -> list[list[float]] | None:
    """The teacher's fitted slopes for the conversion (:func:`hf_alibi.fit_slopes`), or None (the options' or the
    preset's)."""
    given = [name for name in ("slopes", "slope_scale") if plan.given.get(name) is not None]
    if fit is None:  # by default where it can (fit_slopes refuses encoder-decoders itself when asked)
        fit = preset is not None and not given and not getattr(teacher.config, "is_encoder_decoder", False)
    if not fit:  # an explicit fit with slopes given, or without a preset, was refused by check_settings
        return None
    length = min(original_length(teacher) or FIT_TOKENS, FIT_TOKENS)
    text = stream[: length - frame_size(frame)]  # all of it when the stream is shorter
    return fit_slopes(teacher, frame_rows(text[None], frame), sinks=plan.settings.sinks)


def _slopes_note(slopes, preset: str | None) -> str:
    if slopes is not None:
        return "fitted per layer and head (hf_alibi.fit_slopes)"
    return "the paper's" if preset is None else f"the {preset} preset's uniform scale"


def _loss_name(kind: str, hidden_layers: str, lm_weight: float, temperature: float) -> str:
    if kind == CAUSAL_MODEL:
        name = f"KL(teacher ‖ student) of next-token distributions (temperature {temperature:g})"
    else:
        layers = "last layer" if hidden_layers == "last" else "every layer"
        name = f"MSE of hidden states ({layers})" + (" + KL of decoder logits" if kind == SEQ2SEQ_MODEL else "")
    if lm_weight:
        name += f", mixed with the {'MLM' if kind == ENCODER_MODEL else 'LM'} loss (weight {lm_weight:g})"
    return name


def _write(line: str, say: Callable[[str], None]) -> None:
    if say is print:
        try:
            from tqdm.auto import tqdm

            tqdm.write(line)
            return
        except ImportError:
            pass
    say(line)
