"""The folded path in every float dtype: bf16 / fp16 with no L x L tensor, against float64.

Two constructions of the fold (``hf_alibi.core.folded.folded_causal_attention``): "row" (CPU: the
bias as a broadcast fp32 row inside the causal kernel) and "channel" (any SDPA kernel: the bias as
extra q/k channels, three half-precision parts in bf16 / fp16, head size padded to a multiple of 8).
Both are checked against a float64 reference written here from the definitions, and against the
bias path's own error on the same inputs: the fold must be at least as accurate as the bias path in
bf16, and within fp16's own rounding in fp16.

The reference sees q, k, v after their rounding to the test dtype, so every error measured is the
kernel's. Slopes come from fairseq's recursion (``tests/reference.py``); the 12-head set has slopes
that are not powers of two (0.7071...), which bf16 cannot hold exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import fairseq_slopes
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.core.bias import BIAS, FOLDED
from hf_alibi.core.dispatch import FOLD_MIN_QUERIES
from hf_alibi.core.folded import fold_construction, folded_causal_attention

NEG = -math.inf
D = 64
# 0.5, 0.7071 (not a power of two), 0.0884 (gentle, not a power of two) and 1/256 of the 12-head set:
# the steepest slopes make the largest |bias| (the fold's rounding), the others test bf16's rounding
SLOPES = [fairseq_slopes(12)[h] for h in (0, 8, 11, 7)]


class Layer(nn.Module):
    """What the attention functions read from a layer, with the slopes of ``SLOPES``."""

    def __init__(self, path: str = "auto", slopes=SLOPES, kind: str = "causal"):
        super().__init__()
        self.alibi = hf_alibi.AlibiBias(kind, len(slopes), path=path)
        fixed = torch.tensor(slopes, dtype=torch.float32)
        self.alibi.fixed_slopes = lambda device: fixed.to(device)  # this test's slopes, fp32 as the library's
        self.is_causal = kind == "causal"
        self.eval()


def reference_rows(q, k, v, rows, scaling, slopes=SLOPES, key_real=None):
    """float64 causal ALiBi attention for the query positions ``rows``: ``(B, len(rows), H, D)``."""
    i = rows.double()[:, None]
    j = torch.arange(k.shape[2], dtype=torch.float64)[None]
    m = torch.tensor(slopes, dtype=torch.float64)[:, None, None]
    bias = (-m * (i - j)).masked_fill(j > i, NEG)  # (H, q, kv)
    scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].double(), k.double()) * scaling + bias
    if key_real is not None:
        scores = scores.masked_fill(~key_real[:, None, None, :], NEG)
        # a padded query may see no key at all: give it a finite row (its output is never compared)
        scores = torch.where(torch.isinf(scores).all(-1, keepdim=True), 0.0, scores)
    return torch.einsum("bhqk,bhkd->bqhd", torch.softmax(scores, -1), v.double())


def inputs(length, dtype, heads=None, batch=1, seed=0):
    heads = len(SLOPES) if heads is None else heads
    g = torch.Generator().manual_seed(seed + length)
    return [torch.randn(batch, heads, length, D, generator=g).to(dtype) for _ in range(3)]


def folded(q, k, v, mask=None, construction=None, slopes=SLOPES, dropout=0.0):
    out, _ = folded_causal_attention(
        None,
        q,
        k,
        v,
        mask,
        torch.tensor(slopes, device=q.device),
        dropout=dropout,
        scaling=D**-0.5,
        construction=construction,
    )
    return out


def bias_path_rows(q, k, v, ends, chunk):
    """The bias path for the ``chunk`` queries ending at each of ``ends``, as transformers runs a
    chunked prefill (a causal bool mask); each row's arithmetic is that of a full prefill's row, whose
    (H, L, L) mask would not fit at 32k."""
    layer = Layer(BIAS)
    outs = []
    for end in ends:
        mask = (torch.arange(end)[None, :] <= torch.arange(end - chunk, end)[:, None])[None, None]
        with torch.no_grad():
            out, _ = ALL_ATTENTION_FUNCTIONS["alibi_sdpa"](
                layer, q[:, :, end - chunk : end], k[:, :, :end], v[:, :, :end], mask, scaling=D**-0.5, dropout=0.0
            )
        assert layer.alibi.last_path == BIAS
        outs.append(out)
    return torch.cat(outs, 1)


def errors(out, ref):
    """(max, rms) absolute error relative to the largest reference output."""
    diff = (out.double() - ref).abs()
    scale = ref.abs().max().item()
    return diff.max().item() / scale, diff.square().mean().sqrt().item() / scale


def accuracy(length, dtype, constructions=("row", "channel")):
    """Errors of each fold construction (a full causal prefill) and of the bias path, on 64 query
    rows: the last 16 of each quarter of the sequence."""
    q, k, v = inputs(length, dtype)
    chunk, ends = 16, [length // 4, length // 2, 3 * length // 4, length]
    rows = torch.cat([torch.arange(end - chunk, end) for end in ends])
    ref = reference_rows(q, k, v, rows, D**-0.5)
    result = {"bias": errors(bias_path_rows(q, k, v, ends, chunk), ref)}
    for construction in constructions:
        with torch.no_grad():
            out = folded(q, k, v, construction=construction)
        assert out.dtype == dtype and torch.isfinite(out).all()
        result[construction] = errors(out[:, rows], ref)
    return result


# fp16 keeps 11 bits: its unit roundoff, relative to the largest output
FP16_ROUNDOFF = 2.0**-11


def check_accuracy(length, dtype, constructions=("row", "channel")):
    result = accuracy(length, dtype, constructions)
    bias_max, bias_rms = result["bias"]
    for construction in constructions:
        fold_max, fold_rms = result[construction]
        if dtype == torch.bfloat16:  # at least as accurate as the bias path, by both measures
            assert fold_max <= bias_max * (1 + 1e-9), (construction, result)
            assert fold_rms <= bias_rms * (1 + 1e-9), (construction, result)
        else:  # within fp16's own rounding, and of the bias path's size (its |bias| rounding, 2u|b|)
            assert fold_max <= FP16_ROUNDOFF, (construction, result)
            assert fold_max <= 1.5 * bias_max and fold_rms <= 1.2 * bias_rms, (construction, result)
    return result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1024, 4096])
def test_half_fold_is_as_accurate_as_bias_path(length, dtype):
    check_accuracy(length, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [16384, 32768])
def test_half_fold_is_as_accurate_as_bias_path_long(length, dtype):
    check_accuracy(length, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_fold_at_16k_keys_steepest_slope(dtype):
    """The default tier's long check: the largest |bias| (slope 0.7071 at 16k keys), one head."""
    slopes = [SLOPES[1]]
    q, k, v = inputs(16384, dtype, heads=1)
    rows = torch.arange(16384 - 32, 16384)  # the last queries: |bias| = 0.7071 * 8191 at their keys
    ref = reference_rows(q, k, v, rows, D**-0.5, slopes=slopes)
    with torch.no_grad():
        out = folded(q, k, v, slopes=slopes)[:, rows]
    fold_max, _ = errors(out, ref)
    assert fold_max <= (2.0**-8 if dtype == torch.bfloat16 else FP16_ROUNDOFF)


