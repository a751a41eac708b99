"""The CUDA kernels of the table on a real GPU (``pytest -m gpu``; tools/gpu_lease.sh runs this first): FA4's
ALiBi score_mod and the fold on cuDNN, forward and backward, against a float64 reference written here. Each test
skips cleanly without CUDA (and FA4's without flash-attn-4 or a Hopper / Blackwell GPU). The CPU checks of the same
argument building are tests/core/test_fa4_contract.py and tests/core/test_fold_cudnn.py."""

import importlib.util
import math

import pytest
import torch
from reference import fairseq_slopes
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_alibi.core.bias import AlibiBias
from hf_alibi.core.folded import CUDNN, folded_causal_attention

H, D = 4, 64
CUDA = torch.cuda.is_available()
HOPPER_OR_LATER = CUDA and torch.cuda.get_device_capability()[0] >= 9
FA4 = importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("cutlass") is not None


class Layer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.alibi = AlibiBias(kind, H)
        self.eval()


def reference(q, k, v, kind, key_real=None):
    """softmax(q k^T / sqrt(D) + bias) v, float64 ``(B, q, H, D)``; queries are the last q_len positions."""
    q_len, kv_len = q.shape[2], k.shape[2]
    i = torch.arange(kv_len - q_len, kv_len, dtype=torch.float64)[:, None]
    j = torch.arange(kv_len, dtype=torch.float64)[None, :]
    m = torch.tensor(fairseq_slopes(H), dtype=torch.float64)[:, None, None]
    bias = -m * (i - j).abs()
    if kind == "causal":
        bias = bias.masked_fill(j > i, -math.inf)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) / math.sqrt(D) + bias
    if key_real is not None:
        scores = scores.masked_fill(~key_real[:, None, None, :], -math.inf)
    return torch.einsum("bhqk,bhkd->bqhd", torch.softmax(scores, -1), v.double())


def leaves(batch, q_len, kv_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, q_len, D, generator=g)
    k, v = (torch.randn(batch, H, kv_len, D, generator=g) for _ in range(2))
    return [t.to(torch.bfloat16).cuda().requires_grad_() for t in (q, k, v)]


def check(out, q, k, v, kind, key_real=None):
    """bf16 output and gradients within bf16's rounding of the float64 reference's (relative to their largest)."""
    exact = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference(*exact, kind, None if key_real is None else key_real.cpu())
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    real = slice(None) if key_real is None else key_real.cpu()[:, :, None, None].expand_as(ref)
    assert (out.double().cpu() - ref)[real].abs().max() <= 2e-2 * ref.abs().max()
    out.double().backward(grad.cuda())
    ref.backward(grad)
    for mine, theirs in zip((q, k, v), exact):
        assert (mine.grad.double().cpu() - theirs.grad).abs().max() <= 3e-2 * theirs.grad.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not (FA4 and HOPPER_OR_LATER), reason="needs flash-attn-4 and a Hopper or Blackwell GPU")
@pytest.mark.parametrize("kind", ["causal", "symmetric"])
@pytest.mark.parametrize("length", [128, 1000])
def test_fa4_forward_and_backward_against_float64(kind, length):
    q, k, v = leaves(2, length, length)
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_flash_attention_4"](Layer(kind).cuda(), q, k, v, None, scaling=D**-0.5)
    check(out, q, k, v, kind)


@pytest.mark.gpu
@pytest.mark.skipif(not (FA4 and HOPPER_OR_LATER), reason="needs flash-attn-4 and a Hopper or Blackwell GPU")
def test_fa4_left_padding_and_a_kv_cache():
    q, k, v = leaves(2, 300, 300)
    padding = torch.ones(2, 300, dtype=torch.long, device="cuda")
    padding[1, :37] = 0
    layer = Layer("causal").cuda()
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_flash_attention_4"](layer, q, k, v, padding, scaling=D**-0.5)
    row = reference(*(t.detach()[1:, :, 37:].cpu() for t in (q, k, v)), "causal")
    assert (out[1:, 37:].double().cpu() - row).abs().max() <= 2e-2 * row.abs().max()
    chunk = [t.detach() for t in leaves(1, 5, 300, seed=2)]  # 5 queries after a cache of 295 keys
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_flash_attention_4"](layer, *chunk, None, scaling=D**-0.5)
    ref = reference(*(t.cpu() for t in chunk), "causal")
    assert (out.double().cpu() - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("length", [128, 2048])
def test_fold_on_cudnn_forward_and_backward_against_float64(length):
    q, k, v = leaves(2, length, length)
    slopes = torch.tensor(fairseq_slopes(H), device="cuda")
    out, _ = folded_causal_attention(None, q, k, v, None, slopes, scaling=D**-0.5, construction=CUDNN)
    check(out, q, k, v, "causal")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("batch", "path"), [(1, "bias"), (8, "folded")])
def test_auto_counts_the_batch_on_cuda(batch, path):
    """2048 tokens: one row is the bias path's side of the choice, eight rows (4x the scores of 4096 x 4096) the
    fold's; both exact against float64."""
    q, k, v = leaves(batch, 2048, 2048)
    layer = Layer("causal").cuda()
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_sdpa"](layer, q, k, v, None, scaling=D**-0.5)
    assert layer.alibi.last_path == path
    check(out, q, k, v, "causal")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cudnn_is_the_automatic_fold_in_bf16_and_really_runs_cudnn():  # 8192 queries: the fold's side of the choice
    """The automatic choice on this GPU, and that SDPA under it runs cuDNN's kernel (not a fallback): the profiler's
    kernel names."""
    q, k, v = (t.detach() for t in leaves(1, 8192, 8192))  # past 4096 x 4096 scores: "auto" folds on CUDA
    layer = Layer("causal").cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        ALL_ATTENTION_FUNCTIONS["alibi_sdpa"](layer, q, k, v, None, scaling=D**-0.5)
        torch.cuda.synchronize()
    names = " ".join(event.name for event in profile.events()).lower()
    assert layer.alibi.last_path == "folded"
    assert "cudnn" in names or "fmha" in names, names[:2000]
