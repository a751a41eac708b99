"""hf_alibi's flash-attn path, run on the CPU through a stand-in written from flash-attn's documented contract
(tests/flash_standin.py), against references written with loops (tests/reference.py): padding, packed rows
(varlen), KV-cache decoding steps, sliding windows, soft-capping, grouped KV heads; whole models too.

Only the kernels are stood in (``hf_alibi.core.flash.flash_kernels``, the one place that finds them); without
the stand-in the real lookup still refuses the CPU (tests/core/test_attention_flex_flash.py).
"""

import flash_standin
import pytest
import torch
from arch_cases import CASES, VOCAB
from contract_inputs import BF16, D, H, expanded, inputs
from reference import explicit_bias, fairseq_slopes, reference_attention
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.core import flash
from hf_alibi.core.bias import AlibiBias
from hf_alibi.core.compat import store_attn_implementation
from hf_alibi.core.forward import AlibiForward
from hf_alibi.core.packing import document_starts


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    monkeypatch.setattr(
        flash, "flash_kernels", lambda device: (flash_standin.flash_attn_func, flash_standin.flash_attn_varlen_func)
    )
    flash_standin.CALLS.clear()


class Layer(nn.Module):
    def __init__(self, kind="causal", heads=H):
        super().__init__()
        self.alibi = AlibiBias(kind, heads)


def run(layer, q, k, v, mask=None, **kwargs):
    out, _ = ALL_ATTENTION_FUNCTIONS["alibi_flash_attention_2"](layer, q, k, v, mask, scaling=D**-0.5, **kwargs)
    assert layer.alibi.last_path == "flash"
    return out.transpose(1, 2).double()  # (B, H, q, D)


def close(out, ref, v):  # the output is rounded to bf16 once: 2^-8 of the largest value
    assert (out - ref).abs().max().item() <= 2.0**-8 * v.abs().max().item()


@pytest.mark.parametrize(("q_len", "kv_len"), [(40, 40), (5, 40), (1, 40)], ids=["prefill", "chunk", "decode"])
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_causal_against_loop_reference(q_len, kv_len, kv_heads):
    q, k, v = inputs(2, q_len, kv_len, kv_heads)
    out = run(Layer(), q, k, v)
    ref = reference_attention(
        q, expanded(k), expanded(v), explicit_bias("causal", fairseq_slopes(H), q_len, kv_len), D**-0.5
    )
    close(out, ref, v)
    assert flash_standin.CALLS == ["flash_attn_func"]


def test_symmetric_encoder_against_loop_reference():
    q, k, v = inputs(2, 33, 33)
    out = run(Layer("symmetric"), q, k, v)
    close(out, reference_attention(q, k, v, explicit_bias("symmetric", fairseq_slopes(H), 33, 33), D**-0.5), v)


def test_left_padded_batch_goes_through_varlen():
    q, k, v = inputs(2, 30, 30)
    padding = torch.ones(2, 30, dtype=torch.long)
    padding[1, :7] = 0
    out = run(Layer(), q, k, v, padding)
    assert flash_standin.CALLS == ["flash_attn_varlen_func"]
    close(
        out[0],
        reference_attention(q[:1], k[:1], v[:1], explicit_bias("causal", fairseq_slopes(H), 30, 30), D**-0.5)[0],
        v,
    )
    alone = reference_attention(
        q[1:, :, 7:], k[1:, :, 7:], v[1:, :, 7:], explicit_bias("causal", fairseq_slopes(H), 23, 23), D**-0.5
    )
    close(out[1, :, 7:], alone[0], v)


@pytest.mark.parametrize("given", ["position_ids", "cu_seq_lens"])
def test_packed_row_goes_through_varlen_one_document_each(given):
    lengths = (12, 20, 9)
    q, k, v = inputs(1, sum(lengths), sum(lengths))
    layer = Layer()
    kwargs = {}
    if given == "position_ids":
        starts = document_starts(torch.cat([torch.arange(n) for n in lengths])[None])
        kwargs = {"alibi_forward": AlibiForward(documents=starts)}  # what the model's forward passes its layers
    else:  # what DataCollatorWithFlattening(return_flash_attn_kwargs=True) hands the model
        cu = torch.tensor([0, 12, 32, 41], dtype=torch.int32)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20, max_length_k=20)
    out = run(layer, q, k, v, **kwargs)
    assert flash_standin.CALLS == ["flash_attn_varlen_func"]
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        ref = reference_attention(
            q[:, :, part], k[:, :, part], v[:, :, part], explicit_bias("causal", fairseq_slopes(H), n, n), D**-0.5
        )
        close(out[:, :, part], ref, v)
        start += n


def test_sliding_window_and_softcap():
    q, k, v = inputs(1, 30, 30)
    out = run(Layer(), q, k, v, sliding_window=8, softcap=3.0)
    bias = explicit_bias("causal", fairseq_slopes(H), 30, 30)
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    bias = bias.masked_fill(j < i - 7, float("-inf"))  # transformers' window of 8 keys: the query and 7 before
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * D**-0.5
    weights = torch.softmax(3.0 * torch.tanh(scores / 3.0) + bias, dim=-1)  # the cap, then the bias
    close(out, torch.einsum("bhqk,bhkd->bhqd", weights, v.double()), v)


def use_flash(model):
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            store_attn_implementation(module.config, "flash_attention_2")  # transformers' setter wants flash-attn
    return model.to(BF16)


FLASH_CASES = [case for case in CASES if case.name in ("gpt2", "llama", "mistral", "qwen2", "bert")]


@pytest.mark.parametrize("case", FLASH_CASES, ids=[c.name for c in FLASH_CASES])
def test_whole_model_on_flash_equals_sdpa_in_fp32(case):
    model = hf_alibi.patch_model(case.make())
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=mask).logits
        flash_logits = use_flash(model)(input_ids=ids, attention_mask=mask).logits.float()
    assert {m.last_path for m in model.modules() if isinstance(m, AlibiBias)} == {"flash"}
    real = mask.bool()
    difference = (flash_logits - exact)[real].abs().max().item()
    assert difference < 0.05 * exact[real].abs().max().item()  # bf16 weights and activations


@pytest.mark.parametrize("case", [c for c in FLASH_CASES if c.kind == "decoder"], ids=lambda c: c.name)
def test_whole_model_on_flash_packed_and_cached_decoding(case):
    model = use_flash(hf_alibi.patch_model(case.make()))
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (17, 30)]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(docs)[None], position_ids=positions, use_cache=False).logits
        for start, doc in zip((0, 17), docs):
            alone = model(input_ids=doc[None]).logits
            torch.testing.assert_close(packed[:, start : start + len(doc)], alone, rtol=0, atol=0)
        # decoding steps through the KV cache: the last step's logits as a full forward's
        whole = model(input_ids=docs[1][None]).logits
        step = model(input_ids=docs[1][None, :25], use_cache=True)
        cache = step.past_key_values
        for t in range(25, 30):
            step = model(input_ids=docs[1][None, t : t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            torch.testing.assert_close(step.logits[:, -1], whole[:, t], rtol=0, atol=2e-2)
    assert "flash_attn_varlen_func" in flash_standin.CALLS
