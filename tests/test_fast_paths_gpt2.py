"""The fast paths inside a real model (GPT-2): chosen automatically, equal to the reference and the
safe path, with padding, KV caches (dynamic and static) and gradients."""

import pytest
import torch
from reference import gpt2_reference_logits
from tiny import random_ids, tiny_gpt2
from transformers import StaticCache

import hf_alibi
from hf_alibi.core.bias import BIAS, FOLDED
from hf_alibi.core.dispatch import FOLD_MIN_QUERIES


def paths(model):
    return {block.attn.alibi.last_path for block in model.transformer.h}


def set_path(model, path):
    hf_alibi.set_attention_path(model, path)
    assert {block.attn.alibi.path for block in model.transformer.h} == {path}


def padded_batch(length):
    ids = random_ids(2, length, seed=7)
    mask = torch.ones_like(ids)
    mask[0, : length // 3] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("length", [1, 7, 64])
def test_folded_path_is_chosen_and_matches_reference(length):
    model = hf_alibi.patch_model(tiny_gpt2())
    ids = random_ids(2, length)
    with torch.no_grad():
        logits = model(ids).logits
        assert paths(model) == ({FOLDED} if length >= FOLD_MIN_QUERIES else {BIAS})
        reference = gpt2_reference_logits(model, ids)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("length", [7, 1000])
def test_folded_equals_bias_path_with_padding_and_gradients(length):
    model = hf_alibi.patch_model(tiny_gpt2())
    ids, mask = padded_batch(length)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, length // 3] = -100  # predicted from a padding position, whose output is undefined
    results = {}
    for path in (FOLDED, BIAS):
        set_path(model, path)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert paths(model) == {path}
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        real = mask.bool()
        results[path] = (out.logits.detach()[real], out.loss.detach(), grads)
    (lf, loss_f, gf), (lb, loss_b, gb) = results[FOLDED], results[BIAS]
    torch.testing.assert_close(lf, lb, rtol=0, atol=1e-4)
    torch.testing.assert_close(loss_f, loss_b, rtol=0, atol=1e-5)
    for name in gf:
        torch.testing.assert_close(gf[name], gb[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("path", ["auto", FOLDED])
def test_cache_matches_full_recompute(path):
    model = hf_alibi.patch_model(tiny_gpt2())
    set_path(model, path)
    ids, mask = padded_batch(40)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :30], attention_mask=mask[:, :30], use_cache=True)
        chunks, past = [out.logits], out.past_key_values
        for start in range(30, 40, 5):  # chunked prefill against a longer cache (a bool mask)
            out = model(ids[:, start : start + 5], attention_mask=mask[:, : start + 5], past_key_values=past)
            assert paths(model) == ({BIAS} if path == "auto" else {FOLDED})  # 5 queries: bias when auto
            chunks.append(out.logits)
            past = out.past_key_values
    real = mask.bool()
    torch.testing.assert_close(torch.cat(chunks, 1)[real], full[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("path", [FOLDED, BIAS])
def test_static_cache_generation_equals_dynamic(path):
    model = hf_alibi.patch_model(tiny_gpt2())
    set_path(model, path)
    prompt = random_ids(1, 6)
    with torch.no_grad():
        dynamic = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
        cache = StaticCache(config=model.config, max_cache_len=40)
        static = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0, past_key_values=cache)
    assert torch.equal(dynamic, static)


def test_bf16_model_takes_folded_path_and_stays_close():
    model = hf_alibi.patch_model(tiny_gpt2())
    ids = random_ids(1, 64)
    with torch.no_grad():
        reference = gpt2_reference_logits(model, ids)
        model.to(torch.bfloat16)
        logits = model(ids).logits.float()
    assert paths(model) == {FOLDED}  # the half-precision fold (tests/test_folded_half.py)
    assert (logits - reference).abs().max() <= 2e-2 * reference.abs().max() + 0.05


def test_bias_path_builds_one_mask_per_forward_and_drops_it():
    model = hf_alibi.patch_model(tiny_gpt2(attn_implementation="eager", n_layer=3))
    ids, mask = padded_batch(9)
    masks = model.transformer.h[0].attn.alibi.masks
    assert all(block.attn.alibi.masks is masks for block in model.transformer.h)  # one cache per model
    before = masks.builds
    with torch.no_grad():
        model(ids, attention_mask=mask)
        model(ids)
    assert masks.builds == before + 2  # one per forward, not one per layer
    assert masks.merged is None  # released when the forward ended


def test_flex_backend_forward_matches_reference_on_cpu():
    model = hf_alibi.patch_model(tiny_gpt2())
    # GPT-2 is not on transformers' flex list; the dispatch still goes to the registered function
    model.config._attn_implementation_internal = "flex_attention"
    ids, mask = padded_batch(12)
    with torch.no_grad():
        flex = model(ids, attention_mask=mask).logits
        assert paths(model) == {"flex"}
        model.config._attn_implementation_internal = "sdpa"
        sdpa = model(ids, attention_mask=mask).logits
        reference = gpt2_reference_logits(model, ids[1:])
    real = mask.bool()
    torch.testing.assert_close(flex[real], sdpa[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(flex[1], reference[0], rtol=0, atol=1e-4)


def test_set_attention_path_refuses_bad_input():
    with pytest.raises(ValueError, match="path must be one of"):
        hf_alibi.set_attention_path(hf_alibi.patch_model(tiny_gpt2()), "fastest")
    with pytest.raises(ValueError, match="patch_model first"):
        hf_alibi.set_attention_path(tiny_gpt2(), "bias")
