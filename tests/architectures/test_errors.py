"""Bad input: clear errors, and the model is left exactly as it was."""

import pytest
import torch
from tiny import random_ids, tiny_gpt2
from transformers import MambaConfig, MambaForCausalLM

import hf_alibi


def snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_untouched(model, before, cls):
    assert type(model) is cls
    assert model.config.model_type == "gpt2" and getattr(model.config, "alibi", None) is None
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_unsupported_architecture_names_the_supported_ones():
    model = MambaForCausalLM(MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=50))
    with pytest.raises(ValueError, match=r"model_type='mamba'.*gpt2.*llama.*register_architecture"):
        hf_alibi.patch_model(model)
    assert model.config.model_type == "mamba"


def test_wrong_heads_says_both_numbers_and_changes_nothing():
    model = tiny_gpt2()
    before, cls = snapshot(model), type(model)
    with pytest.raises(ValueError, match=r"heads=8 does not match the model's 4"):
        hf_alibi.patch_model(model, heads=8)
    assert_untouched(model, before, cls)


def test_encoder_variant_on_a_decoder_only_model_is_an_error():
    model = tiny_gpt2()
    before, cls = snapshot(model), type(model)
    with pytest.raises(ValueError, match="decoder-only"):
        hf_alibi.patch_model(model, encoder_variant="learned")
    assert_untouched(model, before, cls)


def test_double_patch_is_an_error_and_keeps_the_first_conversion():
    model = hf_alibi.patch_model(tiny_gpt2())
    ids = random_ids(1, 8)
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(ValueError, match="already an ALiBi model"):
        hf_alibi.patch_model(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_not_a_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_alibi.patch_model(torch.nn.Linear(2, 2))


def test_backend_without_alibi_path_says_what_to_use():
    model = hf_alibi.patch_model(tiny_gpt2())
    model.config._attn_implementation_internal = "flash_attention_3"
    with pytest.raises(NotImplementedError, match="sdpa"):
        model(random_ids(1, 4))


def test_output_attentions_needs_eager_and_works_there():
    model = hf_alibi.patch_model(tiny_gpt2(attn_implementation="eager"))
    out = model(random_ids(1, 6), output_attentions=True)
    weights = out.attentions[0][0]  # (H, q, kv)
    assert torch.allclose(weights.sum(-1), torch.ones(4, 6))
    assert (weights.triu(1) == 0).all()  # causal


def test_a_model_sharing_the_config_is_not_converted_with_it():
    original = tiny_gpt2()
    twin = type(original)(original.config).eval()
    twin.load_state_dict(original.state_dict())
    ids = random_ids(1, 8)
    with torch.no_grad():
        before = twin(ids).logits
        hf_alibi.patch_model(original)
        after = twin(ids).logits
    assert twin.config.model_type == "gpt2" and original.config.model_type == "alibi_gpt2"
    assert all(m.config is original.config for m in original.modules() if hasattr(m, "config"))
    torch.testing.assert_close(after, before, rtol=0, atol=0)
