"""Tiny configs written in code, shared by the tests."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

VOCAB = 97


def tiny_gpt2_config(**overrides) -> GPT2Config:
    values = dict(
        n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    values.update(overrides)
    return GPT2Config(**values)


def tiny_gpt2(seed: int = 0, attn_implementation: str = "sdpa", **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = tiny_gpt2_config(attn_implementation=attn_implementation, **overrides)
    return GPT2LMHeadModel(config).eval()


def tiny_bert(seed: int = 0) -> BertForMaskedLM:
    torch.manual_seed(seed)
    config = BertConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForMaskedLM(config).eval()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)