def test_fp16_channel_stays_in_range_at_40k_keys():
    """fp16 ends at 65504; the channel ``m (j - c) / scaling`` reaches 0.7071 * 20000 * 8 = 113000 at
    40k keys: a power of two moves to the query side. 16 queries (a cache chunk with a bool mask,
    hence the channel construction) against 40000 keys."""
    kv_len, q_len = 40000, 16
    q, k, v = inputs(kv_len, torch.float16)
    q = q[:, :, -q_len:]
    mask = (torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None])[None, None]
    assert fold_construction(q, mask) == "channel"
    with torch.no_grad():
        out = folded(q, k, v, mask=mask)
    ref = reference_rows(torch.cat([k[:, :, : kv_len - q_len], q], 2), k, v, torch.arange(kv_len - q_len, kv_len),
                         D**-0.5)  # fmt: skip
    assert torch.isfinite(out).all()
    assert errors(out, ref)[0] <= FP16_ROUNDOFF


# ---------------------------------------------------------------------------------------------
# Gradients, padding, grouped KV heads, caches: the half fold against the reference and the bias path


def run_layer(layer, q, k, v, mask, dropout=0.0):
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_sdpa"](layer, q, k, v, mask, scaling=D**-0.5, dropout=dropout)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pad", [False, True])
def test_half_fold_gradients_match_reference(dtype, pad):
    length, batch = 300, 2
    key_real = torch.ones(batch, length, dtype=torch.bool)
    mask = None
    if pad:  # left padding of the first example: transformers' bool mask, hence the channel construction
        key_real[0, :40] = False
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        mask = (allowed[None] & key_real[:, None, :])[:, None]
    real_rows = key_real  # padded queries have no defined output
    results = {}
    for path in (FOLDED, BIAS):
        q, k, v = (t.requires_grad_() for t in inputs(length, dtype, batch=batch))
        layer = Layer(path)
        out = run_layer(layer, q, k, v, mask)
        assert layer.alibi.last_path == path
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) * real_rows[:, :, None, None]
        (out.float() * weight).sum().backward()
        results[path] = out.detach(), [t.grad.double() for t in (q, k, v)]
    leaves = [t.detach().double().requires_grad_() for t in inputs(length, dtype, batch=batch)]
    ref = reference_rows(*leaves, torch.arange(length), D**-0.5, key_real=key_real)
    ref = torch.where(real_rows[:, :, None, None], ref, 0.0)  # padded queries see nothing: 0, unweighted
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)) * real_rows[:, :, None, None]
    (ref * weight.double()).sum().backward()
    for path, (out, grads) in results.items():
        rows = real_rows[:, :, None, None].expand_as(ref)
        out_err = (out.double() - ref.detach())[rows].abs().max().item()
        grad_err = [
            (g - leaf.grad).abs().max().item() / leaf.grad.abs().max().item() for g, leaf in zip(grads, leaves)
        ]
        results[path] = out_err, max(grad_err)
    (fold_out, fold_grad), (bias_out, bias_grad) = results[FOLDED], results[BIAS]
    assert fold_out <= 1.5 * bias_out + 1e-6, results
    assert fold_grad <= 1.5 * bias_grad + 1e-6, results
    assert fold_grad <= (3e-2 if dtype == torch.bfloat16 else 6e-3), results


