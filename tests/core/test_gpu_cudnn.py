"""cuDNN's fused ALiBi (attn_implementation "cudnn", hf_alibi/core/cudnn.py) on a real GPU (``pytest -m gpu``), against
a float64 reference written here: forward and backward, grouped KV heads, fp16, lengths that are not a multiple of 64,
right-padded rows, dropout's statistics and its reproducibility for a seed, torch.compile(fullgraph=True). Each test
skips cleanly without CUDA or without nvidia-cudnn-frontend. The CPU checks of the same code are
tests/core/test_cudnn_contract.py (through a stand-in of the frontend)."""

import importlib.util
import math

import pytest
import torch
from reference import fairseq_slopes
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_alibi.core.bias import AlibiBias

CUDA = torch.cuda.is_available()
FRONTEND = importlib.util.find_spec("cudnn") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA and FRONTEND), reason="needs a CUDA GPU and nvidia-cudnn-frontend (.[cuda])"),
]
D = 64


class Layer(nn.Module):
    def __init__(self, heads, training=False):
        super().__init__()
        self.alibi = AlibiBias("causal", heads)
        self.training = training


def reference(q, k, v, lengths=None, keep=None, p=0.0):
    """float64 ``(B, L, H, D)``: softmax(q k^T / sqrt(D) - m_h (i - j)) v, causal, keys past ``lengths`` masked,
    padded query rows zero; ``keep`` (B, H, L, L) a dropout mask applied as ``keep / (1 - p)``."""
    heads, length = q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    i = torch.arange(length, dtype=torch.float64, device=q.device)[:, None]
    j = torch.arange(length, dtype=torch.float64, device=q.device)[None, :]
    m = torch.tensor(fairseq_slopes(heads), dtype=torch.float64, device=q.device)[:, None, None]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1]) - m * (i - j)
    scores = scores.masked_fill(j > i, -math.inf)
    real = torch.ones(q.shape[0], length, dtype=torch.bool, device=q.device)
    if lengths is not None:
        real = torch.arange(length, device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None]
        scores = scores.masked_fill(~real[:, None, None, :], -math.inf)
    weights = torch.softmax(scores, dim=-1)
    if keep is not None:
        weights = weights * keep / (1 - p)
    out = torch.einsum("bhqk,bhkd->bqhd", weights, v)
    return out.masked_fill(~real[:, :, None, None], 0.0)


def leaves(batch, length, heads, kv_heads, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, D, generator=g)
    k, v = (torch.randn(batch, kv_heads, length, D, generator=g) for _ in range(2))
    return [t.to(dtype).cuda().requires_grad_() for t in (q, k, v)]


def run(layer, q, k, v, mask=None, dropout=0.0):
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_cudnn"](layer, q, k, v, mask, scaling=D**-0.5, dropout=dropout)
    assert layer.alibi.last_path == "cudnn"
    return out


def check(out, q, k, v, lengths=None, keep=None, p=0.0, rounding=2e-2):
    """Output and gradients within the dtype's rounding of the float64 reference's (relative to their largest)."""
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*exact, lengths=lengths, keep=keep, p=p)
    assert (out.double() - ref).abs().max() <= rounding * ref.abs().max()
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).cuda()
    out.double().backward(grad)
    ref.backward(grad)
    for mine, theirs in zip((q, k, v), exact):
        assert torch.isfinite(mine.grad).all()
        assert (mine.grad.double() - theirs.grad).abs().max() <= 1.5 * rounding * theirs.grad.abs().max()


