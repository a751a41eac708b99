"""Converting pretrained weights: every weight that is not the position path is kept, by name and value;
models loaded in bfloat16 or with a device map convert too."""

import pytest
import torch
import transformers
from arch_cases import CASE_IDS, CASES, MAX_LEN

import hf_alibi

# The weights each strategy removes, written out per model type (nothing is read from hf_alibi). The rotary
# decoders lose nothing: their inverse frequencies are buffers that state dicts never held.
REMOVED = {
    "gpt2": {"transformer.wpe.weight"},
    "opt": {"model.decoder.embed_positions.weight"},
    "bert": {"bert.embeddings.position_embeddings.weight"},
    "roberta": {"roberta.embeddings.position_embeddings.weight"},
    "t5": {
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    },
}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_conversion_keeps_every_weight_it_does_not_remove(case):
    model = case.make()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    hf_alibi.patch_model(model, encoder_variant=case.variants[0])
    after = model.state_dict()
    removed = REMOVED.get(case.model_type, set())
    assert removed <= set(before), sorted(before)  # the names above are real ones
    assert set(before) - set(after) == removed
    added = set(after) - set(before)
    assert all(name.endswith(("slopes_left", "slopes_right")) for name in added), added  # learned slopes only
    assert bool(added) == (case.variants[0] == "learned")
    for name in set(before) - removed:
        assert after[name].dtype == before[name].dtype, name
        assert torch.equal(after[name], before[name]), name


LOADED = ["gpt2", "opt", "llama", "mixtral", "t5"]  # each strategy; mixtral: its experts are renamed on load
LOADED_CASES = [next(case for case in CASES if case.name == name) for name in LOADED]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The original (unconverted) tiny models saved with save_pretrained, as a user's checkpoint would be."""
    root = tmp_path_factory.mktemp("pretrained")
    for case in LOADED_CASES:
        case.make().save_pretrained(root / case.name)
    return root


def _load(case, folder, **kwargs):
    return getattr(transformers, case.auto_class).from_pretrained(folder, **kwargs).eval()


@pytest.mark.parametrize("case", LOADED_CASES, ids=LOADED)
def test_a_model_loaded_in_bfloat16_converts(case, folders):
    folder = folders / case.name
    model = _load(case, folder, torch_dtype=torch.bfloat16)
    loaded = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert {t.dtype for t in loaded.values() if t.is_floating_point()} == {torch.bfloat16}
    hf_alibi.patch_model(model, encoder_variant=case.variants[0])
    after = model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in loaded.items() if name in after)
    assert {t.dtype for t in after.values() if t.is_floating_point()} == {torch.bfloat16}
    inputs = case.inputs(2, 4 * MAX_LEN)
    with torch.no_grad():
        out = model(**inputs).logits
        reference = case.reference(model.float(), inputs, case.variants[0]).float()  # the bf16 weights, in fp32
    assert out.dtype == torch.bfloat16
    # bf16 activations: within 2% of the largest logit (measured: 0.3% to 0.7%)
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=0.02 * reference.abs().max().item())
    with torch.no_grad():  # the same model in fp32: the reference's numbers exactly
        torch.testing.assert_close(model(**inputs).logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", LOADED_CASES, ids=LOADED)
def test_a_model_loaded_with_a_device_map_converts(case, folders):
    model = _load(case, folders / case.name, device_map="cpu")
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}  # nothing left on "meta"
    hf_alibi.patch_model(model, encoder_variant=case.variants[0])
    inputs = case.inputs(2, 4 * MAX_LEN)
    with torch.no_grad():
        out = model(**inputs).logits
        reference = case.reference(model, inputs, case.variants[0])
    torch.testing.assert_close(out, reference.float(), rtol=0, atol=1e-5)
