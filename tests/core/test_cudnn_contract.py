"""hf_alibi's cuDNN kernel (attn_implementation "cudnn", hf_alibi/core/cudnn.py) run on the CPU through a stand-in of
NVIDIA's cuDNN frontend written from its documented contract (tests/cudnn_standin.py), against float64 references
written with loops (tests/reference.py): forward and backward, grouped KV heads, fp16, right padding (cuDNN's padding
mask; padded rows zeroed), attention dropout applied by the graph (the stand-in's mask, the same in the backward, and
reproduced by torch's seed), graphs cached per shape, strides and dtype, torch.compile(fullgraph=True); the one-line
refusals and the missing package; and the dispatch: a user's named backend runs it, "auto" never takes it. The real
kernel is checked by ``pytest -m gpu`` (tests/core/test_gpu_cudnn.py)."""

import sys

import cudnn_standin
import pytest
import torch
from arch_cases import CASES, VOCAB
from contract_inputs import BF16, H, expanded
from reference import explicit_bias, fairseq_slopes, reference_attention
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.core import cudnn
from hf_alibi.core.bias import AlibiBias
from hf_alibi.core.forward import AlibiForward
from hf_alibi.core.slopes import KeyRounding

D = 16  # a multiple of 8, as cuDNN's head sizes are
FIND = cudnn.cudnn_frontend  # the real finder, for the missing-package tests


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    monkeypatch.setattr(cudnn, "cudnn_frontend", lambda device: cudnn_standin)
    monkeypatch.setattr(cudnn, "_GRAPHS", {})
    monkeypatch.setattr(cudnn, "_LOCAL", type(cudnn._LOCAL)())
    cudnn_standin.reset()


class Layer(nn.Module):
    def __init__(self, kind="causal", heads=H, training=False, **options):
        super().__init__()
        self.alibi = AlibiBias(kind, heads, **options)
        self.training = training


