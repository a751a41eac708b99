"""One conversion, planned once (``hf_alibi.plan_conversion``): the plan made from the original config and
the options is what ``patch_model`` applies, checked before anything changes; what only the weights tell (the
position tables' means, the table's rows) is measured once, when the plan is completed with the model."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny import VOCAB, random_ids, tiny_gpt2

import hf_alibi
from hf_alibi import patch as patch_module


def bert() -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=40, type_vocab_size=2,
    )  # fmt: skip
    return transformers.BertModel(config).eval()


def test_a_plan_made_before_the_model_is_the_conversion_patch_model_makes():
    planned = bert()
    plan = hf_alibi.plan_conversion(planned.config, preset="pretrained", position_mean=16)
    assert plan.alibi_class is None and plan.settings.position_mean == 16  # nothing of the weights yet
    hf_alibi.patch_model(planned, plan=plan)
    direct = hf_alibi.patch_model(bert(), preset="pretrained", position_mean=16)
    assert hf_alibi.get_settings(planned.config) == hf_alibi.get_settings(direct.config)
    ids = random_ids(2, 30)
    with torch.no_grad():
        torch.testing.assert_close(planned(ids).last_hidden_state, direct(ids).last_hidden_state, rtol=0, atol=0)


def test_the_position_means_are_measured_once_and_added_only_after_every_check(monkeypatch):
    calls = []
    measure = patch_module.position_mean_edits
    monkeypatch.setattr(patch_module, "position_mean_edits", lambda *a: calls.append(a) or measure(*a))
    model = bert()
    words = model.embeddings.token_type_embeddings.weight.detach().clone()
    table = model.embeddings.position_embeddings.weight.detach().double()
    plan = hf_alibi.plan_conversion(model.config, position_mean=8).for_model(model)
    assert len(calls) == 1 and torch.equal(model.embeddings.token_type_embeddings.weight, words)  # measured, not added
    hf_alibi.patch_model(model, plan=plan)
    assert len(calls) == 1  # patch_model adds what the completed plan measured
    expected = words + table[:8].mean(0).float()  # BERT's first position is 0: rows 0..7
    torch.testing.assert_close(model.embeddings.token_type_embeddings.weight, expected, rtol=0, atol=1e-6)


def test_a_plan_that_does_not_fit_the_model_changes_nothing():
    model = tiny_gpt2()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match="This plan converts a bert model, not gpt2"):
        hf_alibi.patch_model(model, plan=hf_alibi.plan_conversion(bert().config))
    with pytest.raises(TypeError, match="a plan or the options it is made from, not both"):
        hf_alibi.patch_model(model, sinks=1, plan=hf_alibi.plan_conversion(model.config))
    other = bert()
    completed = hf_alibi.plan_conversion(other.config, position_mean=8).for_model(other)
    with pytest.raises(ValueError, match="completed for another model"):
        hf_alibi.patch_model(bert(), plan=completed)  # its means were measured on (and would be added to) `other`
    assert not hf_alibi.is_alibi(model) and all(torch.equal(state[n], v) for n, v in model.state_dict().items())


def test_fitted_slopes_join_the_plan_as_given_slopes():
    model = tiny_gpt2()
    plan = hf_alibi.plan_conversion(model.config, preset="pretrained")
    fitted = hf_alibi.fit_slopes(model, random_ids(1, 12), sinks=plan.settings.sinks)
    settings = plan.with_slopes(fitted).settings
    given = hf_alibi.plan_conversion(model.config, preset="pretrained", slopes=fitted).settings
    assert settings == given and settings.slopes_source == "fit_slopes" and settings.slope_scale == 1.0
    assert settings.sinks == plan.settings.sinks == 1
