"""Recover a converted checkpoint by self-distillation from the original.

``patch_model`` removes a pretrained model's position path; the converted model has lost what it knew
about order until it is trained again. Here the original model is the teacher and the converted copy
the student, on the user's own unlabeled text at the original (short) length: the student learns to
give the teacher's outputs without position embeddings, then runs far past the original maximum.

Losses (:func:`distillation_loss`):

- causal LMs: ``KL(teacher || student)`` of the next-token distributions, per token, mean over tokens
  (with a temperature ``T``: both softened by ``T``, the KL scaled by ``T**2``);
- encoders (and causal models without an LM head): mean squared error of the hidden states, per token
  and feature, on the last layer (``hidden_layers="last"``) or the mean over every layer's output
  (``"all"``);
- seq2seq (T5): the KL of the decoder's logits (decoder input = the text, shifted) plus the encoder's
  hidden-state loss;
- optionally mixed with the ordinary LM / MLM loss: ``(1 - lm_weight) * distill + lm_weight * lm``.

Levers (off by default; measured in benchmarks/recover.py, see README):
``warm_start_steps`` keeps the original learned position table (a frozen copy) added to the student's
input embeddings, faded linearly to zero over the first steps while ALiBi is on;
``attention_only_steps`` trains only the attention weights during the first steps.

Example:
    >>> from hf_alibi.recover import recover
    >>> result = recover(original_model, texts, tokenizer, max_steps=200)   # original_model is not changed
    >>> result.student.save_pretrained("recovered")                         # a normal converted checkpoint
    >>> result.history[-1]                                                  # agreement at 1x, 2x, 4x, 8x
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments, default_data_collator

import hf_alibi

from .evaluation import evaluate_perplexity

CAUSAL, ENCODER, SEQ2SEQ = "causal", "encoder", "seq2seq"
KINDS = (CAUSAL, ENCODER, SEQ2SEQ)
HIDDEN_LAYERS = ("last", "all")
POSITION_TABLES = ("wpe", "position_embeddings")


# ----------------------------------------------------------------------------------------------------------------
# What kind of model, and its original length


def model_kind(model: PreTrainedModel) -> str:
    """``"causal"`` (decoder-only, or BERT with ``is_decoder``), ``"encoder"`` or ``"seq2seq"``.

    >>> model_kind(GPT2LMHeadModel(GPT2Config()))
    'causal'
    """
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return SEQ2SEQ
    base_type = hf_alibi.get_settings(config).base_model_type if hf_alibi.is_alibi_model(model) else config.model_type
    if hf_alibi.get_architecture(base_type).bidirectional and not getattr(config, "is_decoder", False):
        return ENCODER
    return CAUSAL


def _position_table(model: nn.Module) -> tuple[nn.Embedding, int] | None:
    """The learned absolute position table of ``model`` and the index of position 0 in it, or None."""
    base = getattr(model, "base_model", model)
    for name, module in base.named_modules():
        if name.split(".")[-1] in POSITION_TABLES and isinstance(module, nn.Embedding):
            offset = 0
            if getattr(model.config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
                offset = (model.config.pad_token_id or 0) + 1  # RoBERTa counts positions from padding_idx + 1
            return module, offset
    return None


def original_length(model: PreTrainedModel) -> int | None:
    """The longest input the original model was built for: its position table's size (GPT-2
    ``n_positions``, BERT ``max_position_embeddings``, RoBERTa's less its offset), else the config's
    ``max_position_embeddings`` (rotary models), else None (T5: pass ``length``).

    >>> original_length(GPT2LMHeadModel(GPT2Config(n_positions=128)))
    128
    """
    table = _position_table(model)
    if table is not None:
        return table[0].num_embeddings - table[1]
    value = getattr(model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


# ----------------------------------------------------------------------------------------------------------------
# Losses


def _last_hidden(outputs, kind: str) -> torch.Tensor:
    if kind == SEQ2SEQ:
        return outputs.encoder_last_hidden_state
    return outputs.hidden_states[-1]


def _hidden_list(outputs, kind: str, hidden_layers: str) -> list[torch.Tensor]:
    if hidden_layers == "last":
        return [_last_hidden(outputs, kind)]
    states = outputs.encoder_hidden_states if kind == SEQ2SEQ else outputs.hidden_states
    return list(states[1:])  # every layer's output (states[0] is the embeddings)


def _token_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` (B, L) over the tokens where ``mask`` (B, L) is 1."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def kl_next_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``KL(teacher || student)`` of the next-token distributions, per token, mean over the tokens
    ``attention_mask`` keeps; softened by ``temperature`` and scaled by its square. Computed in fp32.

    >>> kl_next_token(torch.zeros(1, 3, 5), torch.zeros(1, 3, 5)).item()
    0.0
    """
    t = float(temperature)
    log_p_teacher = F.log_softmax(teacher_logits.float() / t, dim=-1)
    log_p_student = F.log_softmax(student_logits.float() / t, dim=-1)
    per_token = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1)
    return _token_mean(per_token, attention_mask) * t * t