def inputs(batch, q_len, kv_len, kv_heads=H, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, q_len, D, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, kv_len, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def call(layer, q, k, v, mask=None, **kwargs):
    out, weights = ALL_ATTENTION_FUNCTIONS["alibi_cudnn"](layer, q, k, v, mask, scaling=D**-0.5, **kwargs)
    assert weights is None and layer.alibi.last_path == "cudnn"
    return out  # (B, q, H, D)


def close(out, ref, v, bits=8):  # the output rounded to the dtype once: 2^-bits of the largest value
    assert (out.double() - ref).abs().max().item() <= 2.0**-bits * v.abs().max().item()


def causal_reference(q, k, v, lengths=None):
    """float64 (B, q, H, D): each row's first ``lengths[b]`` tokens alone, zeros after them."""
    out = torch.zeros(q.shape[0], q.shape[2], H, v.shape[-1], dtype=torch.float64)
    k, v = expanded(k), expanded(v)
    for b in range(q.shape[0]):
        n = q.shape[2] if lengths is None else lengths[b]
        bias = explicit_bias("causal", fairseq_slopes(H), n, n)
        ref = reference_attention(q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n], bias, D**-0.5)
        out[b, :n] = ref[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("length", [40, 37])
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_causal_forward_against_loop_reference(length, kv_heads, dtype):
    q, k, v = inputs(2, length, length, kv_heads, dtype)
    out = call(Layer(), q, k, v)
    assert out.dtype == dtype and out.shape == (2, length, H, D) and out.is_contiguous()
    close(out, causal_reference(q, k, v), v, bits=8 if dtype == BF16 else 10)
    (build,) = cudnn_standin.BUILDS
    assert build["op"] == "sdpa" and build["use_alibi_mask"] is True and build["diagonal_band_right_bound"] == 0
    assert build["diagonal_alignment"] == cudnn_standin.diagonal_alignment.TOP_LEFT
    assert build["attn_scale"] == D**-0.5 and build.get("dropout") is None and not build.get("use_padding_mask")


@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_gradients_against_the_float64_reference(kv_heads):
    q, k, v = inputs(2, 24, 24, kv_heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(2, 24, H, D, generator=torch.Generator().manual_seed(3))
    call(Layer(), *leaves).float().backward(grad)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    causal_reference(*exact).backward(grad.double())
    for mine, ref in zip(leaves, exact):
        assert mine.grad.shape == ref.grad.shape
        assert (mine.grad.double() - ref.grad).abs().max().item() <= 2.0**-6 * ref.grad.abs().max().item()
    assert [b["op"] for b in cudnn_standin.BUILDS] == ["sdpa", "sdpa_backward"]


def test_right_padding_runs_as_cudnns_padding_and_padded_rows_are_zero():
    """The stand-in writes NaN into the rows the contract leaves unspecified: hf_alibi must zero them, in the output
    and in every gradient."""
    q, k, v = inputs(2, 30, 30)
    padding = torch.ones(2, 30, dtype=torch.long)
    padding[1, 23:] = 0
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = call(Layer(), *leaves, padding)
    close(out, causal_reference(q, k, v, lengths=[30, 23]), v)
    assert cudnn_standin.BUILDS[0]["use_padding_mask"] is True
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    out.float().backward(grad)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    causal_reference(*exact, lengths=[30, 23]).backward(grad.double())
    for mine, ref in zip(leaves, exact):
        assert torch.isfinite(mine.grad).all() and not mine.grad[1, :, 23:].any()
        assert (mine.grad.double() - ref.grad).abs().max().item() <= 2.0**-6 * ref.grad.abs().max().item()


def test_left_padding_is_refused_in_one_line():
    q, k, v = inputs(2, 16, 16)
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, :5] = 0
    with pytest.raises(NotImplementedError, match="left-padded") as refused:
        call(Layer(), q, k, v, padding)
    assert "\n" not in str(refused.value) and "set_attn_implementation('sdpa')" in str(refused.value)
    assert cudnn_standin.RUNS == []


def test_dropout_is_applied_by_the_graph_the_same_in_the_backward_and_reproduced_by_the_seed():
    q, k, v = inputs(2, 32, 32)
    layer = Layer(training=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    out = call(layer, *leaves, dropout=0.25)
    (build,) = cudnn_standin.BUILDS
    assert build["dropout"][0] == 0.25
    mask = cudnn_standin.RUNS[0]["mask"]  # (B, H, q, kv), what the graph drew from the seed and offset hf_alibi gave
    assert 0.6 < mask.double().mean().item() < 0.9
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    scores = torch.einsum("bhqd,bhkd->bhqk", exact[0], exact[1]) * D**-0.5
    weights = torch.softmax(scores + explicit_bias("causal", fairseq_slopes(H), 32, 32), dim=-1)
    ref = torch.einsum("bhqk,bhkd->bqhd", weights * mask / 0.75, exact[2])
    close(out, ref.detach(), v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.float().backward(grad)
    ref.backward(grad.double())
    assert torch.equal(cudnn_standin.RUNS[1]["mask"], mask)  # the backward regenerates the same mask
    for mine, theirs in zip(leaves, exact):
        assert (mine.grad.double() - theirs.grad).abs().max().item() <= 2.0**-6 * theirs.grad.abs().max().item()
    torch.manual_seed(11)
    assert torch.equal(call(layer, q, k, v, dropout=0.25), out.detach())
    torch.manual_seed(12)
    assert not torch.equal(call(layer, q, k, v, dropout=0.25), out.detach())


def test_no_dropout_outside_training():
    q, k, v = inputs(1, 16, 16)
    close(call(Layer(training=False), q, k, v, dropout=0.5), causal_reference(q, k, v), v)
    assert cudnn_standin.BUILDS[0].get("dropout") is None


def test_graphs_are_cached_per_shape_strides_and_dtype():
    """The stand-in refuses a buffer whose strides differ from its graph's declaration, so a graph reused for another
    layout would fail here."""
    q, k, v = inputs(1, 24, 24)
    for _ in range(3):
        call(Layer(), q, k, v)
    assert len(cudnn_standin.BUILDS) == 1 and len(cudnn_standin.RUNS) == 3
    transposed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # (B, L, H, D) in memory
    close(call(Layer(), *transposed), causal_reference(q, k, v), v)
    call(Layer(), *inputs(1, 32, 32))
    call(Layer(), *(t.half() for t in (q, k, v)))
    assert len(cudnn_standin.BUILDS) == 4 and len(cudnn._GRAPHS) == 4
    (handle,) = cudnn_standin.HANDLES  # one handle for the thread and device, set to the current stream
    assert {run["stream"] for run in cudnn_standin.RUNS} == {0}


def test_compiled_fullgraph_equals_eager_forward_and_backward():
    q, k, v = inputs(2, 24, 24, kv_heads=2)
    layer = Layer()

    def attention(q, k, v):
        return ALL_ATTENTION_FUNCTIONS["alibi_cudnn"](layer, q, k, v, None, scaling=D**-0.5)[0]

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager, traced = attention(*eager_leaves), compiled(*compiled_leaves)
    assert torch.equal(eager, traced)
    grad = torch.randn(eager.shape, generator=torch.Generator().manual_seed(6)).to(BF16)
    eager.backward(grad)
    traced.backward(grad)
    for a, b in zip(eager_leaves, compiled_leaves):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(
    ("layer", "shape", "kwargs", "message"),
    [
        (lambda: Layer(sinks=2), (8, 8), {}, "cuDNN's fused ALiBi cannot exempt the first 2 keys"),
        (lambda: Layer(rounding=KeyRounding("bfloat16")), (8, 8), {}, "cannot round each key's bias to bfloat16"),
        (lambda: Layer("symmetric"), (8, 8), {}, "has no 'symmetric' form"),
        (lambda: Layer(slopes=[0.3, 0.01, 0.7, 0.05]), (8, 8), {}, "applies the paper's slopes only"),
        (lambda: Layer(), (3, 8), {}, "aligns its causal mask top-left"),
        (lambda: Layer(), (8, 8), {"sliding_window": 4}, "no sliding window"),
        (lambda: Layer(), (8, 8), {"softcap": 3.0}, "no soft-cap"),
        (lambda: Layer(), (8, 8), {"alibi_forward": AlibiForward(documents=torch.zeros(1, 8, dtype=torch.long))},
         "packed rows"),
    ],
    ids=["sinks", "rounding", "symmetric", "fitted-slopes", "kv-cache", "sliding-window", "softcap", "packed"],
)  # fmt: skip
def test_what_cudnn_cannot_render_is_refused_in_one_line_before_any_work(layer, shape, kwargs, message):
    q, k, v = inputs(1, *shape)
    with pytest.raises(NotImplementedError, match=message) as refused:
        call(layer(), q, k, v, **kwargs)
    assert "\n" not in str(refused.value) and "set_attn_implementation('sdpa')" in str(refused.value)
    assert cudnn_standin.BUILDS == []


@pytest.mark.parametrize(
    ("dtype", "head", "message"), [(torch.float32, D, "takes bf16 or fp16"), (BF16, 12, "multiples of 8")]
)
def test_dtypes_and_head_sizes_cudnn_lacks_are_refused(dtype, head, message):
    q, k, v = (t[..., :head].to(dtype) for t in inputs(1, 8, 8))
    with pytest.raises(NotImplementedError, match=message) as refused:
        ALL_ATTENTION_FUNCTIONS["alibi_cudnn"](Layer(), q, k, v, None)
    assert "\n" not in str(refused.value) and "'sdpa'" in str(refused.value)


def test_a_graph_cudnn_does_not_support_is_one_line(monkeypatch):
    def unsupported(self):
        raise cudnn_standin.cudnnGraphNotSupportedError("No valid engine configs for this graph\nmore detail")

    monkeypatch.setattr(cudnn_standin.pygraph, "check_support", unsupported)
    with pytest.raises(NotImplementedError, match=r"cuDNN cannot run this attention call \(No valid engine") as no:
        call(Layer(), *inputs(1, 8, 8))
    assert "\n" not in str(no.value) and "'sdpa'" in str(no.value)


def test_the_missing_package_says_what_to_install_and_what_runs_instead(monkeypatch):
    monkeypatch.setattr(cudnn, "cudnn_frontend", FIND)
    monkeypatch.setattr(cudnn, "_FOUND", {})
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn fails as where the package is missing
    with pytest.raises(ImportError, match=r"pip install nvidia-cudnn-frontend, or pip install -e '\.\[cuda\]'") as no:
        call(Layer(), *inputs(1, 8, 8))
    assert "\n" not in str(no.value) and "set_attn_implementation('sdpa'), which runs" in str(no.value)
    monkeypatch.setitem(sys.modules, "cudnn", cudnn_standin)  # installed, but a CPU tensor
    with pytest.raises(RuntimeError, match="runs on CUDA only"):
        call(Layer(), *inputs(1, 8, 8))


CUDNN_CASES = [case for case in CASES if case.name in ("gpt2", "llama")]


@pytest.mark.parametrize("case", CUDNN_CASES, ids=[c.name for c in CUDNN_CASES])
def test_a_named_backend_runs_the_whole_model_and_auto_never_takes_it(case):
    """``set_attn_implementation("cudnn")`` (transformers hands it its 2D padding mask): a right-padded batch's
    logits within bf16's rounding of the sdpa model's in fp32, every layer on cuDNN; back on "sdpa", "auto" takes its
    own paths, never cuDNN."""
    model = hf_alibi.patch_model(case.make())
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 33:] = 0  # right padding
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=mask).logits
        assert {m.last_path for m in model.modules() if isinstance(m, AlibiBias)} <= {"folded", "bias"}
        model.set_attn_implementation("cudnn")
        assert model.config._attn_implementation == "alibi_cudnn"
        logits = model.to(BF16)(input_ids=ids, attention_mask=mask).logits.float()
    assert {m.last_path for m in model.modules() if isinstance(m, AlibiBias)} == {"cudnn"}
    real = mask.bool()
    assert (logits - exact)[real].abs().max().item() < 0.05 * exact[real].abs().max().item()


def test_a_model_without_alibi_is_refused_on_the_cudnn_name():
    case = CUDNN_CASES[0]
    model = case.make()
    model.set_attn_implementation("cudnn")
    with pytest.raises(ValueError, match="hf_alibi's kernel for ALiBi layers") as refused:
        model(input_ids=torch.randint(3, VOCAB, (1, 8)))
    assert "\n" not in str(refused.value)
