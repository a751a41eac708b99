"""The models trained with ALiBi (BLOOM, MPT, Falcon-RW) on the paths past one plain forward, each against
transformers' own class as in test_native_alibi.py (its references and helpers, imported from there; its docstring
says why the references are what they are): flash-attn through ``alibi_slopes`` (the kernels stood in on the CPU,
tests/flash_standin.py), transformers' continuous batching (a paged cache, chunked prefill), and Falcon's bias
rounded per key to bf16 as its own code does: on every backend, through the caches and continuous batching, and
refused on flash, which cannot round it.
"""

from __future__ import annotations

import copy
import math

import flash_standin
import pytest
import torch
import transformers
from arch_cases import FALCON_RW, MAX_LEN, NativeCase
from arch_cases import NATIVE_CASES as CASES
from test_native_alibi import BACKENDS, _transformers_slopes, attentions, padded_prompts, patched
from tiny import VOCAB, random_ids

import hf_alibi
from hf_alibi.core import flash
from hf_alibi.core.compat import store_attn_implementation


@pytest.mark.parametrize("case", [c for c in CASES if c.model_type != "falcon"], ids=lambda c: c.name)
def test_flash_through_alibi_slopes_is_close_to_transformers(case, monkeypatch):
    # Falcon refuses flash (test_falcon_refuses_flash_which_cannot_round_its_bias). MPT's forward casts its mask to
    # bool: it is handed the boolean one, and flash-attn gets the 2D padding mask read back from it
    # the kernels stood in on the CPU from flash-attn's documented contract (tests/flash_standin.py), in bf16
    kernels = (flash_standin.flash_attn_func, flash_standin.flash_attn_varlen_func)
    monkeypatch.setattr(flash, "flash_kernels", lambda device: kernels)
    original, model = patched(case)
    ids = random_ids(2, 40)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        expected = case.reference(original, 40)(ids, attention_mask=mask).logits
        store_attn_implementation(model.config, "flash_attention_2")  # transformers' setter wants flash-attn
        got = model.to(torch.bfloat16)(ids, attention_mask=mask).logits.float()
    assert {a.alibi.last_path for a in attentions(model)} == {"flash"}
    real = mask.bool()
    assert (got - expected)[real].abs().max().item() < 0.05 * expected[real].abs().max().item()


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=lambda c: c.name)
def test_flash_generation_with_the_cache_follows_transformers(case, monkeypatch):
    """Greedy generation on flash (the CPU stand-in, bf16), left padded, through the cache: each step's scores close
    to transformers' own fp32 ones (MPT with the cache asked for: its config turns it off)."""
    kernels = (flash_standin.flash_attn_func, flash_standin.flash_attn_varlen_func)
    monkeypatch.setattr(flash, "flash_kernels", lambda device: kernels)
    original, model = patched(case)
    ids, kwargs = padded_prompts(10, 3, 6)
    with torch.no_grad():
        expected = case.reference(original, 16).generate(ids, **kwargs)
        store_attn_implementation(model.config, "flash_attention_2")
        got = model.to(torch.bfloat16).generate(ids, **kwargs)
    assert {a.alibi.last_path for a in attentions(model)} == {"flash"}
    for mine, theirs in zip(got.scores, expected.scores):  # min_new_tokens makes the end token -inf on both
        finite = theirs.isfinite()
        assert torch.equal(mine.isfinite(), finite)
        assert (mine.float() - theirs)[finite].abs().max() < 0.05 * theirs[finite].abs().max()


CB_PROMPT_LENGTHS = (3, 21, 9, 2 * MAX_LEN, 5)  # past MPT's max_seq_len (16); chunked prefill beside decoding
CB_NEW_TOKENS = 8


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=lambda c: c.name)
def test_continuous_batching_gives_transformers_own_tokens_and_log_probabilities(case, backend):
    """generate_batch (transformers' continuous batching: a paged cache, requests prefilled in chunks of 16 tokens
    beside others decoding) against transformers' own class run on each whole finished sequence: every generated
    token is its greedy choice there and has its log probability (transformers' own forward of these three cannot
    run continuous batching at all: it asks the paged cache for a length)."""
    original, model = patched(case)
    model.set_attn_implementation(backend)
    generator = torch.Generator().manual_seed(5)
    requests = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in CB_PROMPT_LENGTHS]
    config = transformers.GenerationConfig(max_new_tokens=CB_NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)  # fmt: skip
    batches = transformers.ContinuousBatchingConfig(num_blocks=32, page_size=16, max_batch_tokens=16,
                                                    max_requests_per_batch=3, return_logprobs=True)  # fmt: skip
    outputs = list(model.generate_batch(requests, generation_config=config, continuous_batching_config=batches,
                                        progress_bar=False).values())  # fmt: skip
    assert len(outputs) == len(requests) and all(output.error is None for output in outputs), outputs
    for prompt, output in zip(requests, outputs):
        tokens = output.generated_tokens
        assert len(tokens) == CB_NEW_TOKENS
        full = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = case.reference(original, full.shape[1])(full).logits[0, len(prompt) - 1 : -1].double()
        assert logits.argmax(-1).tolist() == tokens
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(output.logprobs, dtype=torch.float64), expected, rtol=0, atol=2e-5)
    assert {a.alibi.last_path for a in attentions(model)} == {"bias"}  # every layer ran the paged path
    assert model.config._attn_implementation == backend  # nothing switched


