"""Every output transformers records survives the conversion, for base and task models.

transformers 5 records hidden states, attentions (and router logits, cross-attentions ...) through
hooks chosen by the model's class; the conversion swaps the class. For every row, on eager: the
converted model returns every output the unpatched one returns, with the same count and shapes; the
first hidden state (the embeddings, before any attention) equals the unpatched model's with its
absolute position table zeroed (rows whose embeddings add positions) or as it is (the others); the
attentions are causal or full distributions. A base model saved and loaded back returns the same.
"""

import copy

import pytest
import torch
import transformers
from arch_cases import CASE_IDS, CASES, FULL_CASE_IDS, FULL_CASES
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

import hf_alibi

# Where the absolute position table sits in each base model whose embeddings add positions: the
# reference zeroes it (written here, not read from hf_alibi's rows).
POSITION_TABLES = {
    "gpt2": "wpe",
    "opt": "decoder.embed_positions",
    "bert": "embeddings.position_embeddings",
    "roberta": "embeddings.position_embeddings",
}
LENGTH = 12  # within the unpatched models' 16 positions
FLAGS = {"output_hidden_states": True, "output_attentions": True}


def base_model_of(case):
    """The AutoModel class of the row, built from the row's tiny config (eager)."""
    config = case.make(attn_implementation="eager").config
    torch.manual_seed(0)
    return getattr(transformers, MODEL_MAPPING_NAMES[case.model_type])(config).eval()


def run(model, case, inputs):
    flags = dict(FLAGS)
    if hasattr(model.config, "output_router_logits"):  # the MoE rows record the router's logits too
        flags["output_router_logits"] = True
    with torch.no_grad():
        return model(**inputs, **flags)


def recorded(output) -> dict:
    """Every tuple output (hidden states, attentions, ...) by name, the ``None`` ones dropped."""
    return {key: value for key, value in output.items() if isinstance(value, tuple) and key != "past_key_values"}


def shapes(value) -> list:
    return [tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__ for item in value]


def embeddings_reference(case, original, inputs) -> dict:
    """First hidden state(s) of the unpatched model with its position table zeroed."""
    reference = copy.deepcopy(original)
    table = POSITION_TABLES.get(case.model_type)
    if table is not None:
        with torch.no_grad():
            reference.base_model.get_submodule(table).weight.zero_()
    out = run(reference, case, inputs)
    return {key: value[0] for key, value in recorded(out).items() if key.endswith("hidden_states")}


def check_outputs(case, original, converted_out, original_out, reference):
    want, got = recorded(original_out), recorded(converted_out)
    assert set(got) == set(want), (sorted(got), sorted(want))
    attentions = [key for key in want if key.endswith("attentions") and not key.startswith("cross")]
    assert attentions and reference and all(len(want[key]) > 0 for key in [*attentions, *reference])
    for key, value in want.items():  # cross_attentions: () where the model has none, in both
        assert shapes(got[key]) == shapes(value), key
    for key, first in reference.items():
        torch.testing.assert_close(got[key][0], first, rtol=0, atol=1e-6)
    for key in ("attentions", "encoder_attentions", "decoder_attentions"):
        for weights in got.get(key, ()):  # (B, H, q, kv): distributions over the keys
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), rtol=0, atol=1e-5)
            causal = key == "decoder_attentions" or (key == "attentions" and case.kind == "decoder")
            if causal:
                assert (weights.triu(1) == 0).all(), key


def test_every_absolute_row_has_its_table_here():
    absolute = {t for t in hf_alibi.supported_model_types() if hf_alibi.get_architecture(t).strategy == "absolute"}
    assert absolute == set(POSITION_TABLES)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("which", ["base", "task"])
def test_converted_models_return_every_recorded_output(case, which):
    original = base_model_of(case) if which == "base" else case.make(attn_implementation="eager")
    inputs = case.inputs(2, LENGTH)
    original_out = run(original, case, inputs)
    reference = embeddings_reference(case, original, inputs)
    converted = hf_alibi.patch_model(copy.deepcopy(original))
    check_outputs(case, original, run(converted, case, inputs), original_out, reference)


@pytest.mark.parametrize("case", FULL_CASES, ids=FULL_CASE_IDS)  # the rows that persistence covers
def test_base_model_loaded_back_returns_the_same_outputs(case, tmp_path):
    converted = hf_alibi.patch_model(base_model_of(case))
    converted.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded).__name__ == "Alibi" + MODEL_MAPPING_NAMES[case.model_type]
    inputs = case.inputs(2, 3 * LENGTH)  # past the original length: ALiBi's own
    want, got = recorded(run(converted, case, inputs)), recorded(run(loaded, case, inputs))
    assert set(got) == set(want) and any(len(value) > 0 for value in want.values())
    for key, value in want.items():
        assert len(got[key]) == len(value), key
        for a, b in zip(got[key], value, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
