"""transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, the context manager) on
converted decoders: every decoder row whose original runs in it, on ``alibi_sdpa`` and ``alibi_eager``.

Token references: each request's greedy ``generate()`` alone (the same converted model, a plain dynamic cache,
which tests/architectures/test_architectures.py checks against tests/reference.py). Logits references: the log
probability continuous batching reports for each generated token against tests/reference.py's explicit-bias
forward of the whole sequence (float64 attention, written without hf_alibi). The batches are kept small (16 tokens
a step, 3 requests) so that prompts past the tiny configs' 16 positions are prefilled in chunks that read the paged
cache, and new requests are prefilled beside others that decode.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from arch_cases import CASES, MAX_LEN, VOCAB
from packaging.version import Version
from reference import (
    fairseq_slopes,
    gpt2_reference_logits,
    retained_rotary_reference_logits,
    rotary_reference_logits,
    sink_bias,
)
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.utils import logging

import hf_alibi
from hf_alibi.core.bias import BIAS

logging.set_verbosity_error()

# Rows whose original transformers cannot run in continuous batching (transformers 5.24): their forward asks the
# paged cache for a length (OPT), calls its update() the pre-5 way (GPT-NeoX, Persimmon) or reads keyword arguments
# it does not pass (StableLM, Nemotron). The converted model fails the same way (checked below).
# Before 5.24 (checked on 5.19) the attention function writes the paged cache, not the layer: GPT-NeoX runs, and
# OPT's converted model runs (its position table, which asked the length, is gone) where its original fails;
# StableLM's and Nemotron's layers drop the keyword arguments, which hf_alibi's attention says in one line.
BEFORE_5_24 = Version(transformers.__version__) < Version("5.24")
ORIGINAL_FAILS = {"opt", "stablelm", "nemotron", "persimmon"} | (set() if BEFORE_5_24 else {"gpt_neox"})
CONVERTED_RUNS = {"opt"} if BEFORE_5_24 else set()
NO_LAYER_ARGUMENTS = "A continuous-batching attention call came without its layer's cu_seq_lens_k."
CONVERTED_ERROR = {"stablelm": NO_LAYER_ARGUMENTS, "nemotron": NO_LAYER_ARGUMENTS} if BEFORE_5_24 else {}
DECODERS = [case for case in CASES if case.kind == "decoder"]
CB_CASES = [case for case in DECODERS if case.model_type not in ORIGINAL_FAILS - CONVERTED_RUNS]
PAGED = ("eager", "sdpa")
# prompt lengths: past MAX_LEN (16) and past the sliding rows' window (8); 10 new tokens each
LENGTHS = (3, 21, 9, 2 * MAX_LEN, 5)
NEW_TOKENS = 10


def prompts(seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


def small_batches(**overrides) -> ContinuousBatchingConfig:
    values = dict(num_blocks=32, page_size=16, max_batch_tokens=16, max_requests_per_batch=3)
    return ContinuousBatchingConfig(**{**values, **overrides})


def greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


def alone(model, requests: list[list[int]]) -> list[list[int]]:
    """Each request's greedy tokens from generate() on it alone."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=greedy())[0, len(p) :].tolist() for p in requests]


def batched(model, requests: list[list[int]], **config) -> list:
    """generate_batch's outputs in request order, none failed."""
    outputs = list(model.generate_batch(requests, generation_config=greedy(), continuous_batching_config=small_batches(
        **config), progress_bar=False).values())  # fmt: skip
    assert len(outputs) == len(requests) and all(output.error is None for output in outputs), outputs
    return outputs


def paths(model) -> set:
    return {m.last_path for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)}


def backends(case) -> list[str]:
    return [backend for backend in case.backends if backend in PAGED]


@pytest.mark.parametrize("case", CB_CASES, ids=lambda case: case.name)
def test_generate_batch_gives_each_request_its_greedy_tokens_alone(case):
    requests = prompts()
    for backend in backends(case):
        model = hf_alibi.patch_model(case.make(attn_implementation=backend))
        expected = alone(model, requests)
        for module in model.modules():
            if isinstance(module, hf_alibi.AlibiBias):
                module.last_path = None
        got = [output.generated_tokens for output in batched(model, requests)]
        assert got == expected, backend
        assert paths(model) == {BIAS}  # every layer ran hf_alibi's paged path
        assert model.config._attn_implementation == f"alibi_{backend}"  # nothing switched


