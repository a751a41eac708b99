"""The SDPA and eager ALiBi attention paths against a float64 reference: values and gradients, padding, KV cache.

Paths: sdpa "folded" (causal bias folded into q/k, SDPA's causal kernel), sdpa "bias" and eager
(one float mask shared by the layers); FlexAttention and flash-attn against the same reference in
tests/core/test_attention_flex_flash.py. Tolerances: fp32 1e-4 absolute; bf16 / fp16 relative to the
largest output, 2e-2 (bf16 keeps 8 mantissa bits) and 4e-3 (fp16).
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import fairseq_slopes
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.core.bias import BIAS, FOLDED, AlibiBias
from hf_alibi.core.dispatch import FOLD_MIN_QUERIES, PATH_ENV
from hf_alibi.core.forward import AlibiForward

H, D = 4, 16
LENGTHS = [1, 7, 64, 1000]
NEG = -math.inf


class Layer(nn.Module):
    """What transformers' attention functions read from a layer: ``alibi``, ``is_causal``, ``training``."""

    def __init__(self, kind: str, path: str = "auto"):
        super().__init__()
        self.alibi = AlibiBias(kind, H, path=path)
        self.is_causal = kind == "causal"
        self.eval()


def reference_bias(kind, q_len, kv_len, left, right=None):
    """(H, q, kv) float64, written from the definitions; queries are the last q_len positions."""
    i = torch.arange(kv_len - q_len, kv_len, dtype=torch.float64)[:, None]
    j = torch.arange(kv_len, dtype=torch.float64)[None, :]
    d = (i - j)[None]  # (1, q, kv)
    if kind == "learned":
        left, right = left.double()[:, None, None], right.double()[:, None, None]
        return torch.where(d >= 0, left * d, right * -d)
    m = torch.tensor(fairseq_slopes(H), dtype=torch.float64)[:, None, None]
    bias = (-m * d.abs()).expand(H, q_len, kv_len)
    if kind == "causal":
        return bias.masked_fill(d < 0, NEG)
    if kind == "nonsymmetric":
        first = torch.arange(H)[:, None, None] < H // 2
        bad = torch.where(first, d < 0, d > 0)
        return bias.masked_fill(bad, NEG)
    return bias


def reference_output(q, k, v, bias, scaling, key_real):
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scaling + bias
    scores = scores.masked_fill(~key_real[:, None, None, :], NEG)
    # a padded query may see no key at all: give it a finite row (its output is never compared)
    scores = torch.where(torch.isinf(scores).all(-1, keepdim=True), 0.0, scores)
    return torch.einsum("bhqk,bhkd->bqhd", torch.softmax(scores, -1), v.double())  # (B, q, H, D)


def make_inputs(q_len, kv_len, dtype, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, q_len, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, H, kv_len, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, H, kv_len, D, generator=g).to(dtype).requires_grad_()
    key_real = torch.ones(2, kv_len, dtype=torch.bool)
    if pad:
        key_real[0, : min(3, kv_len - 1)] = False  # left padding of the first example
    return q, k, v, key_real


def transformers_mask(kind, q_len, kv_len, key_real, backend, pad, dtype):
    """The mask transformers would hand the layer: None when it can (sdpa), else bool or additive."""
    if backend == "sdpa" and not pad and (q_len == 1 or q_len == kv_len):
        return None
    allowed = key_real[:, None, None, :].expand(2, 1, q_len, kv_len)
    if kind == "causal":
        i = torch.arange(kv_len - q_len, kv_len)[:, None]
        allowed = allowed & (torch.arange(kv_len)[None, :] <= i)
    if backend == "eager":
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def real_rows(q_len, kv_len, key_real):
    """Queries that are real tokens: (B, q) bool (padded queries have no defined output)."""
    return key_real[:, kv_len - q_len :]


