"""Flush-to-zero scoped to hf_alibi's attention kernels (hf_alibi/core/denormals.py): on inside the kernels,
forward and backward; the caller's thread and torch's worker threads read the same state afterwards as before;
results unchanged against float64 where ALiBi's far keys underflow.

The flush state of each thread is observed, not read from hf_alibi: a product of two float32 numbers whose
result is subnormal comes out 0 exactly on a thread that flushes. Computed by torch on a large tensor with two
intra-op threads, the first half of the result is the calling thread's and the second half a worker's.
"""

import pytest
import torch
from arch_cases import CASES
from sharing import torch_threads
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.core import denormals
from hf_alibi.core.bias import AlibiBias

needs_flush = pytest.mark.skipif(not denormals.available(), reason="needs x86-64 Linux with torch's GNU OpenMP")
TINY = torch.full((1 << 22,), 1e-20)  # TINY * TINY = 1e-40: subnormal in float32


def flushing_halves() -> tuple[bool, bool]:
    """(calling thread flushes, worker thread flushes), observed with torch's two intra-op threads."""
    product = (TINY * TINY).reshape(2, -1)
    return tuple(bool((half == 0).all()) for half in product)


@pytest.fixture
def two_threads():
    with torch_threads(2):  # given back on the skip too
        if flushing_halves() != (False, False):
            pytest.skip("this process already flushes subnormals")
        yield
        torch.set_flush_denormal(False)


def test_the_observation_tells_the_threads_apart(two_threads):
    torch.set_flush_denormal(True)  # torch's own switch: the calling thread only
    assert flushing_halves() == (True, False)
    torch.set_flush_denormal(False)
    assert flushing_halves() == (False, False)


class Probe(torch.autograd.Function):
    """Records what the threads flush while a kernel's forward and backward run."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        Probe.seen.append(("forward", flushing_halves()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Probe.seen.append(("backward", flushing_halves()))
        return grad


@needs_flush
def test_kernels_run_flushed_on_every_thread_forward_and_backward(two_threads):
    from hf_alibi.core.dispatch import FLUSH_MIN_QUERIES, _flushed_kernel

    q, k, v = (torch.randn(1, 2, FLUSH_MIN_QUERIES, 8, requires_grad=True) for _ in range(3))
    Probe.seen = []
    out, _ = _flushed_kernel(lambda q, k, v: (Probe.apply(q) + k + v, None), q, k, v)
    assert flushing_halves() == (False, False)  # restored after the forward
    out.sum().backward()
    assert flushing_halves() == (False, False)  # and after the backward
    assert Probe.seen == [("forward", (True, True)), ("backward", (True, True))]


@needs_flush
def test_decoding_steps_leave_the_state_alone(two_threads):
    # a few queries (decoding, small chunks): the flush would cost more than the subnormals it saves
    from hf_alibi.core.dispatch import FLUSH_MIN_QUERIES, _flushed_kernel

    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (FLUSH_MIN_QUERIES - 1, 64, 64))
    Probe.seen = []
    out, _ = _flushed_kernel(lambda q, k, v: (Probe.apply(q) + k[:, :, :1] + v[:, :, :1], None), q, k, v)
    out.sum().backward()
    assert Probe.seen == [("forward", (False, False)), ("backward", (False, False))]


@needs_flush
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("caller", ["plain", "caller flushes"])
def test_a_training_step_leaves_every_thread_as_it_was(two_threads, backend, caller):
    case = next(c for c in CASES if c.name == "llama")
    model = hf_alibi.patch_model(case.make(attn_implementation=backend)).train()
    if caller == "caller flushes":
        torch.set_flush_denormal(True)
    before = flushing_halves()
    ids = torch.randint(3, 90, (2, 64))  # 64 queries: the fold on sdpa
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        model.generate(ids[:1, :8], max_new_tokens=3, do_sample=False)  # decoding steps: the bias path
    assert flushing_halves() == before


def reference_rows(q, k, v, slopes, scaling):
    """softmax(q k^T * scaling - m (i - j)) v in float64, queries at the end of the keys, causal."""
    q_len, kv_len = q.shape[2], k.shape[2]
    i = torch.arange(kv_len - q_len, kv_len, dtype=torch.float64)[:, None]
    j = torch.arange(kv_len, dtype=torch.float64)[None, :]
    bias = -torch.tensor(slopes, dtype=torch.float64)[:, None, None] * (i - j)
    bias = bias.masked_fill(j > i, float("-inf"))
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scaling + bias
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), v.double())


class Layer(nn.Module):
    def __init__(self, path: str):
        super().__init__()
        self.alibi = AlibiBias("causal", 2, path=path, slopes=[0.5, 1.0])  # steep: far weights underflow


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("backend", "path"), [("sdpa", "folded"), ("sdpa", "bias"), ("eager", "bias")])
def test_steep_slopes_at_8k_keys_against_float64(backend, path, dtype):
    g = torch.Generator().manual_seed(0)
    q_len, kv_len, dim = 40, 8192, 16
    q = torch.randn(1, 2, q_len, dim, generator=g)
    k, v = (torch.randn(1, 2, kv_len, dim, generator=g) for _ in range(2))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    causal = (torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None])[None, None]
    layer = Layer(path)
    out, _ = ALL_ATTENTION_FUNCTIONS[f"alibi_{backend}"](layer, q, k, v, causal, scaling=dim**-0.5, dropout=0.0)
    assert layer.alibi.last_path == path
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_rows(*leaves, [0.5, 1.0], dim**-0.5).transpose(1, 2)
    if dtype == torch.bfloat16:
        tolerance = 2.0**-7 * ref.abs().max().item()  # bf16 rounds q, k, v and the output
    elif path == "folded":  # docs/attention.md: a score moves by at most 2u|b|, the output by 2 d max|v|
        tolerance = 2 * (2 * 2.0**-24 * 1.0 * (kv_len - 1) / 2) * v.abs().max().item()
    else:
        tolerance = 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tolerance)
    out.float().square().sum().backward()
    ref.square().sum().backward()
    for mine, theirs in zip((q, k, v), leaves):
        scale = theirs.grad.abs().max().item()
        limit = (1e-5 if path == "bias" else 2e-3) * max(scale, 1.0) if dtype == torch.float32 else 2.0**-5 * scale
        assert (mine.grad.double() - theirs.grad).abs().max().item() <= limit
