"""An attention function hf_alibi has no ALiBi path for (another engine's, a hub kernel, a future backend) is
refused in one line, however it is set, and never runs; converted classes tell engines that check
``is_backend_compatible()`` (vLLM's and SGLang's transformers backends) that theirs cannot run them."""

import pytest
import torch
from arch_cases import CASE_IDS, CASES
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_alibi

ENGINE = "engine_under_test"
CALLS = []


def engine_attention(*args, **kwargs):  # a stand-in engine: transformers' sdpa, with no bias, counted
    CALLS.append(1)
    return sdpa_attention_forward(*args, **kwargs)


AttentionInterface.register(ENGINE, engine_attention)


def refusal_is_one_line(error: Exception) -> None:
    message = str(error)
    assert "\n" not in message and ENGINE in message and "'sdpa'" in message and "export-gguf" in message


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_converted_classes_are_not_backend_compatible(case):
    original = case.make()
    assert type(hf_alibi.patch_model(original)).is_backend_compatible() is False


@pytest.mark.parametrize("how", ["config", "set_attn_implementation"])
def test_setting_a_foreign_function_is_refused_and_changes_nothing(how):
    case = next(c for c in CASES if c.name == "llama")
    model = hf_alibi.patch_model(case.make())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(ids).logits
    CALLS.clear()
    with pytest.raises(ValueError) as caught:
        if how == "config":
            model.config._attn_implementation = ENGINE  # what vLLM's transformers backend does
        else:
            model.set_attn_implementation(ENGINE)
    refusal_is_one_line(caught.value)
    assert model.config._attn_implementation == "alibi_sdpa"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    assert not CALLS


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in ("gpt2", "llama", "bert", "t5")], ids=lambda case: case.name
)
def test_a_foreign_name_written_past_the_setter_never_runs(case):
    model = hf_alibi.patch_model(case.make())
    for module in model.modules():  # an engine writing the stored name directly, on every sub-config
        config = getattr(module, "config", None)
        if config is not None:
            config._attn_implementation_internal = ENGINE
    CALLS.clear()
    with pytest.raises(ValueError) as caught, torch.no_grad():
        model(**case.inputs(1, 8))
    refusal_is_one_line(caught.value)
    assert not CALLS


def test_reloading_with_the_reported_name_keeps_the_backend(tmp_path):
    # TRL's DPO/KTO/GRPO/RLOO build a reference model with attn_implementation=policy.config._attn_implementation
    from transformers import AutoModelForCausalLM

    case = next(c for c in CASES if c.name == "llama")
    model = hf_alibi.patch_model(case.make())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=model.config._attn_implementation)
    assert reloaded.config._attn_implementation == "alibi_sdpa"
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_continuous_batching_runs_only_through_alibi_paths():
    # successor of test_continuous_batching_is_refused_in_one_line: transformers' continuous batching now runs a
    # converted model through its alibi_<backend> function (tests/core/test_batching.py checks
    # the numbers); a backend without a paged ALiBi path, a foreign one included, is refused in one line and never runs
    from transformers import GenerationConfig

    case = next(c for c in CASES if c.name == "llama")
    model = hf_alibi.patch_model(case.make())
    greedy = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    expected = model.generate(torch.tensor([[3, 4, 5]]), generation_config=greedy)[0, 3:].tolist()
    CALLS.clear()
    (output,) = model.generate_batch(inputs=[[3, 4, 5]], generation_config=greedy, progress_bar=False).values()
    assert output.generated_tokens == expected and model.config._attn_implementation == "alibi_sdpa"
    assert {m.last_path for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)} == {"bias"}
    for module in model.modules():  # an engine writing its name past the setter
        config = getattr(module, "config", None)
        if config is not None:
            config._attn_implementation_internal = ENGINE
    with pytest.raises(ValueError) as caught:
        model.generate_batch(inputs=[[3, 4, 5]], generation_config=greedy)
    refusal_is_one_line(caught.value)
    with pytest.raises(ValueError):
        with model.continuous_batching_context_manager(generation_config=greedy):
            pass
    assert not CALLS
