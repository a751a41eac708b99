"""The shapes and inputs the flash-kernel contract tests share (tests/core/test_flash_contract.py, flash-attn 2, and
tests/core/test_fa4_contract.py, FlashAttention-4): bf16 queries, keys and values of H heads of size D."""

import torch

H, D = 4, 16
BF16 = torch.bfloat16


def inputs(batch, q_len, kv_len, kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, q_len, D, generator=g).to(BF16)
    k, v = (torch.randn(batch, kv_heads, kv_len, D, generator=g).to(BF16) for _ in range(2))
    return q, k, v


def expanded(t):  # grouped KV heads, repeated for the reference
    return t.repeat_interleave(H // t.shape[1], dim=1)
