"""FlexAttention and flash-attn against the float64 reference of ``tests/core/test_attention_paths.py`` (its helpers).

FlexAttention (score_mod): the forward on CPU for every kind, with and without padding, the CPU's refusal to train
(it says what to do), and training on CUDA (marker gpu). flash-attn (CUDA only, marker gpu: skipped here): values and
gradients, causal and symmetric; without it, the error that says what to do. Tolerances: fp32 1e-4 absolute; bf16
2e-2 relative to the largest output.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_paths import (
    LENGTHS,
    D,
    Layer,
    make_inputs,
    real_rows,
    reference_bias,
    reference_output,
    run,
    shapes,
)

# ---------------------------------------------------------------------------------------------
# FlexAttention (forward on CPU) and flash-attn (CUDA).


@pytest.mark.parametrize("kind", ["causal", "symmetric", "nonsymmetric", "learned"])
@pytest.mark.parametrize("length", [1, 7, 64])
def test_flex_forward_matches_reference(kind, length):
    from torch.nn.attention.flex_attention import create_block_mask

    layer = Layer(kind)
    for pad in (False, True):
        q, k, v, key_real = make_inputs(length, length, torch.float32, pad)
        q, k, v = q.detach(), k.detach(), v.detach()

        def keep(b, h, q_idx, kv_idx, key_real=key_real):
            return key_real[b, kv_idx]

        block_mask = create_block_mask(keep, 2, None, length, length, device="cpu")
        with torch.no_grad():
            out = run("flex_attention", layer, q, k, v, block_mask, D**-0.5)
        if kind == "learned":
            bias = reference_bias(kind, length, length, *(s.detach() for s in layer.alibi.learned_slopes()))
        else:
            bias = reference_bias(kind, length, length, None)
        ref = reference_output(q, k, v, bias, D**-0.5, key_real)
        rows = real_rows(length, length, key_real)
        torch.testing.assert_close(out.double()[rows], ref[rows], rtol=0, atol=1e-4)
        assert layer.alibi.last_path == "flex"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_flex_training_on_cpu_says_what_to_do():
    q, k, v, _ = make_inputs(4, 4, torch.float32, pad=False)
    with pytest.raises(NotImplementedError, match="set_attn_implementation\\('sdpa'\\)"):
        run("flex_attention", Layer("causal"), q, k, v, None, 0.25)


def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_flash_available(), reason="checks the error without flash-attn")
def test_flash_without_flash_attn_says_what_to_do():
    q, k, v, _ = make_inputs(4, 4, torch.float32, pad=False)
    with pytest.raises((ImportError, RuntimeError), match="set_attn_implementation\\('sdpa'\\)"):
        run("flash_attention_2", Layer("causal"), q, k, v, None, 0.25)
    with pytest.raises(NotImplementedError, match="only causal and symmetric"):
        run("flash_attention_2", Layer("nonsymmetric"), q, k, v, None, 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_available(), reason="needs flash-attn and a CUDA GPU")
@pytest.mark.parametrize("kind", ["causal", "symmetric"])
@pytest.mark.parametrize("length", LENGTHS)
def test_flash_matches_reference_on_gpu(kind, length):
    layer = Layer(kind).cuda()
    for q_len, kv_len in shapes(length) if kind == "causal" else [(length, length)]:
        q, k, v, key_real = make_inputs(q_len, kv_len, torch.bfloat16, pad=False)
        q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
        out = run("flash_attention_2", layer, q, k, v, None, D**-0.5).double().cpu()
        ref = reference_output(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(),
                               reference_bias(kind, q_len, kv_len, None), D**-0.5, key_real.fill_(True))  # fmt: skip
        assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()
        out.sum().backward()
        assert torch.isfinite(q.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["causal", "symmetric"])
def test_flex_trains_on_gpu(kind):
    layer = Layer(kind).cuda()
    q, k, v, key_real = make_inputs(64, 64, torch.float32, pad=False)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    out = run("flex_attention", layer, qc, kc, vc, None, D**-0.5)
    ref = reference_output(q, k, v, reference_bias(kind, 64, 64, None), D**-0.5, key_real)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=0, atol=1e-4)
    out.double().sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(qc.grad.double().cpu(), q.grad.double(), rtol=0, atol=1e-4)
