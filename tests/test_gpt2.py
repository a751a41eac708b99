"""GPT-2 end to end: numbers against the hand-written reference in tests/reference.py."""

import pytest
import torch
from reference import gpt2_reference_logits
from tiny import random_ids, tiny_gpt2

import hf_alibi
from hf_alibi.core.strategies import NoPositionEmbedding

BACKENDS = ["eager", "sdpa"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_reference_and_differ_from_original(backend):
    model = tiny_gpt2(attn_implementation=backend)
    ids = random_ids(2, 12)
    with torch.no_grad():
        original = model(ids).logits
        hf_alibi.patch_model(model)
        assert model.config._attn_implementation == f"alibi_{backend}"
        patched = model(ids).logits
        reference = gpt2_reference_logits(model, ids)
    torch.testing.assert_close(patched, reference, rtol=0, atol=1e-5)
    assert (patched - original).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_at_four_times_n_positions(backend):
    model = hf_alibi.patch_model(tiny_gpt2(attn_implementation=backend))
    ids = random_ids(1, 4 * 16)
    with torch.no_grad():
        logits = model(ids).logits
        reference = gpt2_reference_logits(model, ids)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_wpe_is_gone_and_position_ids_do_nothing():
    model = hf_alibi.patch_model(tiny_gpt2())
    assert isinstance(model.transformer.wpe, NoPositionEmbedding)
    assert not any("wpe" in name for name in model.state_dict())
    ids = random_ids(1, 10)
    shuffled = torch.randperm(10, generator=torch.Generator().manual_seed(0))[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model(ids, position_ids=shuffled).logits, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generate_with_cache_equals_full_recomputation(backend):
    model = hf_alibi.patch_model(tiny_gpt2(attn_implementation=backend))
    prompt = random_ids(1, 5)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=32, do_sample=False, use_cache=True, pad_token_id=0)
        ids = prompt
        for _ in range(32):
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert cached.shape[1] == 5 + 32 > 16  # past the original n_positions
    assert torch.equal(cached, ids)


def test_cached_logits_equal_full_logits_past_n_positions():
    model = hf_alibi.patch_model(tiny_gpt2())
    ids = random_ids(1, 40)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :30], use_cache=True)
        past = out.past_key_values
        chunks = [out.logits]
        for start in range(30, 40, 5):  # chunked prefill: several queries against a longer cache
            out = model(ids[:, start : start + 5], past_key_values=past, use_cache=True)
            chunks.append(out.logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_does_not_change_real_tokens(backend, side):
    model = hf_alibi.patch_model(tiny_gpt2(attn_implementation=backend))
    short, long = random_ids(1, 6, seed=2), random_ids(1, 10, seed=3)
    pad = torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([pad, short], 1) if side == "left" else torch.cat([short, pad], 1)
    batch = torch.cat([padded, long])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0 if side == "left" else 1
    mask[0, 6:] = 0 if side == "right" else 1
    with torch.no_grad():
        out = model(batch, attention_mask=mask).logits
        alone = model(short).logits[0]
        long_alone = model(long).logits[0]
    real = out[0, 4:] if side == "left" else out[0, :6]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(real, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], long_alone, rtol=0, atol=1e-5)


def test_left_padded_batch_generation_equals_single_generation():
    model = hf_alibi.patch_model(tiny_gpt2())
    short, long = random_ids(1, 4, seed=4), random_ids(1, 7, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        alone = model.generate(short, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(together[0, 3:], alone[0])


def test_set_attn_implementation_keeps_the_bias():
    model = hf_alibi.patch_model(tiny_gpt2(attn_implementation="sdpa"))
    ids = random_ids(1, 9)
    with torch.no_grad():
        sdpa = model(ids).logits
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "alibi_eager"
        eager = model(ids).logits
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=1e-5)


def test_cross_attention_layers_get_no_bias():
    model = hf_alibi.patch_model(tiny_gpt2(add_cross_attention=True))
    assert all(hasattr(block.attn, "alibi") for block in model.transformer.h)
    assert not any(hasattr(block.crossattention, "alibi") for block in model.transformer.h)


def test_half_precision_long_input_is_finite():
    model = hf_alibi.patch_model(tiny_gpt2()).to(torch.bfloat16)
    ids = random_ids(1, 256)
    with torch.no_grad():
        logits = model(ids).logits.float()
        reference = gpt2_reference_logits(model.float(), ids)
    assert torch.isfinite(logits).all()
    assert (logits - reference).abs().max() < 0.25  # bf16 has 8 mantissa bits