def test_continuous_batching_allocates_no_dense_mask_for_the_sdpa_name():
    """transformers' continuous batching allocates (and fills) a dense mask of max_batch_tokens x (cache length) per
    layer kind for a model named "sdpa", GBs at its default sizes (checked here on transformers' own sdpa Llama); a
    patched BLOOM keeps that name, and hf_alibi's paged path makes its own mask: none is allocated for it."""
    config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    sizes = transformers.ContinuousBatchingConfig(num_blocks=8, page_size=16, max_batch_tokens=16)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    llama.set_attn_implementation("sdpa")
    _, model = patched(CASES[0])
    for candidate, dense in ((llama, True), (model, False)):
        manager = candidate.init_continuous_batching(generation_config=config, continuous_batching_config=sizes)
        processor = manager._create_batch_processor()  # what the manager's start makes (transformers 5.24)
        assert (processor.inputs_and_outputs.attention_mask is not None) == dense
    assert model.config._attn_implementation == "sdpa"


# falcon-rw-1b's head count: slopes 2^(-h/4), not powers of two, which Falcon's code rounds to bf16
FALCON_32 = NativeCase("falcon-rw-32", "falcon", dict(FALCON_RW, num_attention_heads=32, hidden_size=64))


def test_falcon_32_heads_slopes_are_falcons_bf16_ones():
    original, model = patched(FALCON_32)
    expected = _transformers_slopes(FALCON_32, model)
    assert list(attentions(model)[0].alibi.slope_values) == pytest.approx(expected, rel=1e-12)
    unrounded = [s / math.sqrt(2) for s in hf_alibi.get_slopes_list(32)]  # head_dim 2
    assert max(abs(a - b) / b for a, b in zip(unrounded, expected)) > 1e-3  # the rounding is real at 32 heads


ROUNDED_LENGTH = 300  # past 256: bf16 holds neither m * p nor p itself exactly any more


def _unrounded(model):
    """A copy of ``model`` whose layers add the plain linear bias (the per-key rounding taken out)."""
    plain = copy.deepcopy(model)
    for attention in attentions(plain):
        attention.alibi.rounding = None
        attention.alibi.path = attention.alibi.path  # what the merged masks are shared by
    return plain


def test_falcon_bias_rounded_per_key_equals_transformers_on_every_backend():
    """transformers' Falcon computes each key's bias as bf16(bf16(m) * bf16(p)), p counted from the row's first real
    token: the rounding is data (KeyRounding) that every path renders. 32 heads (slopes 2^(-h/4), none exact in bf16
    products), 300 tokens, left padding; the plain linear bias misses by far more (checked, so the check can fail)."""
    original, model = patched(FALCON_32)
    ids = random_ids(2, ROUNDED_LENGTH)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        expected = original(ids, attention_mask=mask).logits
        unpadded = original(ids).logits
        for backend in BACKENDS:
            model.set_attn_implementation(backend)
            got = model(ids, attention_mask=mask).logits
            torch.testing.assert_close(got[0], expected[0], rtol=0, atol=2e-5, msg=backend)
            torch.testing.assert_close(got[1, 37:], expected[1, 37:], rtol=0, atol=2e-5, msg=backend)
            torch.testing.assert_close(model(ids).logits, unpadded, rtol=0, atol=2e-5, msg=backend)  # no mask at all
        model.set_attn_implementation("sdpa")
        assert (_unrounded(model)(ids).logits - unpadded).abs().max() > 1e-3


def test_falcon_bias_rounded_per_key_in_generation_and_continuous_batching():
    """The rounded bias through the dynamic cache (decoding rows on the bias path), a static cache, and continuous
    batching (positions counted within each request): each step's scores against transformers' own Falcon."""
    original, model = patched(FALCON_32)
    ids, kwargs = padded_prompts(ROUNDED_LENGTH - 20, 9, 6)
    with torch.no_grad():
        expected = original.generate(ids, **kwargs)
        for cache in ("dynamic", "static"):
            got = model.generate(ids, cache_implementation=cache, **kwargs)
            assert torch.equal(got.sequences, expected.sequences), cache
            for mine, theirs in zip(got.scores, expected.scores):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-5, msg=cache)
    requests = [ids[1].tolist(), ids[1, :20].tolist()]
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batches = transformers.ContinuousBatchingConfig(num_blocks=64, page_size=16, max_batch_tokens=64,
                                                    max_requests_per_batch=2, return_logprobs=True)  # fmt: skip
    outputs = list(model.generate_batch(requests, generation_config=config, continuous_batching_config=batches,
                                        progress_bar=False).values())  # fmt: skip
    for prompt, output in zip(requests, outputs):
        full = torch.tensor([prompt + output.generated_tokens])
        with torch.no_grad():
            logits = original(full).logits[0, len(prompt) - 1 : -1].double()
        assert logits.argmax(-1).tolist() == output.generated_tokens
        chosen = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor(output.generated_tokens)]
        torch.testing.assert_close(torch.tensor(output.logprobs, dtype=torch.float64), chosen, rtol=0, atol=2e-5)


def test_falcon_refuses_flash_which_cannot_round_its_bias():
    _, model = patched(FALCON_32)
    with pytest.raises(ValueError, match="cannot round each key's bias to bfloat16") as error:
        model.set_attn_implementation("flash_attention_2")
    assert "\n" not in str(error.value) and model.config._attn_implementation == "sdpa"
