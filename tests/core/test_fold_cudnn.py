"""The fold on cuDNN's attention (``folded.py``'s "cudnn" construction): the channel construction's q/k head of
64 + 3 channels padded to 72, with values left at 64, run with ``SDPBackend.CUDNN_ATTENTION`` first. On the CPU the
construction's arguments are checked (what SDPA receives, under which kernels) and its output against a float64
reference written here (torch's math kernel runs it: cuDNN is a CUDA kernel); the choice by device, dtype, mask and
head size through a stand-in for the query. The real kernel runs under ``pytest -m gpu`` (test_gpu_kernels.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
from reference import fairseq_slopes
from torch.nn.attention import SDPBackend

from hf_alibi.core import folded
from hf_alibi.core.folded import CUDNN, FOLD_ENV, cudnn_fold_available, fold_construction, folded_causal_attention

H, D = 4, 64
SLOPES = fairseq_slopes(H)


def reference(q, k, v, scaling):
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    m = torch.tensor(SLOPES, dtype=torch.float64)[:, None, None]
    bias = (-m * (i - j)).masked_fill(j > i, -math.inf)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scaling + bias
    return torch.einsum("bhqk,bhkd->bqhd", torch.softmax(scores, -1), v.double())


def test_cudnn_construction_hands_sdpa_unpadded_values_and_matches_the_reference(monkeypatch):
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        seen.append((query.shape[-1], key.shape[-1], value.shape[-1], torch._C._get_sdp_priority_order()))
        return original(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 48, D, generator=g).to(torch.bfloat16) for _ in range(3))
    out, _ = folded_causal_attention(None, q, k, v, None, torch.tensor(SLOPES), scaling=D**-0.5, construction=CUDNN)
    ((q_head, k_head, v_head, order),) = seen
    assert (q_head, k_head, v_head) == (72, 72, 64)  # 64 + 3 bf16 channels, to a multiple of 8; values untouched
    assert order[0] == int(SDPBackend.CUDNN_ATTENTION)
    ref = reference(q, k, v, D**-0.5)
    assert (out.double() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()  # bf16 output rounding


def fake_query(device="cuda", dtype=torch.bfloat16, head=64):
    return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, H, 128, head))


def test_cudnn_is_chosen_on_cuda_in_half_precision_without_a_mask(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.delenv(FOLD_ENV, raising=False)
    assert cudnn_fold_available(fake_query(), None, 0.0)
    assert fold_construction(fake_query(), None) == CUDNN
    assert fold_construction(fake_query(dtype=torch.float16), None) == CUDNN
    # not: fp32, a mask, dropout, a head past cuDNN's widest, the CPU, cuDNN's attention switched off
    assert fold_construction(fake_query(dtype=torch.float32), None) == "channel"
    assert fold_construction(fake_query(), torch.ones(1, dtype=torch.bool)) == "channel"
    assert fold_construction(fake_query(), None, dropout=0.1) == "channel"
    assert fold_construction(fake_query(head=128), None) == "channel"
    assert not cudnn_fold_available(fake_query(device="cpu"), None, 0.0)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert fold_construction(fake_query(), None) == "channel"


def test_the_environment_forces_a_construction_where_it_can_run(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setenv(FOLD_ENV, "channel")
    assert fold_construction(fake_query(), None) == "channel"  # the benchmark's fold on SDPA's flash kernel
    monkeypatch.setenv(FOLD_ENV, "cudnn")
    assert fold_construction(fake_query(dtype=torch.float32), None) == "channel"  # cannot run: the usual choice
    monkeypatch.setenv(FOLD_ENV, "diagonal")
    with pytest.raises(ValueError, match="HF_ALIBI_FOLD='diagonal'; expected one of"):
        fold_construction(fake_query(), None)
    assert folded.CUDNN_FIRST[0] == SDPBackend.CUDNN_ATTENTION


def test_the_cudnn_construction_compiles_into_one_graph():
    """torch.compile (fullgraph: torch.export needs one graph) traces the kernel choice with the call."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 40, D, generator=g).to(torch.bfloat16) for _ in range(3))
    slopes = torch.tensor(SLOPES)

    def fold(q, k, v):
        return folded_causal_attention(None, q, k, v, None, slopes, scaling=D**-0.5, construction=CUDNN)[0]

    out = torch.compile(fold, fullgraph=True, backend="aot_eager")(q, k, v)
    ref = reference(q, k, v, D**-0.5)
    assert (out.double() - ref).abs().max().item() <= 2.0**-7 * ref.abs().max().item()
