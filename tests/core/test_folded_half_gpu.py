"""The half-precision fold and the other attention paths on CUDA (marker gpu; skipped without a CUDA GPU).

Against the float64 reference of ``tests/core/test_folded_half.py`` (its helpers, imported from there): the
channel construction under SDPA's flash kernel (no mask) and memory-efficient kernel (a padding mask), the fold's
gradients and the automatic choice between it and the bias path on CUDA, flash-attn's ``alibi_slopes`` through
``flash_attn_varlen_func`` with padding (skipped without flash-attn), and FlexAttention trained in fp32 / bf16.
"""

from __future__ import annotations

import pytest
import torch
from test_folded_half import FP16_ROUNDOFF, D, Layer, bias_path_rows, errors, folded, inputs, reference_rows, run_layer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_alibi.core.bias import BIAS, FOLDED
from hf_alibi.core.folded import fold_construction

# ---------------------------------------------------------------------------------------------
# CUDA: every GPU path (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1024, 16384])
def test_gpu_half_fold_runs_on_fast_kernels_and_matches_reference(dtype, length, monkeypatch):
    """The channel construction (forced: cuDNN's is the automatic one on CUDA) under SDPA's flash kernel (no mask)
    and its memory-efficient kernel (a padding mask): the padded head size must be one they accept, and the
    result as accurate as the bias path's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setenv("HF_ALIBI_FOLD", "channel")
    q, k, v = (t.cuda() for t in inputs(length, dtype, batch=2))
    assert fold_construction(q, None) == "channel"
    rows = torch.arange(length - 64, length)
    ref = reference_rows(*(t.cpu() for t in (q, k, v)), rows, D**-0.5)
    with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = folded(q, k, v)[:, rows.cuda()].cpu()
    key_real = torch.ones(2, length, dtype=torch.bool, device="cuda")
    key_real[0, :100] = False
    mask = (torch.ones(length, length, dtype=torch.bool, device="cuda").tril()[None] & key_real[:, None, :])[:, None]
    with torch.no_grad(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        masked = folded(q, k, v, mask=mask)[:, rows.cuda()].cpu()
    ref_masked = reference_rows(*(t.cpu() for t in (q, k, v)), rows, D**-0.5, key_real=key_real.cpu())
    bias = bias_path_rows(*(t.cpu() for t in (q, k, v)), [length], 64)
    tol = 2.0**-8 if dtype == torch.bfloat16 else FP16_ROUNDOFF
    assert errors(out, ref)[0] <= max(tol, errors(bias, ref)[0])
    assert errors(masked, ref_masked)[0] <= tol


@pytest.mark.gpu
@cuda
def test_gpu_half_fold_gradients_and_auto_choice():
    """The fold's gradients on CUDA against float64 (forced at 512 queries, where "auto" takes the bias path), and
    the automatic choice there: the bias path up to 4096 x 4096 scores a head, the fold beyond (H200 timings)."""
    with torch.no_grad():
        for length, path in ((512, BIAS), (4096, BIAS), (4097, FOLDED)):
            auto = Layer().cuda()
            run_layer(auto, *(t.cuda() for t in inputs(length, torch.bfloat16)), None)
            assert auto.alibi.last_path == path, length
    layer = Layer(path=FOLDED).cuda()
    q, k, v = (t.cuda().requires_grad_() for t in inputs(512, torch.bfloat16, batch=2))
    out = run_layer(layer, q, k, v, None)
    assert layer.alibi.last_path == FOLDED
    out.float().square().sum().backward()
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    reference_rows(*leaves, torch.arange(512), D**-0.5).square().sum().backward()
    for mine, theirs in zip((q, k, v), leaves):
        scale = theirs.grad.abs().max().item()
        assert (mine.grad.cpu().double() - theirs.grad).abs().max().item() <= 3e-2 * scale


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(not _flash_attn_installed(), reason="needs flash-attn")
def test_gpu_flash_varlen_with_padding_matches_reference():
    """flash-attn's ``alibi_slopes`` through ``flash_attn_varlen_func`` (a 2D padding mask)."""
    length = 300
    layer = Layer().cuda()
    q, k, v = (t.cuda().requires_grad_() for t in inputs(length, torch.bfloat16, batch=2))
    padding = torch.ones(2, length, dtype=torch.long, device="cuda")
    padding[0, :50] = 0  # left padding of the first example
    out = ALL_ATTENTION_FUNCTIONS["alibi_flash_attention_2"](layer, q, k, v, padding, scaling=D**-0.5, dropout=0.0)[0]
    assert layer.alibi.last_path == "flash"
    key_real = padding.bool().cpu()
    ref = reference_rows(*(t.detach().cpu() for t in (q, k, v)), torch.arange(length), D**-0.5, key_real=key_real)
    rows = key_real[:, :, None, None].expand_as(ref)
    assert (out.detach().cpu().double() - ref)[rows].abs().max() <= 2.0**-8 * ref[rows].abs().max() * 4
    (out.float() * rows.cuda()).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_flex_trains_and_matches_reference(dtype):
    layer = Layer().cuda()
    q, k, v = (t.cuda().requires_grad_() for t in inputs(256, dtype, batch=2))
    out = ALL_ATTENTION_FUNCTIONS["alibi_flex_attention"](layer, q, k, v, None, scaling=D**-0.5, dropout=0.0)[0]
    assert layer.alibi.last_path == "flex"
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = reference_rows(*leaves, torch.arange(256), D**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2.0**-7
    assert errors(out.detach().cpu(), ref.detach())[0] <= tol
    out.float().square().sum().backward()
    ref.square().sum().backward()
    for mine, theirs in zip((q, k, v), leaves):
        scale = theirs.grad.abs().max().item()
        assert (mine.grad.cpu().double() - theirs.grad).abs().max().item() <= (1e-3 if tol < 1e-3 else 3e-2) * scale