def run(backend, layer, q, k, v, mask, scaling, forward=None):
    """One attention call; ``forward``: the AlibiForward a model's forward would pass its layers (None: none)."""
    fn = ALL_ATTENTION_FUNCTIONS[f"alibi_{backend}"]
    out, _ = fn(
        layer, q, k, v, mask, scaling=scaling, dropout=0.0, **({} if forward is None else {"alibi_forward": forward})
    )
    return out


def check_against_reference(backend, kind, path, q_len, kv_len, dtype, pad, grads=True):
    layer = Layer(kind, path=path)
    q, k, v, key_real = make_inputs(q_len, kv_len, dtype, pad)
    scaling = D**-0.5
    mask = transformers_mask(kind, q_len, kv_len, key_real, backend, pad, dtype)
    out = run(backend, layer, q, k, v, mask, scaling)
    if kind == "learned":
        left, right = (s.detach() for s in layer.alibi.learned_slopes())
        bias = reference_bias(kind, q_len, kv_len, left, right)
    else:
        bias = reference_bias(kind, q_len, kv_len, None)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_output(*leaves, bias, scaling, key_real)
    rows = real_rows(q_len, kv_len, key_real)[:, :, None, None].expand_as(ref)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * rows
    if dtype == torch.float32:
        tol = dict(rtol=0, atol=1e-4)
    else:
        scale = ref[rows].abs().max().item()
        tol = dict(rtol=0, atol=(2e-2 if dtype == torch.bfloat16 else 4e-3) * scale)
    torch.testing.assert_close(out.double()[rows], ref.detach()[rows], **tol)
    if grads:
        (out.double() * weight).sum().backward()
        (ref * weight).sum().backward()
        for mine, theirs in zip((q, k, v), leaves):
            scale = max(theirs.grad.abs().max().item(), 1.0)
            atol = 1e-4 * scale if dtype == torch.float32 else (3e-2 if dtype == torch.bfloat16 else 6e-3) * scale
            torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=0, atol=atol)
    return layer


def shapes(length):
    """(q_len, kv_len): a full prefill, then one decoding step and a chunk against a cache."""
    out = [(length, length), (1, length)]
    if length > 5:
        out.append((5, length))
    return out


SDPA_CASES = [("sdpa", FOLDED), ("sdpa", BIAS), ("eager", BIAS)]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("backend,path", SDPA_CASES)
@pytest.mark.parametrize("pad", [False, True])
def test_causal_paths_match_reference_fp32(backend, path, length, pad):
    for q_len, kv_len in shapes(length):
        if backend == "sdpa" and not pad and 1 < q_len < kv_len:
            continue  # transformers never gives sdpa this without a mask (see the static cache test)
        layer = check_against_reference(backend, "causal", path, q_len, kv_len, torch.float32, pad)
        assert layer.alibi.last_path == path


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_causal_half_precision_matches_reference(backend, dtype, length):
    for q_len, kv_len in shapes(length):
        layer = check_against_reference(backend, "causal", "auto", q_len, kv_len, dtype, pad=True, grads=length < 1000)
        folds = backend == "sdpa" and q_len >= FOLD_MIN_QUERIES  # the half-precision fold (test_folded_half.py)
        assert layer.alibi.last_path == (FOLDED if folds else BIAS)


