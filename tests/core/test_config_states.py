"""A converted model's config saves and loads in every state a user can set.

transformers' own check of ``output_attentions`` compares ``_attn_implementation`` with ``"eager"``;
an ALiBi config answers ``"alibi_eager"`` there, so ``save_pretrained`` refused an eager model with
``output_attentions = True``. The reference for each state is plain transformers: what it saves,
an ALiBi model saves, and the values read back are the ones set.
"""

import pytest
import torch
import transformers
from arch_cases import CASES

import hf_alibi

CASE = {case.name: case for case in CASES}
# (what the user does, the config values it sets, read back after a reload)
STATES = {
    "output_attentions": (lambda m: setattr(m.config, "output_attentions", True), {"output_attentions": True}),
    "output_hidden_states": (
        lambda m: setattr(m.config, "output_hidden_states", True), {"output_hidden_states": True}
    ),
    "return_dict": (lambda m: setattr(m.config, "return_dict", False), {"return_dict": False}),
    "use_cache": (lambda m: setattr(m.config, "use_cache", False), {"use_cache": False}),
    "switch_then_attentions": (
        lambda m: (m.set_attn_implementation("sdpa"), m.set_attn_implementation("eager"),
                   setattr(m.config, "output_attentions", True)),
        {"output_attentions": True},
    ),
    "attentions_off_then_sdpa": (
        lambda m: (setattr(m.config, "output_attentions", True), setattr(m.config, "output_attentions", False),
                   m.set_attn_implementation("sdpa")),
        {"output_attentions": False},
    ),
}  # fmt: skip


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_every_state_saves_and_reloads_as_plain_transformers_does(name, state, tmp_path):
    case, (apply, values) = CASE[name], STATES[state]
    for converted in (False, True):  # plain transformers first: the reference
        model = case.make(attn_implementation="eager")
        if converted:
            hf_alibi.patch_model(model)
        apply(model)
        folder = tmp_path / str(converted)
        model.save_pretrained(folder)
        config = transformers.AutoConfig.from_pretrained(folder)
        assert {key: getattr(config, key) for key in values} == values
        assert config.model_type == ("alibi_" if converted else "") + case.model_type
        loaded = getattr(transformers, case.auto_class).from_pretrained(folder, attn_implementation="eager")
        assert {key: getattr(loaded.config, key) for key in values} == values
        if converted:
            assert loaded.config._attn_implementation == "alibi_eager"


def test_output_attentions_with_eager_returns_them_after_a_reload(tmp_path):
    model = hf_alibi.patch_model(CASE["gpt2"].make(attn_implementation="eager"))
    model.config.output_attentions = True
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids = torch.randint(1, 90, (1, 6))
    with torch.no_grad():
        weights = loaded(ids).attentions  # asked by the config alone
    assert len(weights) == 2
    assert torch.allclose(weights[0].sum(-1), torch.ones(1, 4, 6)) and (weights[0].triu(1) == 0).all()


def test_output_attentions_on_sdpa_is_refused_with_what_to_do():
    model = hf_alibi.patch_model(CASE["gpt2"].make(attn_implementation="eager"))
    model.config.output_attentions = True
    model.set_attn_implementation("sdpa")  # allowed, as in transformers; saving it is not (as there)
    with pytest.raises(ValueError, match=r"set_attn_implementation\('eager'\)"):
        model.config.validate()
