"""Where a model's learned position table is, and how long the original's inputs were: one answer each.

Both come from the architecture row (:mod:`hf_alibi.core.architectures`): ``row.position`` says where the
table is (rows of strategy ``"absolute"``), ``core.strategies.table_rows`` where its used rows begin (OPT's
``offset``, RoBERTa's ``padding_idx + 1``), and the row's removed length field (``n_positions`` or
``max_position_embeddings``), less the rows leading the table (``row.leading_rows``), how long the inputs
were (:func:`original_length`: it lives, torch-free, in :mod:`hf_alibi.convert.planning`, which asks it). The CLI,
recovery, evaluation, the scripts and the benchmarks all ask here.

>>> original_length({"model_type": "roberta", "max_position_embeddings": 66, "pad_token_id": 1})
64
"""

from __future__ import annotations

from torch import nn

from ..core.architectures import find_architecture
from ..core.names import LENGTH_FIELDS, is_alibi
from ..core.strategies import find_modules, table_rows
from .planning import original_length  # torch-free, with the planner that asks it (re-exported: its home of old)


def position_table(model: nn.Module) -> tuple[nn.Embedding, int] | None:
    """The learned absolute position table of an original ``model`` (GPT-2's ``wpe``, BERT's and RoBERTa's
    ``position_embeddings``, OPT's ``embed_positions``: where its row says) and the index of position 0 in it;
    None for other rows (rotary, relative), a converted model, or a model of no registered type.

    >>> position_table(GPT2LMHeadModel(GPT2Config()))[1]
    0
    """
    config = getattr(model, "config", None)
    if config is None or is_alibi(config):
        return None
    row = find_architecture(getattr(config, "model_type", ""))
    if row is None or row.strategy != "absolute":
        return None
    base = getattr(model, "base_model", model)
    for path in row.position:
        for _, _, table in find_modules(base, path):
            if isinstance(table, nn.Embedding):
                return table, table_rows(table)[0]
    return None


def position_limit(model: nn.Module) -> int | None:
    """The longest input ``model``'s learned absolute position table allows (:func:`original_length` of its
    config), or None when it has none (ALiBi, rotary, relative).

    >>> position_limit(GPT2LMHeadModel(GPT2Config(n_positions=64)))
    64
    """
    return original_length(model) if position_table(model) is not None else None


__all__ = ["LENGTH_FIELDS", "original_length", "position_limit", "position_table"]
