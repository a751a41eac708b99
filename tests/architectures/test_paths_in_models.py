"""The attention paths inside whole models, every decoder row on sdpa: the automatic choice, equal to
the reference and to the bias path, with padding, KV caches (dynamic and static) and gradients.

(The successor of the GPT-2-only ``test_fast_paths_gpt2.py``: the same checks, every decoder row.)
"""

import pytest
import torch
from arch_cases import CASES
from tiny import tiny_gpt2
from transformers import StaticCache

import hf_alibi
from hf_alibi.core.bias import BIAS, FOLDED
from hf_alibi.core.dispatch import FOLD_MIN_QUERIES

# decoder-only rows whose classes allow sdpa, the backend with the fold (gemma2 soft-caps: eager / flex)
FOLDING = [case for case in CASES if case.kind == "decoder" and "sdpa" in case.backends]
IDS = [case.name for case in FOLDING]


def paths(model) -> set[str]:
    return {m.last_path for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)}


def set_path(model, path):
    hf_alibi.set_attention_path(model, path)
    assert {m.path for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)} == {path}


def patched(case, **overrides):
    return hf_alibi.patch_model(case.make(attn_implementation="sdpa", **overrides))


def padded_batch(case, length):
    ids = case.inputs(2, length, seed=7)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, : length // 3] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("length", [1, 7, 64])
@pytest.mark.parametrize("case", FOLDING, ids=IDS)
def test_folded_path_is_chosen_and_matches_reference(case, length):
    model = patched(case)
    inputs = case.inputs(2, length)
    with torch.no_grad():
        logits = model(**inputs).logits
        assert paths(model) == ({FOLDED} if length >= FOLD_MIN_QUERIES else {BIAS})
        reference = case.reference(model, inputs, None)
    torch.testing.assert_close(logits, reference.float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("length", [7, 96])
@pytest.mark.parametrize("case", FOLDING, ids=IDS)
def test_folded_equals_bias_path_with_padding_and_gradients(case, length):
    model = patched(case)  # eval: no dropout (some rows have it), gradients all the same
    ids, mask = padded_batch(case, length)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, length // 3] = -100  # predicted from a padding position, whose output is undefined
    results = {}
    for path in (FOLDED, BIAS):
        set_path(model, path)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert paths(model) == {path}
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[path] = (out.logits.detach()[mask.bool()], out.loss.detach(), grads)
    (lf, loss_f, gf), (lb, loss_b, gb) = results[FOLDED], results[BIAS]
    torch.testing.assert_close(lf, lb, rtol=0, atol=1e-4)
    torch.testing.assert_close(loss_f, loss_b, rtol=0, atol=1e-5)
    assert gf.keys() == gb.keys() and gf
    for name in gf:
        torch.testing.assert_close(gf[name], gb[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("path", ["auto", FOLDED])
@pytest.mark.parametrize("case", FOLDING, ids=IDS)
def test_padded_cache_matches_full_recompute(case, path):
    model = patched(case)
    set_path(model, path)
    ids, mask = padded_batch(case, 40)
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
@pytest.mark.parametrize("case", FOLDING, ids=IDS)
def test_static_cache_generation_equals_dynamic(case, path):
    model = patched(case)
    set_path(model, path)
    prompt = case.inputs(1, 6)["input_ids"]
    with torch.no_grad():
        dynamic = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
        cache = StaticCache(config=model.config, max_cache_len=40)
        static = model.generate(
            prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, past_key_values=cache
        )
    assert torch.equal(dynamic, static)


@pytest.mark.parametrize("case", FOLDING, ids=IDS)
def test_bf16_model_takes_the_fold_and_stays_close(case):
    model = patched(case)
    inputs = case.inputs(1, 64)
    with torch.no_grad():
        reference = case.reference(model, inputs, None).float()
        model.to(torch.bfloat16)
        logits = model(**inputs).logits.float()
    assert paths(model) == {FOLDED}  # the half-precision fold (tests/core/test_folded_half.py)
    assert (logits - reference).abs().max() <= 2e-2 * reference.abs().max() + 0.05


def layer_kinds(config) -> list[str]:
    """Each layer's attention kind as transformers builds its mask: full, or sliding window."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds else ["full_attention"] * config.num_hidden_layers


@pytest.mark.parametrize("case", FOLDING, ids=IDS)
def test_bias_path_builds_one_mask_per_layer_kind_and_forward_and_drops_them(case, attention_forwards):
    """Layers alternating sliding and full attention (Gemma 3, Cohere 2, ...) too: one mask per kind."""
    overrides = {"num_hidden_layers": 4} if case.model_type != "gpt2" else {"n_layer": 4}
    kinds = getattr(case.make().config, "layer_types", None)
    if kinds:  # the row's own pattern, repeated over four layers
        overrides["layer_types"] = (list(kinds) * 4)[:4]
    model = hf_alibi.patch_model(case.make(attn_implementation="eager", **overrides))
    ids, mask = padded_batch(case, 9)
    layers = [m for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)]
    assert len(layers) == 4 and all(layer.shared is layers[0].shared for layer in layers)  # one per model
    per_forward = len(set(layer_kinds(model.config)))
    assert per_forward < len(layers)
    with torch.no_grad():
        model(ids, attention_mask=mask)
        model(ids)
    # the AlibiForward of each forward, as its attention calls read it (StableLM's and Nemotron's from the context)
    forwards = attention_forwards()
    assert [forward.builds for forward in forwards] == [per_forward] * 2  # per forward and layer kind, not per layer
    assert layers[0].shared.traced is None and set(vars(layers[0].shared)) == {"decoding_rows", "traced"}


def test_flex_backend_forward_matches_the_sdpa_path_on_cpu_even_where_transformers_lists_no_flex():
    model = hf_alibi.patch_model(tiny_gpt2())
    # GPT-2 is not on transformers' flex list; the dispatch still goes to the registered function
    model.config._attn_implementation_internal = "flex_attention"
    case = next(case for case in CASES if case.model_type == "gpt2")
    ids, mask = padded_batch(case, 12)
    with torch.no_grad():
        flex = model(ids, attention_mask=mask).logits
        assert paths(model) == {"flex"}
        model.config._attn_implementation_internal = "sdpa"
        sdpa = model(ids, attention_mask=mask).logits
        reference = case.reference(model, {"input_ids": ids[1:]}, None)
    real = mask.bool()
    torch.testing.assert_close(flex[real], sdpa[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(flex[1], reference[0], rtol=0, atol=1e-4)


def test_set_attention_path_refuses_bad_input():
    with pytest.raises(ValueError, match="path must be one of"):
        hf_alibi.set_attention_path(hf_alibi.patch_model(tiny_gpt2()), "fastest")
    with pytest.raises(ValueError, match="patch_model first"):
        hf_alibi.set_attention_path(tiny_gpt2(), "bias")
