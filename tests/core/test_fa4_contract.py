"""hf_alibi's FlashAttention-4 path, run on the CPU through a stand-in written from FA4's documented contract
(tests/fa4_standin.py) with the score_mods' arithmetic on torch tensors (``fa4.torch_score_mods``: the expressions the
CuTe ones are built from), against float64 references written with loops (tests/reference.py): a KV cache, left
padding and packed rows (varlen), grouped KV heads, sliding windows, the symmetric form, per-layer slopes,
gradients; and the one-line refusals the kernel table gives. The real kernel is checked by ``pytest -m gpu``
(tests/core/test_gpu_kernels.py)."""

import fa4_standin
import pytest
import torch
from arch_cases import CASES, VOCAB
from contract_inputs import BF16, D, H, expanded, inputs
from reference import explicit_bias, fairseq_slopes, reference_attention
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.core import fa4
from hf_alibi.core.bias import AlibiBias
from hf_alibi.core.compat import store_attn_implementation
from hf_alibi.core.forward import AlibiForward
from hf_alibi.core.packing import document_starts
from hf_alibi.core.slopes import KeyRounding


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    kernels = (fa4_standin.flash_attn_func, fa4_standin.flash_attn_varlen_func, fa4.torch_score_mods())
    monkeypatch.setattr(fa4, "fa4_kernels", lambda device: kernels)
    fa4_standin.CALLS.clear()


class Layer(nn.Module):
    def __init__(self, kind="causal", heads=H, **options):
        super().__init__()
        self.alibi = AlibiBias(kind, heads, **options)
        self.training = False


def run(layer, q, k, v, mask=None, **kwargs):
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_flash_attention_4"](layer, q, k, v, mask, scaling=D**-0.5, **kwargs)
    assert layer.alibi.last_path == "fa4"
    return out.transpose(1, 2).double()  # (B, H, q, D)


def close(out, ref, v):  # the output is rounded to bf16 once: 2^-8 of the largest value
    assert (out - ref).abs().max().item() <= 2.0**-8 * v.abs().max().item()


@pytest.mark.parametrize(("q_len", "kv_len"), [(40, 40), (5, 40), (1, 40)], ids=["prefill", "cache", "decode"])
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_causal_against_loop_reference(q_len, kv_len, kv_heads):
    """With a KV cache the score_mod's q_idx counts from 0 while the true query sits Sk - Sq further: the bias
    differs by a constant per row, which softmax ignores (a -m|q_idx - kv_idx| score_mod would fail here)."""
    q, k, v = inputs(2, q_len, kv_len, kv_heads)
    out = run(Layer(), q, k, v)
    bias = explicit_bias("causal", fairseq_slopes(H), q_len, kv_len)
    close(out, reference_attention(q, expanded(k), expanded(v), bias, D**-0.5), v)
    (call,) = fa4_standin.CALLS
    assert call["entry"] == "flash_attn_func" and call["causal"] is True


def test_the_layers_own_slopes_travel_as_the_aux_tensor():
    slopes = [0.3, 0.01, 0.7, 0.05]
    q, k, v = inputs(1, 24, 24)
    out = run(Layer(slopes=slopes), q, k, v)
    close(out, reference_attention(q, k, v, explicit_bias("causal", slopes, 24, 24), D**-0.5), v)
    (aux,) = fa4_standin.CALLS[0]["aux_tensors"]
    assert aux.dtype == torch.float32 and aux.tolist() == pytest.approx(slopes)


def test_symmetric_encoder_against_loop_reference():
    q, k, v = inputs(2, 33, 33)
    out = run(Layer("symmetric"), q, k, v)
    close(out, reference_attention(q, k, v, explicit_bias("symmetric", fairseq_slopes(H), 33, 33), D**-0.5), v)
    assert fa4_standin.CALLS[0]["causal"] is False


def test_left_padded_batch_goes_through_varlen():
    q, k, v = inputs(2, 30, 30)
    padding = torch.ones(2, 30, dtype=torch.long)
    padding[1, :7] = 0
    out = run(Layer(), q, k, v, padding)
    assert [c["entry"] for c in fa4_standin.CALLS] == ["flash_attn_varlen_func"]
    ref = reference_attention(q[:1], k[:1], v[:1], explicit_bias("causal", fairseq_slopes(H), 30, 30), D**-0.5)
    close(out[0], ref[0], v)
    alone = reference_attention(
        q[1:, :, 7:], k[1:, :, 7:], v[1:, :, 7:], explicit_bias("causal", fairseq_slopes(H), 23, 23), D**-0.5
    )
    close(out[1, :, 7:], alone[0], v)


