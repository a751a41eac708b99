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

Modules (each one job; everything public is re-exported here):

- ``kinds``: what kind of model (causal, encoder, seq2seq); its position table and length are
  :mod:`hf_alibi.convert.positions`;
- ``losses``: the distillation losses; ``trainer``: the Trainer that applies them;
- ``warm_start``: the warm-start lever (a new lever goes in a module of its own, used by ``trainer``);
- ``metrics``: agreement with the teacher at 1x..8x the original length;
- ``blocks``: text files, the token stream, training blocks;
- ``settings``: :class:`RecoverySettings`, every setting of :func:`recover` declared once (its flag, its check);
  ``lengths``: the bounded lengths; neither imports torch or transformers, so ``hf-alibi recover``'s parser reads them;
- ``api``: :func:`recover` and :class:`RecoveryResult`; ``summary``: the model card's recovery section;
- what ``hf-alibi recover`` runs (folders in and out) is :func:`recover_checkpoint` (``checkpoint``).

Example:
    >>> from hf_alibi.recover import RecoverySettings, recover
    >>> result = recover(original_model, texts, tokenizer, RecoverySettings(max_steps=200))  # model not changed
    >>> result = recover(original_model, texts, tokenizer, max_steps=200)   # the same: keywords override
    >>> result.student.save_pretrained("recovered")                         # a normal converted checkpoint
    >>> result.history[-1]                                                  # agreement at 1x, 2x, 4x, 8x

The names below are loaded from their modules on first use (as :mod:`hf_alibi.hub`'s): importing
``hf_alibi.recover.settings`` (the command line's parser does) loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

_SUBMODULES = (
    "api", "blocks", "checkpoint", "kinds", "lengths", "lora", "losses", "metrics", "settings", "summary", "trainer",
    "warm_start",
)  # fmt: skip
_HOMES = {
    "original_length": "..convert.positions",
    "recover_checkpoint": ".checkpoint",
    "RecoveryResult": ".api",
    "recover": ".api",
    "read_texts": ".blocks",
    "token_stream": ".blocks",
    "CAUSAL_MODEL": ".kinds",
    "ENCODER_MODEL": ".kinds",
    "MODEL_KINDS": ".kinds",
    "SEQ2SEQ_MODEL": ".kinds",
    "model_kind": ".kinds",
    "HIDDEN_LAYERS": ".settings",
    "RecoverySettings": ".settings",
    "distillation_loss": ".losses",
    "hidden_state_mse": ".losses",
    "kl_next_token": ".losses",
    "agreement": ".metrics",
    "embedding_cosine": ".metrics",
    "format_agreement": ".metrics",
    "mean_pooled": ".metrics",
    "next_token_kl": ".metrics",
    "recovery_card_section": ".summary",
    "write_recovery_card": ".summary",
    "DistillationTrainer": ".trainer",
    "PositionWarmStart": ".warm_start",
}
__all__ = [
    "CAUSAL_MODEL",
    "ENCODER_MODEL",
    "HIDDEN_LAYERS",
    "MODEL_KINDS",
    "SEQ2SEQ_MODEL",
    "DistillationTrainer",
    "PositionWarmStart",
    "RecoverySettings",
    "RecoveryResult",
    "agreement",
    "distillation_loss",
    "embedding_cosine",
    "format_agreement",
    "hidden_state_mse",
    "kl_next_token",
    "mean_pooled",
    "model_kind",
    "next_token_kl",
    "original_length",
    "read_texts",
    "recover",
    "recover_checkpoint",
    "recovery_card_section",
    "token_stream",
    "write_recovery_card",
]

if TYPE_CHECKING:
    from ..convert.positions import original_length
    from .api import RecoveryResult, recover
    from .blocks import read_texts, token_stream
    from .checkpoint import recover_checkpoint
    from .kinds import CAUSAL_MODEL, ENCODER_MODEL, MODEL_KINDS, SEQ2SEQ_MODEL, model_kind
    from .losses import distillation_loss, hidden_state_mse, kl_next_token
    from .metrics import agreement, embedding_cosine, format_agreement, mean_pooled, next_token_kl
    from .settings import HIDDEN_LAYERS, RecoverySettings
    from .summary import recovery_card_section, write_recovery_card
    from .trainer import DistillationTrainer
    from .warm_start import PositionWarmStart


__getattr__, __dir__ = lazy_names(__name__, _HOMES, _SUBMODULES)