@pytest.mark.parametrize("kind", ["symmetric", "nonsymmetric", "learned"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bidirectional_paths_match_reference(kind, backend, length, dtype):
    if length == 1000 and backend == "eager":
        pytest.skip("eager shares the bias code with sdpa, checked at 1000; kept short for the suite's time")
    for pad in (False, True):
        layer = check_against_reference(backend, kind, "auto", length, length, dtype, pad)
        assert layer.alibi.last_path == BIAS


def test_learned_slopes_get_their_gradient():
    layer = Layer("learned")
    q, k, v, key_real = make_inputs(7, 7, torch.float32, pad=False)
    run("sdpa", layer, q, k, v, None, D**-0.5).square().sum().backward()
    left = layer.alibi.slopes_left.detach().clone().requires_grad_()
    right = layer.alibi.slopes_right.detach().clone().requires_grad_()
    bias = reference_bias("learned", 7, 7, -torch.sigmoid(left), -torch.sigmoid(right))
    reference_output(q.detach(), k.detach(), v.detach(), bias, D**-0.5, key_real).square().sum().backward()
    torch.testing.assert_close(layer.alibi.slopes_left.grad, left.grad.float(), rtol=0, atol=1e-4)
    torch.testing.assert_close(layer.alibi.slopes_right.grad, right.grad.float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["causal", "symmetric"])
def test_half_precision_at_16k_tokens_does_not_overflow(kind, dtype):
    # 16 queries against 16384 keys: biases down to -0.5 * 16383, inside fp16's range, built in fp32.
    q_len, kv_len = 16, 16384
    layer = Layer(kind)
    layer.alibi = AlibiBias(kind, 8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, D, generator=g).to(dtype) for n in (q_len, kv_len, kv_len))
    mask = None
    if kind == "causal":  # a cache: the queries are the last 16 positions
        mask = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    out = run("sdpa", layer, q, k, v, mask, D**-0.5).double()
    i = torch.arange(kv_len - q_len, kv_len, dtype=torch.float64)[:, None]
    d = i - torch.arange(kv_len, dtype=torch.float64)[None]
    bias = -torch.tensor(fairseq_slopes(8), dtype=torch.float64)[:, None, None] * d.abs()
    if kind == "causal":
        bias = bias.masked_fill(d < 0, NEG)
    ref = reference_output(q, k, v, bias, D**-0.5, torch.ones(1, kv_len, dtype=torch.bool))
    assert torch.isfinite(out).all()
    limit = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert (out - ref).abs().max() <= limit * ref.abs().max()


def test_decoding_steps_past_the_kept_row_match_reference():
    # a decoding step's bias is a view of one row per slopes and device (mask.decoding_row), 1024 keys at
    # first and grown as needed: steps past it, back below it, under inference mode and then with gradients
    layer = Layer("causal")
    scaling = D**-0.5
    for kv_len, dtype, inference in [(3000, torch.float32, True), (5, torch.float32, False),
                                     (2100, torch.bfloat16, False), (6500, torch.float32, False)]:  # fmt: skip
        q, k, v, key_real = make_inputs(1, kv_len, dtype, pad=False, seed=kv_len)
        with torch.inference_mode(inference):
            out = run("sdpa", layer, q, k, v, None, scaling)
        assert layer.alibi.last_path == BIAS
        bias = reference_bias("causal", 1, kv_len, None)
        ref = reference_output(q.detach(), k.detach(), v.detach(), bias, scaling, key_real)
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
        if not inference:  # the kept row was made outside inference mode: it can be saved for backward
            out.float().sum().backward()
            assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_kv_heads_match_reference(backend, q_len):
    # two query heads per KV head: one decoding query packs each group's heads as its queries (sdpa), a chunk
    # repeats the KV heads; the reference repeats them by hand
    kv_len, scaling = 40, D**-0.5
    q, k, v, key_real = make_inputs(q_len, kv_len, torch.float32, pad=True)
    k_grouped, v_grouped = k.detach()[:, ::2].requires_grad_(), v.detach()[:, ::2].requires_grad_()
    mask = transformers_mask("causal", q_len, kv_len, key_real, backend, True, torch.float32)
    out = run(backend, Layer("causal"), q, k_grouped, v_grouped, mask, scaling)
    repeat = lambda t: t.detach().double().repeat_interleave(2, dim=1)  # noqa: E731  (head h reads KV head h // 2)
    bias = reference_bias("causal", q_len, kv_len, None)
    ref = reference_output(q.detach(), repeat(k_grouped), repeat(v_grouped), bias, scaling, key_real)
    rows = real_rows(q_len, kv_len, key_real)
    torch.testing.assert_close(out.double()[rows], ref[rows], rtol=0, atol=1e-4)


def test_sdpa_refuses_a_soft_cap():
    q, k, v, _ = make_inputs(4, 4, torch.float32, pad=False)
    layer = Layer("causal", path=BIAS)
    with pytest.raises(ValueError, match="sdpa cannot soft-cap"):
        ALL_ATTENTION_FUNCTIONS["alibi_sdpa"](layer, q, k, v, None, scaling=0.25, softcap=30.0)


# ---------------------------------------------------------------------------------------------
# The automatic choice, asserted on the path taken.


def test_auto_picks_folded_where_exact_and_bias_elsewhere(monkeypatch):
    n = FOLD_MIN_QUERIES
    q, k, v, key_real = make_inputs(n, n, torch.float32, pad=True)
    bool_mask = transformers_mask("causal", n, n, key_real, "sdpa", True, torch.float32)
    cases = [
        ("causal", "sdpa", torch.float32, None, FOLDED),
        ("causal", "sdpa", torch.float32, bool_mask, FOLDED),  # padding: a mask SDPA handles as it is
        ("causal", "sdpa", torch.float64, None, FOLDED),
        ("causal", "sdpa", torch.bfloat16, None, FOLDED),  # half precision: see test_folded_half.py
        ("causal", "sdpa", torch.float16, bool_mask, FOLDED),
        ("causal", "eager", torch.float32, None, BIAS),  # eager builds the scores anyway
        ("symmetric", "sdpa", torch.float32, None, BIAS),  # the fold is causal-only
        ("learned", "sdpa", torch.float32, None, BIAS),
    ]
    for kind, backend, dtype, mask, expected in cases:
        layer = Layer(kind)
        run(backend, layer, q.detach().to(dtype), k.detach().to(dtype), v.detach().to(dtype), mask, 0.25)
        assert layer.alibi.last_path == expected, (kind, backend, dtype, mask is None)
    layer = Layer("causal")
    run("sdpa", layer, q.detach()[:, :, -1:], k.detach(), v.detach(), None, 0.25)  # one decoding step
    assert layer.alibi.last_path == BIAS
    run("sdpa", layer, q.detach()[:, :, -(n - 1) :], k.detach(), v.detach(), bool_mask[:, :, 1:], 0.25)
    assert layer.alibi.last_path == BIAS  # a chunk of fewer than FOLD_MIN_QUERIES queries
    layer = Layer("causal")
    monkeypatch.setenv(PATH_ENV, "bias")
    run("sdpa", layer, q.detach(), k.detach(), v.detach(), None, 0.25)
    assert layer.alibi.last_path == BIAS
    layer.alibi.path = FOLDED  # the layer's own setting wins over the environment
    run("sdpa", layer, q.detach(), k.detach(), v.detach(), None, 0.25)
    assert layer.alibi.last_path == FOLDED


def test_forcing_folded_where_it_is_wrong_raises():
    for kind, dtype in [("causal", torch.bfloat16), ("symmetric", torch.float32)]:
        layer = Layer(kind, path=FOLDED)
        q, k, v, _ = make_inputs(4, 4, dtype, pad=False)
        allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)  # scores rounded to bf16: no fold
        try:
            with pytest.raises(ValueError, match="folded ALiBi path was forced but cannot run"):
                run("sdpa", layer, q, k, v, None, 0.25)
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    with pytest.raises(ValueError, match="path must be one of"):
        AlibiBias("causal", 4, path="fast")


