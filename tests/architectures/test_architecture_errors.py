"""Bad input for every architecture: clear errors, and the model is left exactly as it was."""

import re

import pytest
import torch
from arch_cases import CASE_IDS, CASES, NATIVE_CASES

import hf_alibi
from hf_alibi.core.slopes import CAUSAL


def snapshot(model):
    return type(model), model.config.model_type, {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model, before):
    cls, model_type, weights = before
    assert type(model) is cls and model.config.model_type == model_type
    assert getattr(model.config, "alibi", None) is None
    after = model.state_dict()
    assert after.keys() == weights.keys() and all(torch.equal(after[k], weights[k]) for k in weights)
    assert not any(isinstance(m, hf_alibi.AlibiBias) for m in model.modules())


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bad_encoder_variant_is_an_error_and_changes_nothing(case):
    model = case.make()
    before = snapshot(model)
    if case.bidirectional:
        with pytest.raises(ValueError, match=r"encoder_variant must be one of .*symmetric.*nonsymmetric.*learned"):
            hf_alibi.patch_model(model, encoder_variant="left")
    else:
        with pytest.raises(ValueError, match="decoder-only.*Omit encoder_variant"):
            hf_alibi.patch_model(model, encoder_variant="symmetric")
    assert_untouched(model, before)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_wrong_heads_is_an_error_and_changes_nothing(case):
    model = case.make()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"heads=3 does not match the model's 4"):
        hf_alibi.patch_model(model, heads=3)
    assert_untouched(model, before)


def test_unknown_model_type_names_every_registered_one():
    listed = re.escape(", ".join(sorted({case.model_type for case in CASES})))
    native = ", ".join(sorted({case.model_type for case in NATIVE_CASES}))
    listed += re.escape(f" (trained with ALiBi, run as they are: {native})")
    with pytest.raises(ValueError, match=listed + r"\. To add one.*register_architecture"):
        hf_alibi.get_architecture("mamba")


def test_t5_bias_kinds_per_attention_layer():
    case = next(case for case in CASES if case.model_type == "t5")
    model = hf_alibi.patch_model(case.make(), encoder_variant="learned")
    for block in model.encoder.block:
        assert block.layer[0].SelfAttention.alibi.kind == "learned"
    for block in model.decoder.block:
        assert block.layer[0].SelfAttention.alibi.kind == CAUSAL
        assert not hasattr(block.layer[1].EncDecAttention, "alibi")  # cross-attention: no position bias
    assert all(not m.has_relative_attention_bias for m in model.modules() if hasattr(m, "has_relative_attention_bias"))
    assert hf_alibi.is_alibi(model.encoder.config) and hf_alibi.is_alibi(model.decoder.config)
