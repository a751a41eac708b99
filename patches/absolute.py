"""Learned absolute position tables, replaced by a zero (strategy ``"absolute"``)."""

# relative: the command line reads these rows from hf_alibi's folder without importing the package (torch)
from ..core.architectures import Architecture

_BERT = dict(
    position=("embeddings.position_embeddings",), attention=("encoder.layer.*.attention.self",), bidirectional=True
)

ROWS: list[Architecture] = [
    Architecture(
        "gpt2", "absolute", position=("wpe",), attention=("h.*.attn",), removed_config_fields=("n_positions",),
        extra_classes=("GPT2DoubleHeadsModel",),
    ),
    Architecture("bert", "absolute", **_BERT),
    # OPT's table is indexed by position + 2 (its offset); the table goes, so the offset with it.
    Architecture("opt", "absolute", position=("decoder.embed_positions",), attention=("decoder.layers.*.self_attn",)),
    Architecture("roberta", "absolute", **_BERT, placeholder="pad_token_id"),
]  # fmt: skip
