"""Where a model's learned position table is, and how long the original's inputs were: one answer each.

Both come from the architecture row (:mod:`hf_alibi.core.architectures`): ``row.position`` says where the
table is (rows of strategy ``"absolute"``), ``core.strategies.table_rows`` where its used rows begin (OPT's
``offset``, RoBERTa's ``padding_idx + 1``), and the row's removed length field (``n_positions`` or
``max_position_embeddings``), less the rows leading the table (``row.leading_rows``), how long the inputs
were. The CLI, recovery, evaluation, the scripts and the benchmarks all ask here.

>>> original_length({"model_type": "roberta", "max_position_embeddings": 66, "pad_token_id": 1})
64
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..core.architectures import find_architecture
from ..core.config import LENGTH_FIELDS, MODEL_TYPE_PREFIX
from ..core.names import is_alibi
from ..core.strategies import find_modules, table_rows


def original_length(config: Mapping[str, Any] | Any) -> int | None:
    """The longest input the original model was built for, from its config (a dict, a ``PretrainedConfig``
    or a model): the row's removed length field less the rows leading its table (RoBERTa's table has
    ``max_position_embeddings`` rows and numbers positions from ``pad_token_id + 1``: 514 - 1 - 1 = 512 for
    roberta-base; a null ``pad_token_id`` counts as 0). None where no length is stated (T5: relative
    positions) and for an ALiBi config (no limit). A type without a row: its stated length as is.

    >>> original_length(GPT2Config(n_positions=48))
    48
    """
    config = getattr(config, "config", config)  # a model: its config
    if is_alibi(config):  # its length fields answer "no maximum" (core.config.NO_MAXIMUM), not the original's
        return None
    if isinstance(config, Mapping):
        get = config.get
    else:

        def get(key, default=None):
            return getattr(config, key, default)

    row = find_architecture(str(get("model_type", "") or "").removeprefix(MODEL_TYPE_PREFIX))
    fields = [f for f in row.removed_config_fields if f in LENGTH_FIELDS] if row is not None else LENGTH_FIELDS
    for field in fields:
        value = get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value - (row.leading_rows(config) if row is not None else 0)
    return None


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
