"""The architecture rows: one row of plain data per model type, read by generic conversion code.

A row says where the position path is (``position``), which strategy removes it (``strategy``),
where the self-attention modules are (``attention``; each gets an ``AlibiBias``), which config fields
sized the removed path (``removed_config_fields``) and whether self-attention is bidirectional.
Paths start at the base model (``model.base_model``); ``*`` is every layer, a trailing ``?`` an
optional path. Rows are saved in every converted config.json (``alibi.architecture``), so a
checkpoint rebuilds the same way wherever it is loaded, remote code included. The built-in rows are
hf_alibi's ``patches`` package, which this code never imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """How to convert one architecture (plain data; see the module docstring).

    >>> Architecture("llama", "rotary").attention
    ('layers.*.self_attn',)
    """

    model_type: str
    strategy: str
    position: tuple[str, ...] = ("rotary_emb",)
    attention: tuple[str, ...] = ("layers.*.self_attn",)
    removed_config_fields: tuple[str, ...] = ("max_position_embeddings",)
    bidirectional: bool = False
    # What the removed fields hold while the original __init__ builds the path that is then dropped:
    # an int, or the name of a config field whose value + 1 is used. RoBERTa's table numbers positions
    # from padding_idx + 1 (pad_token_id): those rows lead the table (leading_rows), so it needs at least
    # that many, and its length field counts them besides the positions.
    placeholder: int | str = 1
    # transformers model classes outside the Auto mappings that convert too (GPT2DoubleHeadsModel).
    extra_classes: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("position", "attention", "removed_config_fields", "extra_classes"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(item, str) for item in value):
                raise ValueError(f"Architecture.{name} must be a tuple of strings, got {value!r}.")
            object.__setattr__(self, name, tuple(value))  # lists from JSON become tuples
        if not self.attention:
            raise ValueError(f"Architecture {self.model_type!r} lists no self-attention modules.")

    def placeholder_size(self, config) -> int:
        return self.leading_rows(config) if isinstance(self.placeholder, str) else self.placeholder

    def leading_rows(self, config) -> int:
        """Rows of the learned table ahead of position 0 that the config's length field counts: the named
        ``placeholder`` field + 1 (RoBERTa: ``pad_token_id + 1``), else 0. ``config``: a config or a dict.

        >>> Architecture("roberta", "absolute", placeholder="pad_token_id").leading_rows({"pad_token_id": 1})
        2
        """
        if not isinstance(self.placeholder, str):
            return 0
        value = config.get(self.placeholder) if isinstance(config, dict) else getattr(config, self.placeholder, None)
        return (value or 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Architecture:
        return cls(**data)


# model_type -> row, for every row registered in this process: hf_alibi's registry fills it (its built-in
# rows, from hf_alibi.patches, and the user's). Empty in a checkpoint's remote code, which needs none: a
# converted model is rebuilt from the row saved in its config.json.
REGISTERED: dict[str, Architecture] = {}


def find_architecture(model_type: str) -> Architecture | None:
    """The row registered for ``model_type`` in this process, or ``None`` (see ``REGISTERED``).

    >>> find_architecture("no_such_type") is None
    True
    """
    return REGISTERED.get(model_type)


def check_strategy(row: Architecture) -> None:
    # imported here: the rows are plain data that the command line reads before torch loads (strategies.py's does)
    from .strategies import STRATEGIES

    if row.strategy not in STRATEGIES:
        raise ValueError(
            f"Architecture {row.model_type!r} names strategy {row.strategy!r}; known: {sorted(STRATEGIES)}."
        )