def test_packed_row_one_document_each():
    lengths = (12, 20, 9)
    q, k, v = inputs(1, sum(lengths), sum(lengths))
    starts = document_starts(torch.cat([torch.arange(n) for n in lengths])[None])
    out = run(Layer(), q, k, v, alibi_forward=AlibiForward(documents=starts))
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        bias = explicit_bias("causal", fairseq_slopes(H), n, n)
        close(out[:, :, part], reference_attention(q[:, :, part], k[:, :, part], v[:, :, part], bias, D**-0.5), v)
        start += n


def test_sliding_window():
    q, k, v = inputs(1, 30, 30)
    out = run(Layer(), q, k, v, sliding_window=8)
    bias = explicit_bias("causal", fairseq_slopes(H), 30, 30)
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    close(out, reference_attention(q, k, v, bias.masked_fill(j < i - 7, float("-inf")), D**-0.5), v)


def test_gradients_against_the_float64_reference():
    q, k, v = inputs(1, 20, 20)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    layer = Layer()
    grad = torch.randn(1, 20, H, D, generator=torch.Generator().manual_seed(3))
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_flash_attention_4"](layer, *leaves, None, scaling=D**-0.5)
    out.float().backward(grad)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    bias = explicit_bias("causal", fairseq_slopes(H), 20, 20)
    reference_attention(*exact, bias, D**-0.5).transpose(1, 2).backward(grad.double())
    for mine, ref in zip(leaves, exact):
        assert (mine.grad.double() - ref.grad).abs().max().item() <= 2.0**-6 * ref.grad.abs().max().item()


@pytest.mark.parametrize(
    ("layer", "kwargs", "message"),
    [
        (lambda: Layer(sinks=2), {}, "FlashAttention-4's ALiBi score_mod cannot exempt the first 2 keys"),
        (lambda: Layer(rounding=KeyRounding("bfloat16")), {}, "cannot round each key's bias to bfloat16"),
        (lambda: Layer("nonsymmetric"), {}, "has no 'nonsymmetric' form"),
        (lambda: Layer(), {"softcap": 3.0}, "a soft-cap or a score_mod, not both"),
    ],
    ids=["sinks", "rounding", "nonsymmetric", "softcap"],
)
def test_what_fa4_cannot_render_is_refused_in_one_line_before_any_work(layer, kwargs, message):
    q, k, v = inputs(1, 8, 8)
    with pytest.raises(NotImplementedError, match=message) as refused:
        run(layer(), q, k, v, **kwargs)
    assert "\n" not in str(refused.value) and "set_attn_implementation('sdpa')" in str(refused.value)
    assert fa4_standin.CALLS == []


def test_dropout_while_training_is_refused():
    layer = Layer()
    layer.training = True
    q, k, v = inputs(1, 8, 8)
    with pytest.raises(NotImplementedError, match="no attention dropout"):
        run(layer, q, k, v, dropout=0.1)


def use_fa4(model):
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            store_attn_implementation(module.config, "flash_attention_4")  # transformers' setter wants flash-attn-4
    return model.to(BF16)


FA4_CASES = [case for case in CASES if case.name in ("gpt2", "llama", "bert")]


@pytest.mark.parametrize("case", FA4_CASES, ids=[c.name for c in FA4_CASES])
def test_whole_model_on_fa4_equals_sdpa_in_fp32(case):
    """transformers hands the flash_attention_4 backend its 2D padding mask; left padding, a decoder and an
    encoder: the logits of the real tokens within bf16's rounding of the fp32 sdpa model's."""
    model = hf_alibi.patch_model(case.make(), encoder_variant="symmetric" if case.bidirectional else None)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=mask).logits
        fa4_logits = use_fa4(model)(input_ids=ids, attention_mask=mask).logits.float()
    assert {m.last_path for m in model.modules() if isinstance(m, AlibiBias)} == {"fa4"}
    real = mask.bool()
    assert (fa4_logits - exact)[real].abs().max().item() < 0.05 * exact[real].abs().max().item()
