"""The models trained with ALiBi (hf_alibi/native/) at the edges transformers' own model tests reach: built on the
meta device, the caller's config, attention weights asked of the default backend, the refusal of a backend.

The references are transformers' own classes, unpatched (the same weights), as in test_native_alibi.py; Falcon's
own code adds its bias twice wherever it returns weights (see that module's docstring), so its weights are checked
against the patched model's eager ones, whose logits test_native_alibi.py checks against transformers'.
"""

from __future__ import annotations

import copy

import pytest
import torch
from arch_cases import NATIVE_CASES as CASES
from tiny import random_ids

import hf_alibi
from hf_alibi.native import is_native

IDS = [case.name for case in CASES]
ONE_EACH = [next(c for c in CASES if c.model_type == t) for t in ("bloom", "mpt", "falcon")]


@pytest.mark.parametrize("case", ONE_EACH, ids=lambda c: c.name)
def test_built_on_meta_patches_then_to_empty_and_loaded_weights_equal_the_cpu_model(case):
    on_cpu = case.make()
    reference = hf_alibi.patch_model(copy.deepcopy(on_cpu))
    with torch.device("meta"):  # transformers' test_can_be_initialized_on_meta, the patch included
        patched = hf_alibi.patch_model(type(on_cpu)(copy.deepcopy(on_cpu.config)))  # Falcon rounds its slopes
    assert is_native(patched)
    # transformers' test_all_tensors_are_parameter_or_buffer: every tensor the model holds moves with it
    assert all(t.device.type == "meta" for t in [*patched.parameters(), *patched.buffers()])
    patched.to_empty(device="cpu")
    patched.init_weights()  # test_init_weights_can_init_buffers: the buffers from the config
    assert dict(patched.named_buffers()).keys() == dict(on_cpu.named_buffers()).keys()
    for name, buffer in patched.named_buffers():
        torch.testing.assert_close(buffer, dict(on_cpu.named_buffers())[name], rtol=0, atol=0, msg=name)
    patched.load_state_dict(on_cpu.state_dict())
    slopes = [m.alibi.slope_values for m in reference.modules() if hasattr(m, "alibi")]
    assert [m.alibi.slope_values for m in patched.modules() if hasattr(m, "alibi")] == slopes
    ids = random_ids(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(patched.eval()(ids).logits, reference(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("case", ONE_EACH, ids=lambda c: c.name)
def test_the_callers_config_is_left_as_it_was(case):
    model = case.make()
    config = model.config
    before = config.to_dict()
    implementation = config._attn_implementation
    patched = hf_alibi.patch_model(model)
    assert patched.config._attn_implementation == "sdpa"
    assert config._attn_implementation == implementation and config.to_dict() == before
    # transformers' test_base_model_prefix_loads_base_weights: a base model built from that config afterwards
    base = type(model.base_model)(config)
    assert type(base) is type(model.base_model).__mro__[0] and not is_native(base)
    with torch.no_grad():
        base(random_ids(1, 6))


@pytest.mark.parametrize("case", [c for c in CASES if c.model_type != "falcon"], ids=lambda c: c.name)
def test_attention_weights_on_the_default_backend_equal_transformers_eager(case):
    original = case.make()
    model = hf_alibi.patch_model(copy.deepcopy(original))
    assert model.config._attn_implementation == "sdpa"
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = case.reference(original, 12)(ids, output_attentions=True)
        got = model(ids, output_attentions=True)
    assert len(got.attentions) == len(expected.attentions) == 2
    for g, e in zip(got.attentions, expected.attentions):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=2e-5)
    with torch.no_grad():  # the base model called directly, past its task head
        expected = case.reference(original, 12).base_model(ids, output_attentions=True).attentions
        got = model.base_model(ids, output_attentions=True).attentions
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"  # only those calls ran on eager


def test_falcon_attention_weights_on_the_default_backend_equal_its_eager_ones():
    case = next(c for c in CASES if c.model_type == "falcon")
    original = case.make()
    model = hf_alibi.patch_model(copy.deepcopy(original))
    eager = hf_alibi.patch_model(copy.deepcopy(original))
    eager.set_attn_implementation("eager")
    ids = random_ids(2, 12)
    with torch.no_grad():
        got = model(ids, output_attentions=True)
        expected = eager(ids, output_attentions=True)
        plain = original(ids).logits  # transformers' sdpa: Falcon's one path that adds its bias once
    assert len(got.attentions) == 2 and all(a is not None for a in got.attentions)
    for g, e in zip(got.attentions, expected.attentions):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
        assert torch.all(g.triu(1) == 0)  # causal: no weight on a later key
    torch.testing.assert_close(got.logits, plain, rtol=0, atol=2e-5)


@pytest.mark.parametrize("case", ONE_EACH, ids=lambda c: c.name)
def test_an_unknown_backend_is_refused_with_what_this_model_runs(case):
    model = hf_alibi.patch_model(case.make())
    with pytest.raises(ValueError) as error:
        model.set_attn_implementation("vllm_attention")
    message = str(error.value)
    assert "\n" not in message and "converted" not in message and case.model_type in message
    # Falcon's bias rounded per key has no flash form (test_native_kernels.py: test_falcon_refuses_flash...)
    expected = ["eager", "sdpa", "flex_attention"] + ([] if case.model_type == "falcon" else ["flash_attention_2"])
    listed = [b for b in ("eager", "sdpa", "flex_attention", "flash_attention_2") if repr(b) in message]
    assert listed == expected, message
