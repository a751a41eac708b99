"""The sinks' fold for vLLM (hf_alibi/serve/vllm/sinks.py), without vLLM: vLLM's attention over the folded heads
(its score ``scale * q . k + m_h (j - i)`` within each request, written here) against hf_alibi's bias with sinks
written from its definition (no distance penalty on the first ``S`` keys of each request), fp32 and bf16, several
requests flattened as vLLM runs them. The vLLM tier runs the same fold in vLLM's engine (tests/serve/test_vllm.py)."""

import pytest
import torch

from hf_alibi.serve.vllm.sinks import SinkFold, channels, fold, padded_head_size, unfold

SLOPES = (0.5, 0.125, 0.03125, 0.0078125)  # 4 query heads, 2 key / value heads


def _flattened(lengths, dtype, seed=0):
    torch.manual_seed(seed)
    positions = torch.cat([torch.arange(n) for n in lengths])  # each request's positions, as vLLM flattens them
    request = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)])
    tokens = positions.numel()
    query = torch.randn(1, 4, tokens, 64, dtype=torch.float64)
    key, value = torch.randn(1, 2, tokens, 64, dtype=torch.float64), torch.randn(1, 2, tokens, 64, dtype=torch.float64)
    return (query.to(dtype), key.to(dtype), value.to(dtype)), positions, request


def _vllm_attention(query, key, value, positions, request, scale):
    # vLLM's ALiBi attention, causal within each request: scale q.k + m_h (j - i), in float64
    q, k, v = (x[0].double() for x in (query, key, value))
    k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)  # grouped query heads
    slopes = torch.tensor(SLOPES, dtype=torch.float64)[:, None, None]
    i, j = positions[:, None].double(), positions[None, :].double()
    scores = scale * q @ k.transpose(-1, -2) + slopes * (j - i)
    allowed = (request[:, None] == request[None, :]) & (positions[None, :] <= positions[:, None])
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v, allowed


def _with_sinks(query, key, value, positions, request, scale, sinks):
    # hf_alibi's bias with sinks, from its definition: -m_h (i - j), except 0 on keys j < sinks
    q, k, v = (x[0].double() for x in (query, key, value))
    k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
    slopes = torch.tensor(SLOPES, dtype=torch.float64)[:, None, None]
    i, j = positions[:, None].double(), positions[None, :].double()
    bias = torch.where(j < sinks, 0.0, -slopes * (i - j))
    scores = scale * q @ k.transpose(-1, -2) + bias
    allowed = (request[:, None] == request[None, :]) & (positions[None, :] <= positions[:, None])
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("dtype, sinks, atol", [(torch.float32, 1, 1e-5), (torch.float32, 3, 1e-5),
                                                (torch.bfloat16, 1, 2e-3)])  # fmt: skip
def test_vllms_attention_over_the_folded_heads_is_hf_alibis_attention_with_sinks(dtype, sinks, atol):
    lengths = [5, 300, 1200]  # long enough that a bias left in place moves the output
    (query, key, value), positions, request = _flattened(lengths, dtype)
    scale = 64**-0.5
    spec = SinkFold(SLOPES, sinks, scale, 64, padded_head_size(64, dtype))
    folded = fold(spec, query, key, value, positions[None])
    assert [t.shape[-1] for t in folded] == [80] * 3 and all(t.dtype == dtype for t in folded)
    # the fold's extra channels, as vLLM's kernel reads them (bf16 inputs, fp32 products), in float64 here
    got, allowed = _vllm_attention(*folded, positions, request, scale)
    want = _with_sinks(query, key, value, positions, request, scale, sinks)
    got = got[..., :64]
    assert (got - want).abs().max() < atol
    plain, _ = _vllm_attention(query, key, value, positions, request, scale)  # no fold: the sinks' keys penalised
    assert (plain - want).abs().max() > 100 * atol
    output = torch.cat([folded[0][0, h][:, None] for h in range(4)], dim=1).reshape(positions.numel(), -1)
    assert torch.equal(unfold(spec, output), torch.cat([query[0, h][:, None] for h in range(4)], 1).flatten(1))


def test_the_padded_head_and_its_channels():
    assert (channels(torch.float32), channels(torch.bfloat16), channels(torch.float16)) == (2, 6, 6)
    assert [padded_head_size(d, torch.float32) for d in (32, 64, 78, 96, 128, 256)] == [64, 80, 80, 112, 160, 512]
    with pytest.raises(ValueError, match="^hf_alibi: a head of 512 with the sinks' channels needs 514"):
        padded_head_size(512, torch.float32)