@pytest.mark.parametrize("construction", ["row", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kv_heads(construction, dtype):
    q = inputs(200, dtype)[0]
    k, v = inputs(200, dtype, heads=2, seed=1)[:2]
    with torch.no_grad():
        out = folded(q, k, v, construction=construction)
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))  # query heads 0, 1 share KV head 0
    ref = reference_rows(q, kk, vv, torch.arange(200), D**-0.5)
    assert errors(out, ref)[0] <= (1e-5 if dtype == torch.float32 else 2.0**-8)
    if dtype == torch.float32:  # the shared K/V heads get the gradients of both their query heads
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        folded(*leaves, construction=construction).square().sum().backward()
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        kk, vv = (t.repeat_interleave(2, dim=1) for t in ref_leaves[1:])
        reference_rows(ref_leaves[0], kk, vv, torch.arange(200), D**-0.5).square().sum().backward()
        for mine, theirs in zip(leaves, ref_leaves):
            torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=0, atol=1e-4 * theirs.grad.abs().max())


@pytest.mark.parametrize("construction", ["row", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_constructions_agree_with_reference_every_dtype(construction, dtype):
    q, k, v = inputs(130, dtype)  # a length that is no multiple of any block size
    with torch.no_grad():
        out = folded(q, k, v, construction=construction)
    ref = reference_rows(q, k, v, torch.arange(130), D**-0.5)
    # fp64: the slopes are fp32 (as the library keeps them), 0.7071 rounded at 2^-24 relative
    tol = {torch.float64: 1e-7, torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: FP16_ROUNDOFF}[dtype]
    assert out.dtype == dtype and errors(out, ref)[0] <= tol


def test_prefill_into_a_longer_cache_cuts_keys_like_transformers():
    """No mask and more keys than queries (prefill into an empty static cache): the keys past the
    queries are cut, as transformers' sdpa does, for both constructions."""
    q, k, v = inputs(96, torch.bfloat16)
    k_long, v_long = (torch.cat([t, torch.randn_like(t[:, :, :32])], 2) for t in (k, v))
    ref = reference_rows(q, k, v, torch.arange(96), D**-0.5)
    for construction in ("row", "channel"):
        with torch.no_grad():
            out = folded(q, k_long, v_long, construction=construction)
        assert errors(out, ref)[0] <= 2.0**-8


def test_dropout_takes_the_channel_construction_and_trains():
    """torch's CPU flash kernel has no dropout: with dropout the channel construction runs (SDPA's
    math kernel, which accumulates half precision in fp32)."""
    q, k, v = (t.requires_grad_() for t in inputs(64, torch.bfloat16))
    assert fold_construction(q, None, dropout=0.1) == "channel"
    assert fold_construction(q, None, dropout=0.0) == "row"
    torch.manual_seed(0)
    out = folded(q, k, v, dropout=0.1)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    with torch.no_grad():  # dropout 0 through the same construction equals the reference
        out = folded(q.detach(), k.detach(), v.detach(), construction="channel")
    assert errors(out, reference_rows(q.detach(), k.detach(), v.detach(), torch.arange(64), D**-0.5))[0] <= 2.0**-8


def test_row_construction_refuses_nothing_it_cannot_do():
    """The row construction given a mask (not the automatic choice) merges it and stays exact."""
    q, k, v = inputs(80, torch.float32)
    mask = torch.ones(80, 80, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out = folded(q, k, v, mask=mask, construction="row")
    assert errors(out, reference_rows(q, k, v, torch.arange(80), D**-0.5))[0] <= 1e-5
    with pytest.raises(ValueError, match="construction must be one of"):
        folded(q, k, v, construction="columns")


# ---------------------------------------------------------------------------------------------
# The automatic choice (docs/attention.md), asserted on the path taken: (backend, kind, dtype,
# queries, keys, mask, dropout) -> (path, fold construction)

N = FOLD_MIN_QUERIES
CHOICES = [
    # causal sdpa, >= 32 queries: the fold in every float dtype; "row" without a mask on CPU
    ("sdpa", "causal", torch.float32, N, N, False, 0.0, FOLDED, "row"),
    ("sdpa", "causal", torch.float64, N, N, False, 0.0, FOLDED, "row"),
    ("sdpa", "causal", torch.bfloat16, N, N, False, 0.0, FOLDED, "row"),
    ("sdpa", "causal", torch.float16, 4 * N, 4 * N, False, 0.0, FOLDED, "row"),
    # padding (transformers' bool mask) or a chunk against a cache: the channel construction
    ("sdpa", "causal", torch.float32, N, N, True, 0.0, FOLDED, "channel"),
    ("sdpa", "causal", torch.bfloat16, N, N, True, 0.0, FOLDED, "channel"),
    ("sdpa", "causal", torch.float16, N, 3 * N, True, 0.0, FOLDED, "channel"),
    # attention dropout: the CPU kernel has none, the channel construction goes through SDPA
    ("sdpa", "causal", torch.bfloat16, N, N, False, 0.1, FOLDED, "channel"),
    # fewer than 32 queries (decoding, small chunks): the bias, H x q x kv
    ("sdpa", "causal", torch.bfloat16, 1, 3 * N, False, 0.0, BIAS, None),
    ("sdpa", "causal", torch.float32, N - 1, 3 * N, True, 0.0, BIAS, None),
    # not causal, or not sdpa: the bias
    ("sdpa", "symmetric", torch.bfloat16, N, N, False, 0.0, BIAS, None),
    ("eager", "causal", torch.bfloat16, N, N, False, 0.0, BIAS, None),
]


@pytest.mark.parametrize("backend,kind,dtype,q_len,kv_len,masked,dropout,path,construction", CHOICES)
def test_auto_choice_table(backend, kind, dtype, q_len, kv_len, masked, dropout, path, construction):
    layer = Layer(kind=kind, slopes=SLOPES if kind == "causal" else fairseq_slopes(4))
    q = inputs(q_len, dtype, seed=2)[0]
    k, v = inputs(kv_len, dtype, seed=3)[:2]
    mask = None
    if masked:
        mask = (torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None])[None, None]
    elif backend == "eager":
        mask = torch.zeros(1, 1, q_len, kv_len, dtype=dtype).masked_fill(
            torch.ones(q_len, kv_len, dtype=torch.bool).tril().logical_not(), torch.finfo(dtype).min
        )
    if dropout:
        layer.train()
    with torch.no_grad():
        ALL_ATTENTION_FUNCTIONS[f"alibi_{backend}"](layer, q, k, v, mask, scaling=D**-0.5, dropout=dropout)
    assert layer.alibi.last_path == path
    if construction is not None:
        assert fold_construction(q, mask, dropout) == construction


def test_cuda_keeps_the_bias_path_while_it_is_the_faster():
    """On CUDA "auto" takes the bias path up to 4096 x 4096 scores a head over the whole batch and the fold beyond
    (what an H200 measured, docs/performance.md); on every other device the fold from 32 queries, as the table above
    says."""
    from hf_alibi.core.dispatch import cuda_prefers_bias

    assert cuda_prefers_bias("cuda", 4096, 4096) and cuda_prefers_bias("cuda", 1024, 1024)
    assert cuda_prefers_bias("cuda", 2048, 8192)  # a chunk against a cache: q x kv, not the longer side squared
    assert not cuda_prefers_bias("cuda", 4096, 4097) and not cuda_prefers_bias("cuda", 16384, 16384)
    assert not cuda_prefers_bias("cpu", 1024, 1024) and not cuda_prefers_bias("mps", 1024, 1024)
    # the batch counts: 8 rows of 1k are as many scores as 2 rows of 4k (bias), 8 rows of 4k the fold's side
    assert cuda_prefers_bias("cuda", 1024, 1024, batch=8) and cuda_prefers_bias("cuda", 4096, 4096, batch=1)
    assert not cuda_prefers_bias("cuda", 4096, 4096, batch=2) and not cuda_prefers_bias("cuda", 2048, 2048, batch=8)


def test_half_fold_refused_when_sdpa_may_reduce_in_half_precision():
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        layer = Layer()
        q, k, v = inputs(N, torch.bfloat16)
        with torch.no_grad():
            run_layer(layer, q, k, v, None)
        assert layer.alibi.last_path == BIAS
        fp32 = Layer()
        with torch.no_grad():
            run_layer(fp32, *inputs(N, torch.float32), None)
        assert fp32.alibi.last_path == FOLDED  # fp32 is not affected
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


# ---------------------------------------------------------------------------------------------
# A real model in bf16: a training step on the fold equals the bias path's


def test_gpt2_bf16_training_step_fold_equals_bias_path():
    from tiny import random_ids, tiny_gpt2

    model = hf_alibi.patch_model(tiny_gpt2()).to(torch.bfloat16)
    ids = random_ids(2, 96)
    results = {}
    for path in (FOLDED, BIAS):
        hf_alibi.set_attention_path(model, path)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        assert {block.attn.alibi.last_path for block in model.transformer.h} == {path}
        results[path] = out.loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()}
    (loss_f, grads_f), (loss_b, grads_b) = results[FOLDED], results[BIAS]
    assert abs(loss_f - loss_b) <= 2e-2 * abs(loss_b)
    for name, grad in grads_f.items():
        scale = grads_b[name].abs().max().item() + 1e-3
        assert (grad - grads_b[name]).abs().max().item() <= 0.1 * scale, name


# the accuracy table in docs/attention.md: PYTHONPATH=tests python tests/core/test_folded_half.py
if __name__ == "__main__":
    print("| L | dtype | fold (row) max / rms | fold (channel) max / rms | bias path max / rms |")
    print("|---|---|---|---|---|")
    for length in (1024, 4096, 16384, 32768):
        for dtype in (torch.bfloat16, torch.float16):
            found = accuracy(length, dtype)
            cells = " | ".join(f"{found[k][0]:.2e} / {found[k][1]:.2e}" for k in ("row", "channel", "bias"))
            print(f"| {length} | {str(dtype).removeprefix('torch.')} | {cells} |", flush=True)