def test_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv(PATH_ENV, "fastest")
    q, k, v, _ = make_inputs(4, 4, torch.float32, pad=False)
    with pytest.raises(ValueError, match=PATH_ENV):
        run("sdpa", Layer("causal"), q, k, v, None, 0.25)


# ---------------------------------------------------------------------------------------------
# One bias per forward, shared by every layer and the whole batch.


@pytest.mark.parametrize("kind", ["symmetric", "nonsymmetric"])
def test_bidirectional_bias_is_built_once_and_broadcast(kind):
    forward = AlibiForward()  # what one forward of a model hands its layers
    layers = [Layer(kind) for _ in range(3)]
    q, k, v, key_real = make_inputs(9, 9, torch.float32, pad=False)
    outs = [run("sdpa", layer, q, k, v, None, 0.25, forward) for layer in layers]
    assert forward.builds == 1
    (merged,) = (entry[1] for entry in forward.masks.values())
    assert merged.shape == (1, H, 9, 9)  # broadcast over the batch
    assert all(torch.equal(out, outs[0]) for out in outs)
    pad_mask = transformers_mask(kind, 9, 9, key_real, "sdpa", True, torch.float32)
    for layer in layers:  # a new mask object (a new forward): built once more, then shared again
        run("sdpa", layer, q, k, v, pad_mask, 0.25, forward)
    assert forward.builds == 2
    run("sdpa", layers[0], q[:, :, :5], k[:, :, :5], v[:, :, :5], None, 0.25, forward)  # another length
    assert forward.builds == 3
    run("sdpa", layers[0], q, k, v, None, 0.25)  # no forward passed: nothing shared, nothing kept
    assert forward.builds == 3