def hidden_state_mse(
    student_states: Sequence[torch.Tensor],
    teacher_states: Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error of hidden states (B, L, D), mean over features, tokens ``attention_mask``
    keeps, and the layers given. Computed in fp32.

    >>> hidden_state_mse([torch.ones(1, 2, 4)], [torch.zeros(1, 2, 4)]).item()
    1.0
    """
    if len(student_states) != len(teacher_states) or not student_states:
        raise ValueError(
            f"hidden_state_mse needs as many student as teacher layers (>= 1), got "
            f"{len(student_states)} and {len(teacher_states)}."
        )
    losses = [
        _token_mean((s.float() - t.float()).pow(2).mean(-1), attention_mask)
        for s, t in zip(student_states, teacher_states)
    ]
    return torch.stack(losses).mean()


def distillation_loss(
    student_outputs,
    teacher_outputs,
    kind: str,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    hidden_layers: str = "last",
) -> torch.Tensor:
    """The distillation loss of one batch (see the module docstring). The outputs need ``logits``
    (causal, seq2seq) or ``hidden_states`` (encoders; run both with ``output_hidden_states=True``).

    >>> with torch.no_grad():
    ...     t = teacher(input_ids=ids, output_hidden_states=True)
    >>> distillation_loss(student(input_ids=ids, output_hidden_states=True), t, "encoder").backward()
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    if hidden_layers not in HIDDEN_LAYERS:
        raise ValueError(f"hidden_layers must be one of {HIDDEN_LAYERS}, got {hidden_layers!r}.")
    student_logits = getattr(student_outputs, "logits", None)
    if kind == CAUSAL and student_logits is not None:
        return kl_next_token(student_logits, teacher_outputs.logits, attention_mask, temperature)
    hidden = hidden_state_mse(
        _hidden_list(student_outputs, kind, hidden_layers),
        _hidden_list(teacher_outputs, kind, hidden_layers),
        attention_mask,
    )
    if kind == SEQ2SEQ and student_logits is not None:
        return hidden + kl_next_token(student_logits, teacher_outputs.logits, None, temperature)
    return hidden


# ----------------------------------------------------------------------------------------------------------------
# The Trainer


class DistillationTrainer(Trainer):
    """A ``Trainer`` whose loss is the student's distance to a frozen teacher (:func:`distillation_loss`),
    optionally mixed with the student's own LM / MLM loss (``lm_weight``; needs ``labels`` in the batch).

    The teacher is kept in eval mode, without gradients (``requires_grad_(False)``, forward under
    ``torch.no_grad``), on the student's device and in its dtype. Its weights never change.

    Example:
        >>> teacher = GPT2LMHeadModel(config); student = hf_alibi.patch_model(copy.deepcopy(teacher))
        >>> trainer = DistillationTrainer(model=student, teacher=teacher, args=args, train_dataset=blocks)
        >>> trainer.train()
    """

    def __init__(
        self,
        *args,
        teacher: PreTrainedModel,
        kind: str | None = None,
        lm_weight: float = 0.0,
        temperature: float = 1.0,
        hidden_layers: str = "last",
        warm_start_steps: int = 0,
        attention_only_steps: int = 0,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not 0.0 <= lm_weight <= 1.0:
            raise ValueError(f"lm_weight must be between 0 and 1 (the share of the LM loss), got {lm_weight}.")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if hidden_layers not in HIDDEN_LAYERS:
            raise ValueError(f"hidden_layers must be one of {HIDDEN_LAYERS}, got {hidden_layers!r}.")
        student = self.accelerator.unwrap_model(self.model)
        self.kind = kind or model_kind(teacher)
        self.lm_weight = float(lm_weight)
        self.temperature = float(temperature)
        self.hidden_layers = hidden_layers
        self.loss_is_scaled_for_ga = False  # our loss is a per-batch mean
        parameter = next(student.parameters())
        self.teacher = teacher.to(device=parameter.device, dtype=parameter.dtype).eval().requires_grad_(False)
        self.attention_only_steps = int(attention_only_steps)
        self.warm_start = PositionWarmStart(student, teacher, warm_start_steps) if warm_start_steps > 0 else None
        self._frozen: list[nn.Parameter] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if self.kind == SEQ2SEQ and "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = _shift_right(self.teacher, inputs["input_ids"])
        hidden = self.kind != CAUSAL or getattr(self.teacher, "get_output_embeddings", lambda: None)() is None
        self.teacher.eval()
        with torch.no_grad():
            teacher_outputs = self.teacher(**inputs, output_hidden_states=hidden)
        student_outputs = model(**inputs, labels=labels, output_hidden_states=hidden)
        loss = distillation_loss(
            student_outputs,
            teacher_outputs,
            self.kind,
            inputs.get("attention_mask"),
            self.temperature,
            self.hidden_layers,
        )
        if self.lm_weight > 0:
            if labels is None or getattr(student_outputs, "loss", None) is None:
                raise ValueError("lm_weight > 0 needs labels in the batch (the LM / MLM targets).")
            loss = (1 - self.lm_weight) * loss + self.lm_weight * student_outputs.loss
        return (loss, student_outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step
        if self.warm_start is not None:
            self.warm_start.set_step(step)
        if self.attention_only_steps:
            self._set_attention_only(model, step < self.attention_only_steps)
        return super().training_step(model, inputs, num_items_in_batch)

    def _set_attention_only(self, model, on: bool) -> None:
        if on and not self._frozen:
            for name, parameter in self.accelerator.unwrap_model(model).named_parameters():
                lowered = name.lower()
                if parameter.requires_grad and not any(k in lowered for k in ("attn", "attention", "alibi")):
                    parameter.requires_grad_(False)
                    self._frozen.append(parameter)
        elif not on and self._frozen:
            for parameter in self._frozen:
                parameter.requires_grad_(True)
            self._frozen = []

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.warm_start is not None:
                self.warm_start.remove()
            self._set_attention_only(self.model, False)


def _shift_right(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    start = model.config.decoder_start_token_id
    start = model.config.pad_token_id if start is None else start
    shifted = ids.new_full(ids.shape, start)
    shifted[:, 1:] = ids[:, :-1]
    return shifted


class PositionWarmStart:
    """The warm-start lever: the original learned position table (a frozen copy) added to the student's
    input embeddings with a weight that falls linearly from 1 to 0 over ``steps`` steps; removed after.

    Only for models with a learned absolute position table (GPT-2, BERT, RoBERTa); a ``ValueError`` else.
    Inputs are taken to start at position 0 (training blocks, no left padding).
    """

    def __init__(self, student: PreTrainedModel, teacher: PreTrainedModel, steps: int):
        table = _position_table(teacher)
        if table is None:
            raise ValueError(
                f"warm_start_steps needs a learned position table; {teacher.config.model_type} has none "
                "(rotary or relative positions). Use warm_start_steps=0."
            )
        module, self.offset = table
        self.weight = module.weight.detach().clone()
        self.steps = int(steps)
        self.alpha = 1.0
        self.handle = student.get_input_embeddings().register_forward_hook(self._hook)

    def set_step(self, step: int) -> None:
        self.alpha = max(0.0, 1.0 - step / self.steps)

    def _hook(self, module, args, output):
        if self.alpha <= 0 or self.handle is None:
            return output
        length = output.shape[-2]
        table = self.weight[self.offset : self.offset + length].to(output.device, output.dtype)
        if table.shape[0] < length:  # past the original table: no position signal there
            table = torch.cat([table, table.new_zeros(length - table.shape[0], table.shape[1])])
        return output + self.alpha * table

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


# ----------------------------------------------------------------------------------------------------------------
# Agreement metrics


def _forward_hidden(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    if getattr(model.config, "is_encoder_decoder", False):
        return model.get_encoder()(input_ids=ids).last_hidden_state
    return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


@torch.no_grad()
def mean_pooled(model: PreTrainedModel, ids: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Mean over tokens of the last hidden state, (N, D) fp32, for the (N, L) token ids ``ids``.

    >>> mean_pooled(bert, torch.randint(0, 100, (4, 32))).shape
    torch.Size([4, 32])
    """
    model.eval()
    device = next(model.parameters()).device
    out = [
        _forward_hidden(model, ids[i : i + batch_size].to(device)).float().mean(1).cpu()
        for i in range(0, len(ids), batch_size)
    ]
    return torch.cat(out)


def _windows(stream: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    n = stream.numel() // length
    if limit is not None:
        n = min(n, limit)
    return stream[: n * length].view(n, length)


@torch.no_grad()
def embedding_cosine(
    student: PreTrainedModel, teacher: PreTrainedModel, stream: torch.Tensor, length: int, factor: int = 1
) -> float | None:
    """Mean cosine between the student's mean-pooled embedding of each window of ``factor * length``
    tokens of ``stream`` and the teacher's, which at ``factor > 1`` is the mean of its mean-pooled
    embeddings of the window's ``factor`` pieces of ``length`` tokens (it cannot read past ``length``).
    None when ``stream`` is shorter than one window.

    >>> embedding_cosine(student_bert, original_bert, held_out_ids, length=128, factor=4)
    0.97
    """
    windows = _windows(stream, length * factor)
    if len(windows) == 0:
        return None
    student_emb = mean_pooled(student, windows)
    teacher_emb = mean_pooled(teacher, windows.reshape(-1, length)).view(len(windows), factor, -1).mean(1)
    return F.cosine_similarity(student_emb, teacher_emb, dim=-1).mean().item()


@torch.no_grad()
def next_token_kl(
    student: PreTrainedModel, teacher: PreTrainedModel, stream: torch.Tensor, length: int, batch_size: int = 8
) -> float | None:
    """Mean per-token ``KL(teacher || student)`` of the next-token distributions over the windows of
    ``length`` tokens of ``stream`` (non-overlapping); None when ``stream`` is shorter than one window.

    >>> next_token_kl(student_gpt2, original_gpt2, held_out_ids, length=1024)
    0.04
    """
    windows = _windows(stream, length)
    if len(windows) == 0:
        return None
    student.eval()
    teacher.eval()
    device = next(student.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = windows[i : i + batch_size].to(device)
        kl = kl_next_token(student(input_ids=ids).logits, teacher(input_ids=ids).logits)
        total += kl.item() * ids.numel()
        count += ids.numel()
    return total / count


def agreement(
    student: PreTrainedModel,
    teacher: PreTrainedModel,
    stream: torch.Tensor,
    length: int,
    factors: Sequence[int] = (1, 2, 4, 8),
    kind: str | None = None,
) -> dict[str, Any]:
    """How close the student is to the teacher on the held-out token stream ``stream``.

    Causal LMs: ``kl`` (teacher || student, per token) and both perplexities at ``length``, and the
    student's perplexity at ``factor * length`` (``ppl_<k>x``, non-overlapping windows).
    Encoders / seq2seq: ``cosine`` of mean-pooled embeddings at ``length``, and ``cosine_<k>x`` for the
    student at ``factor * length`` against the teacher's mean over the pieces. Lengths the stream is
    too short for are left out.

    >>> agreement(student, teacher, held_out_ids, length=128)["kl"]
    0.012
    """
    kind = kind or model_kind(teacher)
    stream = torch.as_tensor(stream).reshape(-1)
    was_training = student.training
    result: dict[str, Any] = {}
    try:
        if kind == CAUSAL and student.get_output_embeddings() is not None:
            result["kl"] = next_token_kl(student, teacher, stream, length)
            result["teacher_ppl"] = evaluate_perplexity(teacher, stream[: _usable(stream, length)], length)[
                "perplexity"
            ]
            for factor in factors:
                n = _usable(stream, length * factor)
                if n:
                    ppl = evaluate_perplexity(student, stream[:n], length * factor)["perplexity"]
                    result["ppl" if factor == 1 else f"ppl_{factor}x"] = ppl
        else:
            for factor in factors:
                value = embedding_cosine(student, teacher, stream, length, factor)
                if value is not None:
                    result["cosine" if factor == 1 else f"cosine_{factor}x"] = value
    finally:
        student.train(was_training)
    return result


def _usable(stream: torch.Tensor, length: int) -> int:
    """Tokens of ``stream`` covered by whole windows of ``length`` (plus one target), 0 if none."""
    n = (stream.numel() - 1) // length * length
    return n + 1 if n else 0


def format_agreement(figures: dict[str, Any]) -> str:
    """One line: ``kl 0.0123 | ppl 45.6 (teacher 45.1) | 2x 44.9 | ...`` or ``cosine 0.981 | 2x 0.97 ...``."""
    if "kl" in figures:
        parts = [f"kl {figures['kl']:.4f}"]
        if "ppl" in figures:
            parts.append(f"ppl {figures['ppl']:.2f} (teacher {figures['teacher_ppl']:.2f})")
        parts += [f"{k[4:]} {v:.2f}" for k, v in figures.items() if k.startswith("ppl_")]
    else:
        parts = [f"cosine {figures['cosine']:.4f}"] if "cosine" in figures else []
        parts += [f"{k[7:]} {v:.4f}" for k, v in figures.items() if k.startswith("cosine_")]
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# Data


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor, labels: bool):
        self.blocks, self.labels = blocks, labels

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.blocks[index]}
        if self.labels:
            item["labels"] = self.blocks[index]
        return item


def token_stream(texts: Sequence[str], tokenizer) -> torch.Tensor:
    """The texts tokenized without special tokens and joined into one 1-d stream, separated by the
    tokenizer's eos (else sep) token when it has one.

    >>> token_stream(["def f():", "return 1"], tokenizer).shape
    torch.Size([9])
    """
    if isinstance(texts, str):
        texts = [texts]
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    for text in texts:
        if not text or not text.strip():
            continue
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if separator is not None:
            ids.append(separator)
    return torch.tensor(ids, dtype=torch.long)


def _mlm_collator(tokenizer, probability: float = 0.15):
    from transformers import DataCollatorForLanguageModeling

    if tokenizer is None or tokenizer.mask_token_id is None:
        raise ValueError("lm_weight > 0 for an encoder needs a tokenizer with a mask token (for the MLM loss).")
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=probability)

    def collate(features):
        return collator([{"input_ids": f["input_ids"]} for f in features])

    return collate


# ----------------------------------------------------------------------------------------------------------------
# recover()


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
    *,
    length: int | None = None,
    max_steps: int = 500,
    batch_size: int = 8,
    learning_rate: float = 2e-4,
    warmup_steps: int | None = None,
    weight_decay: float = 0.01,
    lm_weight: float = 0.0,
    temperature: float = 1.0,
    hidden_layers: str = "last",
    heads: int | None = None,
    encoder_variant: str | None = None,
    warm_start_steps: int = 0,
    attention_only_steps: int = 0,
    eval_texts: Sequence[str] | torch.Tensor | None = None,
    eval_fraction: float = 0.05,
    max_eval_tokens: int = 8192,
    eval_factors: Sequence[int] = (1, 2, 4, 8),
    eval_every: int | None = None,
    seed: int = 0,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    output_dir: str | None = None,
) -> RecoveryResult:
    """Convert a copy of ``model`` to ALiBi and distil ``model`` into it on ``texts``.

    Args:
        model: the original (unconverted) model of a registered architecture; it is the teacher and is
            never changed (its weights get no gradients).
        texts: the user's unlabeled text (a list of strings; needs ``tokenizer``), or a 1-d tensor of
            token ids. Cut into blocks of ``length`` tokens; the last ``eval_fraction`` of the tokens
            (or ``eval_texts``) is held out for the agreement figures.
        length: training length; default the original maximum (:func:`original_length`).
        max_steps, batch_size, learning_rate, warmup_steps (default 5% of the steps), weight_decay: AdamW
            with a cosine schedule, through the Trainer.
        lm_weight: share of the ordinary LM / MLM loss in the loss (0: distillation only).
        temperature, hidden_layers: see :func:`distillation_loss`.
        heads, encoder_variant: passed to :func:`hf_alibi.patch_model`.
        warm_start_steps, attention_only_steps: the levers (module docstring).
        eval_every: agreement every this many steps (default ``max_steps // 4``), also at 0 and at the end,
            on at most ``max_eval_tokens`` held-out tokens, at ``length`` and ``eval_factors`` x ``length``.
        progress: the Trainer's progress bar; ``log``: where the agreement lines go (None: nowhere).

    Returns:
        :class:`RecoveryResult`; ``result.student.save_pretrained(folder)`` writes a normal converted
        checkpoint (use :func:`write_recovery_card` to add how it was recovered to its card).

    Raises:
        ValueError: an ALiBi ``model`` (pass the original), no text, text too short for one training window,
            or bad settings; raised before any training.

    Example:
        >>> result = recover(AutoModelForCausalLM.from_pretrained("my-gpt2"), texts, tokenizer, max_steps=300)
        >>> result.final["ppl"], result.final["ppl_8x"]
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"recover expects a transformers PreTrainedModel, got {type(model).__name__}.")
    if hf_alibi.is_alibi_model(model):
        raise ValueError(
            "recover needs the original model (the teacher), but this one is already ALiBi: pass the checkpoint "
            "it was converted from."
        )
    if hidden_layers not in HIDDEN_LAYERS:
        raise ValueError(f"hidden_layers must be one of {HIDDEN_LAYERS}, got {hidden_layers!r}.")
    if max_steps < 1 or batch_size < 1:
        raise ValueError(f"max_steps and batch_size must be >= 1, got {max_steps} and {batch_size}.")
    if not 0 < eval_fraction < 1 and eval_texts is None:
        raise ValueError(f"eval_fraction must be between 0 and 1, got {eval_fraction}.")
    kind = model_kind(model)
    length = length or original_length(model)
    if not length:
        raise ValueError(
            f"{model.config.model_type} has no position table to read its length from: pass length (CLI: --length)."
        )

    stream = _as_stream(texts, tokenizer, "texts")
    if eval_texts is not None:
        train_stream, eval_stream = stream, _as_stream(eval_texts, tokenizer, "eval_texts")
    else:
        held = max(int(stream.numel() * eval_fraction), length + 1)
        train_stream, eval_stream = stream[:-held], stream[-held:]
    eval_stream = eval_stream[: max_eval_tokens + 1]
    n_blocks = train_stream.numel() // length
    if n_blocks < 1 or eval_stream.numel() <= length:
        raise ValueError(
            f"The text is too short: {stream.numel()} tokens, but recovering at length {length} needs at least one "
            f"training window of {length} tokens and a held-out slice of {length + 1} "
            f"({2 * length + 1} tokens in all). Pass more text, or a smaller length."
        )
    blocks = train_stream[: n_blocks * length].view(n_blocks, length)

    teacher = model
    was_training = teacher.training
    requires_grad = [p.requires_grad for p in teacher.parameters()]
    student = copy.deepcopy(teacher).requires_grad_(True)
    hf_alibi.patch_model(student, heads=heads, encoder_variant=encoder_variant)
    if warm_start_steps and _position_table(teacher) is None:
        raise ValueError(
            f"warm_start_steps needs a learned position table; {teacher.config.model_type} has none "
            "(rotary or relative positions). Use warm_start_steps=0."
        )
    teacher.eval()

    history: list[dict[str, Any]] = []
    tokens_per_step = batch_size * length
    say = log or (lambda _: None)

    def evaluate(step: int) -> None:
        figures = agreement(student, teacher, eval_stream, length, eval_factors, kind)
        history.append({"step": step, "tokens": step * tokens_per_step, **figures})
        line = f"[recover] step {step}/{max_steps} ({step * tokens_per_step} tokens): {format_agreement(figures)}"
        _write(line, say)

    evaluate(0)
    labels = lm_weight > 0 and kind != ENCODER
    collator = _mlm_collator(tokenizer) if lm_weight > 0 and kind == ENCODER else default_data_collator
    scratch = tempfile.TemporaryDirectory(prefix="hf_alibi_recover_") if output_dir is None else None
    args = TrainingArguments(
        output_dir=output_dir or scratch.name,
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=max(1, max_steps // 20) if warmup_steps is None else warmup_steps,
        lr_scheduler_type="cosine",
        weight_decay=weight_decay,
        max_grad_norm=1.0,
        logging_steps=max(1, max_steps // 10),
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=not progress,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = DistillationTrainer(
        model=student,
        args=args,
        train_dataset=_Blocks(blocks, labels),
        data_collator=collator,
        teacher=teacher,
        kind=kind,
        lm_weight=lm_weight,
        temperature=temperature,
        hidden_layers=hidden_layers,
        warm_start_steps=warm_start_steps,
        attention_only_steps=attention_only_steps,
        callbacks=[_AgreementCallback(evaluate, max_steps // 4 if eval_every is None else eval_every)],
    )
    if not progress:
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        if scratch is not None:
            scratch.cleanup()
        teacher.train(was_training)
        for parameter, flag in zip(teacher.parameters(), requires_grad):  # the trainer froze it; give it back
            parameter.requires_grad_(flag)
    seconds = time.perf_counter() - start
    student = trainer.accelerator.unwrap_model(trainer.model).eval()
    evaluate(max_steps)
    epochs = max_steps * batch_size / n_blocks
    info = {
        "teacher": getattr(teacher.config, "_name_or_path", "") or type(teacher).__name__,
        "kind": kind,
        "loss": _loss_name(kind, hidden_layers, lm_weight, temperature),
        "steps": max_steps,
        "batch_size": batch_size,
        "length": length,
        "tokens": max_steps * tokens_per_step,
        "train_tokens_available": int(n_blocks * length),
        "epochs": round(epochs, 3),
        "learning_rate": learning_rate,
        "warm_start_steps": warm_start_steps,
        "attention_only_steps": attention_only_steps,
        "encoder_variant": hf_alibi.get_settings(student.config).encoder_variant,
        "eval_tokens": int(eval_stream.numel()),
        "train_seconds": round(seconds, 1),
    }
    return RecoveryResult(student=student, history=history, info=info)


def _loss_name(kind: str, hidden_layers: str, lm_weight: float, temperature: float) -> str:
    if kind == CAUSAL:
        name = f"KL(teacher ‖ student) of next-token distributions (temperature {temperature:g})"
    else:
        layers = "last layer" if hidden_layers == "last" else "every layer"
        name = f"MSE of hidden states ({layers})" + (" + KL of decoder logits" if kind == SEQ2SEQ else "")
    if lm_weight:
        name += f", mixed with the {'MLM' if kind == ENCODER else 'LM'} loss (weight {lm_weight:g})"
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


def _as_stream(texts, tokenizer, name: str) -> torch.Tensor:
    if isinstance(texts, torch.Tensor):
        stream = texts.reshape(-1).long()
    else:
        if tokenizer is None:
            raise ValueError(f"{name} are strings: pass the tokenizer too (or pass token ids as a tensor).")
        stream = token_stream(texts, tokenizer)
    if stream.numel() == 0:
        raise ValueError(f"{name} holds no text (nothing to distil on). Pass the unlabeled text to recover with.")
    return stream


def recovery_card_section(result: RecoveryResult) -> str:
    """The model card section that says how a checkpoint was recovered (steps, tokens, length, agreement)."""
    info, first, last = result.info, result.history[0], result.final
    rows = [
        ("teacher (original)", info["teacher"]),
        ("loss", info["loss"]),
        ("steps x batch x length", f"{info['steps']} x {info['batch_size']} x {info['length']}"),
        ("tokens seen", f"{info['tokens']} ({info['epochs']} epochs of {info['train_tokens_available']})"),
        ("learning rate", info["learning_rate"]),
        ("warm start / attention-only steps", f"{info['warm_start_steps']} / {info['attention_only_steps']}"),
        ("held-out tokens", info["eval_tokens"]),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    figures = "\n".join(
        f"| {key} | {_fmt(first.get(key))} | {_fmt(last.get(key))} |" for key in last if key not in ("step", "tokens")
    )
    return f"""
## Recovery (self-distillation from the original)

Converted with hf_alibi and then trained to give the original model's outputs without its position
embeddings (`hf_alibi.recover`), on unlabeled text at the original length {info["length"]}.

| setting | value |
|---|---|
{table}

Agreement with the original on the held-out text, before and after (`kl`: per token, KL(teacher ‖ student);
`ppl_kx` / `cosine_kx`: the recovered model at k x the original length):

| figure | converted, not trained | recovered |
|---|---|---|
{figures}
"""


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def write_recovery_card(folder: str | os.PathLike, result: RecoveryResult) -> None:
    """Append :func:`recovery_card_section` to ``folder``/README.md (the converted checkpoint's card) and
    remove the card's note that a converted model must be fine-tuned first (this one was).

    >>> result.student.save_pretrained("recovered"); write_recovery_card("recovered", result)
    """
    from pathlib import Path

    path = Path(folder) / "README.md"
    card = path.read_text() if path.exists() else ""
    note_start = card.find("Note: converting does not train.")
    if note_start >= 0:
        note_end = card.find("\n\n", note_start)
        card = card[:note_start] + (
            "Note: this checkpoint was recovered after conversion (see *Recovery* below)."
            + (card[note_end:] if note_end >= 0 else "\n")
        )
    path.write_text(card.rstrip("\n") + "\n" + recovery_card_section(result))


# ----------------------------------------------------------------------------------------------------------------
# hf-alibi recover SRC OUT --train_file F


def read_texts(path: str | os.PathLike) -> list[str]:
    """The texts of a local file: ``.txt`` (the whole file, one text), ``.jsonl`` / ``.json`` (the ``text``
    field of every record). Raises ``ValueError`` when the file is missing, unreadable or holds no text.

    >>> read_texts("notes.jsonl")    # {"text": ...} per line
    ['first note', 'second note']
    """
    import json
    from pathlib import Path

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"--train_file {str(path)!r} is not a file. Pass a .txt or .jsonl file of unlabeled text.")
    try:
        raw = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as error:
        raise ValueError(f"--train_file {str(path)!r} could not be read as UTF-8 text ({error}).") from error
    if path.suffix in (".jsonl", ".json"):
        try:
            records = [json.loads(line) for line in raw.splitlines() if line.strip()]
            if len(records) == 1 and isinstance(records[0], list):
                records = records[0]
            texts = [r["text"] for r in records if isinstance(r, dict) and isinstance(r.get("text"), str)]
        except json.JSONDecodeError as error:
            raise ValueError(f"--train_file {str(path)!r} is not JSON lines with a 'text' field ({error}).") from error
    else:
        texts = [raw]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"--train_file {str(path)!r} holds no text. Pass the unlabeled text to recover with.")
    return texts


def _length_from_config(config_dict: dict) -> int | None:
    """The original maximum length as config.json states it (None when it does not)."""
    for key in ("n_positions", "max_position_embeddings"):
        if isinstance(config_dict.get(key), int):
            offset = config_dict.get("pad_token_id", 0) + 1 if config_dict["model_type"] == "roberta" else 0
            return config_dict[key] - offset
    return None


def recover_checkpoint(
    src: str,
    out: str | os.PathLike,
    train_file: str | os.PathLike,
    *,
    validation_file: str | os.PathLike | None = None,
    overwrite: bool = False,
    **settings: Any,
):
    """What ``hf-alibi recover SRC OUT --train_file F`` does: load the original checkpoint ``src``, convert
    a copy, distil (:func:`recover`, ``settings`` are its keyword arguments), and write ``out`` as a
    normal converted checkpoint (weights, config with the ALiBi settings, remote code, tokenizer) whose
    model card says how it was recovered, plus ``recovery.json`` (settings and agreement history).

    Every input is checked before training, and ``out`` is written into a staging folder next to it and
    renamed at the end: a failure leaves no half-written ``out``. Raises ``hf_alibi.cli.CliError``.

    Example:
        >>> recover_checkpoint("my-gpt2", "gpt2-alibi", "notes.txt", max_steps=300)
    """
    import json
    import shutil
    from pathlib import Path

    from transformers import AutoTokenizer

    from .cli import CliError, _check_paths, _has_tokenizer, _is_local, _load_config_dict, model_class_for
    from .hub import finish_folder

    out = Path(out)
    _check_paths(src, out, overwrite)
    config_dict = _load_config_dict(src)
    if config_dict["model_type"].startswith("alibi_"):
        raise CliError(
            f"SRC {src!r} is already an ALiBi checkpoint (model_type {config_dict['model_type']!r}); recover needs "
            "the original checkpoint it was converted from (the teacher)."
        )
    model_cls = model_class_for(config_dict)
    try:
        texts = read_texts(train_file)
        eval_texts = read_texts(validation_file) if validation_file is not None else None
    except ValueError as error:
        raise CliError(str(error)) from error
    if _has_tokenizer(src) is False:
        raise CliError(f"SRC {src!r} has no tokenizer files; recover needs the model's tokenizer to read the text.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception as error:
        raise CliError(f"Could not load the tokenizer of SRC {src!r}: {error}") from error
    stream = token_stream(texts, tokenizer)
    eval_stream = token_stream(eval_texts, tokenizer) if eval_texts is not None else None
    length = settings.get("length") or _length_from_config(config_dict)
    if eval_stream is None:
        too_short = length and stream.numel() < 2 * length + 1
    else:
        too_short = length and (stream.numel() < length or eval_stream.numel() < length + 1)
    if too_short:
        raise CliError(
            f"The text is too short: {stream.numel()} tokens, but recovering at length {length} needs at least one "
            f"training window of {length} tokens and a held-out slice of {length + 1}. Pass more text, or --length."
        )
    try:
        teacher = model_cls.from_pretrained(src)
    except Exception as error:
        raise CliError(f"Could not load the model from SRC {src!r} as {model_cls.__name__}: {error}") from error
    try:
        result = recover(teacher, stream, tokenizer, eval_texts=eval_stream, **settings)
    except ValueError as error:
        raise CliError(str(error)) from error
    result.info["teacher"] = src

    parent = out.expanduser().resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        result.student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "README.md").unlink(missing_ok=True)
        finish_folder(staging, result.student.config, base_model=None if _is_local(src) else src)
        write_recovery_card(staging, result)
        (staging / "recovery.json").write_text(
            json.dumps({"info": result.info, "history": result.history}, indent=2, default=str) + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out, result