def reference_logprobs(logits: torch.Tensor, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token k | prompt + tokens[:k]) from reference logits over the whole sequence ``(1, L, V)``."""
    rows = torch.log_softmax(logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].double(), dim=-1)
    return rows[torch.arange(len(tokens)), torch.tensor(tokens)]


def assert_logprobs_match(model, reference, **config):
    """Each generated token's log probability in continuous batching against ``reference(ids) -> logits``."""
    requests = prompts()
    outputs = batched(model, requests, return_logprobs=True, **config)
    for prompt, output in zip(requests, outputs):
        assert len(output.logprobs) == NEW_TOKENS
        with torch.no_grad():
            expected = reference_logprobs(reference(torch.tensor([prompt + output.generated_tokens])), prompt,
                                          output.generated_tokens)  # fmt: skip
        torch.testing.assert_close(torch.tensor(output.logprobs, dtype=torch.float64), expected, rtol=0, atol=2e-5)


# full attention with grouped KV heads (llama), every layer sliding (mistral), sliding and full layers (gemma3),
# GPT-2's own blocks
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3_text", "gpt2"])
@pytest.mark.parametrize("backend", PAGED)
def test_log_probabilities_match_the_explicit_bias_reference(name, backend):
    case = next(c for c in CASES if c.name == name)
    model = hf_alibi.patch_model(case.make(attn_implementation=backend))
    if name == "gpt2":
        assert_logprobs_match(model, lambda ids: gpt2_reference_logits(model, ids))
    else:
        assert_logprobs_match(model, lambda ids: rotary_reference_logits(case.make, model, ids))


THETA, WAVELENGTH = 10000.0, 16384.0  # the preset's rotary bound: 1024 x the original 16 positions (all kept)


def llama(backend: str):
    """A tiny Llama with the default rope (theta given: the reference recomputes its frequencies)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=MAX_LEN, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": THETA},
        attn_implementation=backend,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("backend", PAGED)
def test_the_pretrained_preset_matches_the_reference(backend):
    """One sink, slopes x 0.01, the short rotary wavelengths kept and the long ones slowed past the original length
    (each request's own positions reach the retained rotary): log probabilities against a loop-built bias, tokens
    against generate() alone."""
    model = hf_alibi.patch_model(llama(backend), preset="pretrained")
    settings = hf_alibi.get_settings(model.config)
    assert settings.sinks == 1 and settings.rotary_max_wavelength == WAVELENGTH
    slopes = [settings.slope_scale * s for s in fairseq_slopes(4)]

    def reference(ids):
        bias = sink_bias("causal", slopes, ids.shape[1], settings.sinks, [0])
        make = lambda **kw: llama(kw["attn_implementation"])  # noqa: E731
        knee, stretch = settings.rotary_knee, settings.rotary_stretch  # the original length, past which it slows
        return retained_rotary_reference_logits(make, model, ids, None, bias, WAVELENGTH, THETA, knee, stretch)

    assert_logprobs_match(model, reference)
    assert [o.generated_tokens for o in batched(model, prompts(seed=4))] == alone(model, prompts(seed=4))


@pytest.mark.parametrize("backend", PAGED)
def test_sinks_match_the_reference(backend):
    """GPT-2 with two sinks: the first two keys of each request carry no bias, whatever its neighbours' lengths."""
    case = next(c for c in CASES if c.name == "gpt2")
    model = hf_alibi.patch_model(case.make(attn_implementation=backend), sinks=2)
    slopes = fairseq_slopes(4)
    assert_logprobs_match(model, lambda ids: gpt2_reference_logits(model, ids, sink_bias("causal", slopes, ids.shape[
        1], 2, [0])))  # fmt: skip


# sinks where the window drops old keys (mistral: every layer sliding; gemma3: sliding and full layers)
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3_text"])
def test_sinks_give_each_request_its_greedy_tokens_alone(name):
    case = next(c for c in CASES if c.name == name)
    for backend in PAGED:
        model = hf_alibi.patch_model(case.make(attn_implementation=backend), sinks=2)
        assert [o.generated_tokens for o in batched(model, prompts())] == alone(model, prompts()), backend


def test_the_context_manager_and_a_persistent_manager_serve_requests_one_by_one():
    case = next(c for c in CASES if c.name == "mistral")
    model = hf_alibi.patch_model(case.make())
    requests = prompts(seed=5)
    expected = alone(model, requests)
    with model.continuous_batching_context_manager(
        generation_config=greedy(), continuous_batching_config=small_batches(), persistent_manager=True
    ) as manager:
        ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in requests]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=30)
            assert result is not None
            if result.is_finished():
                results[result.request_id] = result.generated_tokens
    assert [results[i] for i in ids] == expected
    manager = model.init_continuous_batching()  # the kept manager, checked again
    assert manager is model._cached_continuous_batching_manager
    model.destroy_cached_continuous_batching_manager()