def test_a_layer_set_apart_chooses_on_its_own():
    # layers after the first of a forward reuse its bias-path mask without choosing again, but only layers with
    # the same path setting: one forced to the fold still folds, and each matches the reference
    forward = AlibiForward()
    layers = [Layer("causal", path=p) for p in (BIAS, FOLDED, "auto", BIAS)]
    q, k, v, key_real = make_inputs(1, 50, torch.float32, pad=False)
    ref = reference_output(q.detach(), k.detach(), v.detach(), reference_bias("causal", 1, 50, None), 0.25, key_real)
    for layer in layers:
        out = run("sdpa", layer, q.detach(), k.detach(), v.detach(), None, 0.25, forward)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)
    assert [layer.alibi.last_path for layer in layers] == [BIAS, FOLDED, BIAS, BIAS]
    assert forward.builds == 2  # the "bias" layers share one mask, the "auto" layer builds its own


def test_learned_slopes_are_never_shared():
    forward = AlibiForward()
    layers = [Layer("learned") for _ in range(2)]
    q, k, v, _ = make_inputs(6, 6, torch.float32, pad=False)
    a, b = (run("sdpa", layer, q, k, v, None, 0.25, forward) for layer in layers)
    assert forward.builds == 0 and not torch.equal(a, b)


def test_public_api_exposes_path_control():
    assert hf_alibi.AlibiBias is AlibiBias


def test_folded_channel_stays_within_1e_4_at_4096_tokens():
    # the fold's channel grows with position (fp32 rounding): 64 queries spread over 4096 keys, 8 heads
    heads, kv_len = 8, 4096
    layer = Layer("causal", path=FOLDED)
    layer.alibi = AlibiBias("causal", heads, path=FOLDED)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 64, generator=g) for n in (64, kv_len, kv_len))
    positions = torch.linspace(0, kv_len - 1, 64).long()
    mask = (torch.arange(kv_len)[None, :] <= positions[:, None])[None, None]
    with torch.no_grad():
        out = run("sdpa", layer, q, k, v, mask, 64**-0.5)
    d = positions[:, None].double() - torch.arange(kv_len)[None].double()
    bias = (-torch.tensor(fairseq_slopes(heads), dtype=torch.float64)[:, None, None] * d).masked_fill(d < 0, NEG)
    ref = reference_output(q, k, v, bias, 64**-0.5, torch.ones(1, kv_len, dtype=torch.bool))
    assert layer.alibi.last_path == FOLDED
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)
