"""The benchmarks' model builders, in one place: a randomly initialised model of one of the benchmarked
types from its shape, seeded, with the attention implementation given.

Each script passes its own shape and extra config fields (a script's figures depend on exactly those), so
the same call builds the same weights as before this module existed.

Example (from a script in benchmarks/, whose folder heads sys.path):
    >>> from builders import build_model
    >>> model = build_model("gpt2", layers=2, heads=4, width=64, positions=128, vocab=256, dropout=False)
"""

from __future__ import annotations

import torch
import transformers

# model_type -> (config class, model class): the causal LM, or the masked LM for BERT
CLASSES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    # trained with ALiBi (benchmarks/native.py): their ALiBi variant, the layout falcon-rw has
    "bloom": ("BloomConfig", "BloomForCausalLM"),
    "mpt": ("MptConfig", "MptForCausalLM"),
    "falcon": ("FalconConfig", "FalconForCausalLM"),
}
_NAMES_GPT2 = {"layers": "n_layer", "heads": "n_head", "width": "n_embd", "positions": "n_positions"}
_NAMES = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "width": "hidden_size"}
_NAMES["positions"] = "max_position_embeddings"
# BLOOM's config has no length field (None: not passed); MPT's names its own
_NAMES_BY_TYPE = {
    "gpt2": _NAMES_GPT2,
    "bloom": {"layers": "n_layer", "heads": "n_head", "width": "hidden_size", "positions": None},
    "mpt": {"layers": "n_layers", "heads": "n_heads", "width": "d_model", "positions": "max_seq_len"},
}
# what a type's ALiBi variant needs in its config (MPT and Falcon have others)
VARIANT = {
    "mpt": {"attn_config": {"alibi": True}},
    "falcon": {"alibi": True, "multi_query": False, "new_decoder_architecture": False, "parallel_attn": False},
}
# every dropout field of a type, for dropout=False (timings and gradient checks want deterministic steps)
NO_DROPOUT = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neox": {"attention_dropout": 0.0, "hidden_dropout": 0.0},
    "llama": {"attention_dropout": 0.0},
    "bert": {"attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.0},
    "bloom": {"attention_dropout": 0.0, "hidden_dropout": 0.0},
    "mpt": {"emb_pdrop": 0.0, "resid_pdrop": 0.0},  # attn_config.attn_pdrop is 0 by default
    "falcon": {"attention_dropout": 0.0, "hidden_dropout": 0.0},
}


def build_model(
    model_type: str,
    *,
    layers: int,
    heads: int,
    width: int,
    positions: int,
    vocab: int,
    seed: int = 0,
    attn: str | None = "sdpa",
    dropout: bool = True,
    **fields,
) -> transformers.PreTrainedModel:
    """A fresh ``model_type`` model (see :data:`CLASSES`) with ``layers`` x ``heads`` x ``width``, a position
    limit of ``positions``, ``vocab`` tokens and the config's other ``fields``, initialised after
    ``torch.manual_seed(seed)``; ``dropout=False`` zeroes every dropout of the type. ``attn=None``: the type's
    default attention implementation (BLOOM and MPT have only eager). BLOOM, MPT and Falcon get their ALiBi variant.

    >>> build_model("llama", layers=2, heads=4, width=64, positions=256, vocab=100, num_key_value_heads=2)
    """
    if model_type not in CLASSES:
        raise ValueError(f"No benchmark builder for {model_type!r}; known: {sorted(CLASSES)}.")
    config_name, model_name = CLASSES[model_type]
    names = _NAMES_BY_TYPE.get(model_type, _NAMES)
    shape = {names["layers"]: layers, names["heads"]: heads, names["width"]: width, names["positions"]: positions}
    shape.pop(None, None)
    config = getattr(transformers, config_name)(
        **shape, vocab_size=vocab, **VARIANT.get(model_type, {}), **({} if dropout else NO_DROPOUT[model_type]),
        **fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    return getattr(transformers, model_name)._from_config(config, attn_implementation=attn)