def one_line(error: Exception, *words: str) -> None:
    assert "\n" not in str(error) and all(word in str(error) for word in words), str(error)


def test_what_has_no_paged_alibi_path_is_refused_in_one_line():
    case = next(c for c in CASES if c.name == "llama")
    model = hf_alibi.patch_model(case.make())
    model.set_attn_implementation("flex_attention")
    for start in (
        lambda: model.generate_batch([[3, 4, 5]], generation_config=greedy()),
        lambda: model.init_continuous_batching(generation_config=greedy()),
    ):
        with pytest.raises(ValueError) as caught:
            start()
        one_line(caught.value, "'flex_attention'", "set_attn_implementation('sdpa')")
    assert model.config._attn_implementation == "alibi_flex_attention"  # left as it was
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError) as caught:
        model.init_continuous_batching(generation_config=greedy(), continuous_batching_config=small_batches(
            default_compile_level=1))  # fmt: skip
    one_line(caught.value, "torch.compile", "default_compile_level")
    t5 = hf_alibi.patch_model(next(c for c in CASES if c.name == "t5").make())
    with pytest.raises(ValueError) as caught:
        t5.init_continuous_batching(generation_config=greedy())
    one_line(caught.value, "decoder-only", "generate()")


@pytest.mark.parametrize(
    "case", [c for c in DECODERS if c.model_type in ORIGINAL_FAILS - CONVERTED_RUNS], ids=lambda case: case.name
)
def test_rows_whose_original_fails_in_continuous_batching_fail_the_same_way(case):
    """If transformers makes one of these run, this fails: move the row to CB_CASES. Where hf_alibi's attention
    sees what is missing first, its one line (CONVERTED_ERROR)."""
    original = case.make()
    model = hf_alibi.patch_model(case.make())
    errors = []
    for candidate in (original, model):
        outputs = candidate.generate_batch(prompts()[:2], generation_config=greedy(),
                                           continuous_batching_config=small_batches(), progress_bar=False)  # fmt: skip
        # every request fails (on 5.19 the originals of StableLM and Nemotron give a first token, then fail)
        assert all(o.error is not None and (candidate is original or not o.generated_tokens) for o in outputs.values())
        errors.append({o.error for o in outputs.values()})
    assert errors[1] == ({CONVERTED_ERROR[case.model_type]} if case.model_type in CONVERTED_ERROR else errors[0])


CHILD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.utils import logging

logging.set_verbosity_error()
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained("model", trust_remote_code=True).eval()
greedy = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
outputs = model.generate_batch(PROMPTS, generation_config=greedy, continuous_batching_config=ContinuousBatchingConfig(
    num_blocks=32, page_size=16, max_batch_tokens=16, max_requests_per_batch=3), progress_bar=False)
print(json.dumps({"name": model.config._attn_implementation, "hf_alibi": "hf_alibi" in sys.modules,
                  "tokens": [o.generated_tokens for o in outputs.values()]}))
"""


def test_a_checkpoint_loaded_as_remote_code_runs_its_own_paged_path(tmp_path):
    """The core copied into a saved folder (alibi_remote_sdpa, its own batching.py), in a process without
    hf_alibi: the tokens of the library's model on each request alone (sinks, sliding and full layers)."""
    from sharing import last_json_line, run_child

    case = next(c for c in CASES if c.name == "gemma3_text")
    model = hf_alibi.patch_model(case.make(), sinks=2)
    model.save_pretrained(tmp_path / "model")
    code = CHILD.replace("NEW_TOKENS", str(NEW_TOKENS)).replace("PROMPTS", repr(prompts()))
    child = run_child(code, tmp_path, tmp_path / "hf", block_hf_alibi=True)
    assert child.returncode == 0, child.stderr
    result = last_json_line(child.stdout)
    assert result["name"] == "alibi_remote_sdpa" and not result["hf_alibi"]
    assert result["tokens"] == alone(model, prompts())
