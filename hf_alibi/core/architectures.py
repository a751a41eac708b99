"""The architecture table: one row of plain data per model type, read by generic conversion code.

A row says where the position path is (``position``), which strategy removes it (``strategy``),
where the self-attention modules are (``attention``; each gets an ``AlibiBias``), which config fields
sized the removed path (``removed_config_fields``) and whether self-attention is bidirectional.
Paths start at the base model (``model.base_model``); ``*`` is every layer, a trailing ``?`` an
optional path. Rows are saved in every converted config.json (``alibi.architecture``), so a
checkpoint rebuilds the same way wherever it is loaded, remote code included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .strategies import STRATEGIES


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
    # an int, or the name of a config field whose value + 1 is used (RoBERTa's table has a padding row
    # at pad_token_id, so it needs pad_token_id + 1 rows).
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
        if isinstance(self.placeholder, str):
            return (getattr(config, self.placeholder, None) or 0) + 1
        return self.placeholder

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Architecture:
        return cls(**data)


def _rotary(model_type: str, **values) -> Architecture:
    """A decoder whose base model makes one ``rotary_emb`` per forward (Llama and ~180 others)."""
    return Architecture(model_type, "rotary", **values)


_ABSOLUTE_BERT = dict(
    position=("embeddings.position_embeddings",), attention=("encoder.layer.*.attention.self",), bidirectional=True
)
_T5_ATTENTION = ("encoder.block.*.layer.0.SelfAttention", "decoder.block.*.layer.0.SelfAttention?")

ARCHITECTURES: dict[str, Architecture] = {
    row.model_type: row
    for row in (
        Architecture(
            "gpt2", "absolute", position=("wpe",), attention=("h.*.attn",), removed_config_fields=("n_positions",),
            extra_classes=("GPT2DoubleHeadsModel",),
        ),
        Architecture("bert", "absolute", **_ABSOLUTE_BERT),
        # OPT's table is indexed by position + 2 (its offset); the table goes, so the offset with it.
        Architecture(
            "opt", "absolute", position=("decoder.embed_positions",), attention=("decoder.layers.*.self_attn",)
        ),
        Architecture("roberta", "absolute", **_ABSOLUTE_BERT, placeholder="pad_token_id"),
        Architecture(
            "t5", "relative",
            position=("encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention?"),
            attention=_T5_ATTENTION, bidirectional=True,
            removed_config_fields=("relative_attention_num_buckets", "relative_attention_max_distance"),
        ),
        # The rotary decoders. The rotary fields (rope_parameters, partial_rotary_factor) stay: they build
        # the original layers and size nothing; max_position_embeddings is the one length limit.
        # Checked against an explicit-bias reference (tests/reference.py), eager and sdpa, with grouped KV
        # heads, sliding windows (mistral, qwen2, gemma2, gemma3_text, cohere2, exaone4, ministral, mixtral,
        # olmo3, qwen2_moe), soft-capping (gemma2: the bias is added after the cap, see eager.py), partial
        # rotary (phi3, stablelm, gpt_neox, phi, persimmon, glm, glm4, nemotron), layers without rotary
        # (smollm3) and mixture-of-experts MLPs (mixtral, olmoe, qwen2_moe, qwen3_moe, granitemoe).
        _rotary("gpt_neox", attention=("layers.*.attention",)),
        *(_rotary(model_type) for model_type in (
            "apertus", "arcee", "cohere", "cohere2", "ernie4_5", "exaone4", "gemma", "gemma2", "gemma3_text", "glm",
            "glm4", "granite", "granitemoe", "hunyuan_v1_dense", "llama", "ministral", "mistral", "mixtral",
            "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "persimmon", "phi", "phi3", "qwen2", "qwen2_moe",
            "qwen3", "qwen3_moe", "seed_oss", "smollm3", "stablelm", "starcoder2",
        )),
    )
}  # fmt: skip


def get_architecture(model_type: str) -> Architecture | None:
    """The built-in row of ``model_type``, or ``None``."""
    return ARCHITECTURES.get(model_type)


def check_strategy(row: Architecture) -> None:
    if row.strategy not in STRATEGIES:
        raise ValueError(
            f"Architecture {row.model_type!r} names strategy {row.strategy!r}; known: {sorted(STRATEGIES)}."
        )