@pytest.mark.parametrize("length", [128, 1000])
def test_forward_and_backward_against_float64(length):
    q, k, v = leaves(2, length, 12, 12)
    check(run(Layer(12).cuda(), q, k, v), q, k, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grouped_kv_heads(dtype):
    q, k, v = leaves(2, 520, 8, 2, dtype)
    check(run(Layer(8).cuda(), q, k, v), q, k, v, rounding=2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_right_padded_rows():
    q, k, v = leaves(2, 300, 12, 4)
    padding = torch.ones(2, 300, dtype=torch.long, device="cuda")
    padding[1, 233:] = 0
    out = run(Layer(12).cuda(), q, k, v, padding)
    assert not out[1, 233:].any()
    check(out, q, k, v, lengths=[300, 233])


def even_weights(batch, heads, length):
    """Queries and keys whose scores cancel the bias's per-key part (q.k / sqrt(D) = -m_h j; -m_h i is one constant
    per row), so every row's weights are even over its keys: exact in fp16 for slopes that are powers of two (8 or 4
    heads) and keys below 2048 / (8 m_h)."""
    slopes = torch.tensor(fairseq_slopes(heads), dtype=torch.float64)[:, None]
    q = torch.zeros(batch, heads, length, D, dtype=torch.float16, device="cuda")
    k = torch.zeros_like(q)
    q[..., 0] = 1
    k[..., 0] = (-slopes * torch.arange(length) * math.sqrt(D)).to(q)
    return q, k


def dropout_mask(layer, heads, length, p, seed):
    """The graph's dropout mask for ``seed``: even weights over each row's keys and values an identity over the keys,
    so output[b, i, h, j] = keep[b, h, i, j] / ((i + 1) (1 - p))."""
    q, k = even_weights(1, heads, length)
    eye = torch.eye(length, D, dtype=torch.float16, device="cuda").expand(1, heads, length, D).contiguous()
    torch.manual_seed(seed)
    out = run(layer, q, k, eye, dropout=p).double()  # (1, L, H, D)
    rows = torch.arange(1, length + 1, dtype=torch.float64, device="cuda")[None, :, None, None]
    return (out * rows * (1 - p)).round().permute(0, 2, 1, 3)[..., :length]  # (1, H, L, L)


def test_dropout_is_exact_the_same_in_the_backward_and_reproduced_by_the_seed():
    p, heads, length = 0.1, 4, 64
    layer = Layer(heads, training=True).cuda()
    keep = dropout_mask(layer, heads, length, p, seed=7)
    assert set(keep.unique().tolist()) <= {0.0, 1.0} and not keep.triu(1).any()
    lower = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    assert abs(keep[:, :, lower].mean().item() - (1 - p)) < 0.03  # 4 x 2080 kept-or-dropped draws: 4.6 sigma
    assert torch.equal(dropout_mask(layer, heads, length, p, seed=7), keep)
    assert not torch.equal(dropout_mask(layer, heads, length, p, seed=8), keep)
    q, k, v = leaves(1, length, heads, heads, torch.float16)
    torch.manual_seed(7)  # the same seed: the same mask, on other inputs, forward and backward
    check(run(layer, q, k, v, dropout=p), q, k, v, keep=keep, p=p, rounding=4e-3)


def test_dropout_statistics_over_many_rows():
    """Even weights and values of one: query i's output is its kept share of i + 1 keys over 1 - p, of mean 1 and
    variance p / ((1 - p) (i + 1))."""
    p, heads, length = 0.1, 8, 512
    layer = Layer(heads, training=True).cuda()
    q, k = even_weights(8, heads, length)
    torch.manual_seed(0)
    out = run(layer, q, k, torch.ones_like(q), dropout=p)[..., 0].double()  # (B, L, H)
    rows = torch.arange(1, length + 1, dtype=torch.float64, device="cuda")[None, :, None]
    z = (out - 1) / torch.sqrt(p / ((1 - p) * rows))  # standardised over 32k rows: mean 0, variance 1
    assert abs(z.mean().item()) < 0.05 and abs(z.var().item() - 1) < 0.05


def test_compiled_fullgraph_equals_eager():
    q, k, v = leaves(2, 256, 8, 4)
    layer = Layer(8).cuda()
    compiled = torch.compile(lambda q, k, v: run(layer, q, k, v), fullgraph=True)
    a = run(layer, q, k, v)
    qc, kc, vc = (t.detach().clone().requires_grad_() for t in (q, k, v))
    b = compiled(qc, kc, vc)
    assert torch.equal(a, b)
    grad = torch.randn_like(a)
    a.backward(grad)
    b.backward(grad)
    for x, y in zip((q, k, v), (qc, kc, vc)):
        assert torch.equal(x.grad, y.grad)
