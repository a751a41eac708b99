"""The rotary knee (``rotary_knee``, ``rotary_stretch``): past the knee, the kept rotary frequencies of wavelength
longer than it turn ``stretch`` times slower; ``rotary_interpolation``: they turn that many times slower at every
position (alone, or with the knee's stretch: the knee's positions interpolated); each mode of ``MODES``. Checked
against a reference written here (the original architecture with a rotary module that computes every angle in
float64 from theta and the knee's formula, and the float64 sink attention of tests/reference.py) on every path a
converted model takes on this CPU: eager, the sdpa fold and bias, flex, left padding, generation through the KV cache,
packed rows, torch.compile(fullgraph=True), saved and reloaded.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from reference import fairseq_slopes, first_real_tokens, retained_rotary_reference_logits, sink_bias
from tiny import VOCAB, random_ids

import hf_alibi

THETA, NATIVE = 10000.0, 16
KNEE, STRETCH, WAVELENGTH = 16.0, 4.0, 1000.0  # frequencies 1, 0.1, 0.01, 0.001: kept 1 (plain), 0.1 and 0.01 (slowed)
LENGTH = 40  # two and a half times the knee
ROTARY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=NATIVE, bos_token_id=0, eos_token_id=0,
    pad_token_id=0, attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": THETA},
)  # fmt: skip
OPTIONS = dict(sinks=1, slope_scale=0.25, rotary_max_wavelength=WAVELENGTH, rotary_knee=KNEE, rotary_stretch=STRETCH)
# the long wavelengths slowed past the knee, interpolated at every position, or both
MODES = {
    "knee": dict(rotary_stretch=STRETCH, rotary_interpolation=1.0),
    "interpolation": dict(rotary_stretch=1.0, rotary_interpolation=2.0),
    "both": dict(rotary_stretch=STRETCH, rotary_interpolation=1.5),
}


def make(attn: str = "sdpa") -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**ROTARY, attn_implementation=attn)).eval()


def reference_logits(model, ids, mask=None, mode: str = "knee") -> torch.Tensor:
    """The converted ``model``'s weights in the original architecture, with the float64 knee rotary
    (tests/reference.py's KneeRotaryReference) and the sink bias; positions counted as the original counts them
    (from the row's first slot, padding included)."""
    slopes = [0.25 * s for s in fairseq_slopes(4)]
    bias = sink_bias("causal", slopes, ids.shape[1], 1, first_real_tokens(mask, ids.shape[0]))
    make_original = lambda **kw: make(kw["attn_implementation"])  # noqa: E731
    with torch.no_grad():
        return retained_rotary_reference_logits(
            make_original,
            model,
            ids,
            mask,
            bias,
            WAVELENGTH,
            THETA,
            KNEE,
            MODES[mode]["rotary_stretch"],
            MODES[mode]["rotary_interpolation"],
        )


def converted(mode: str = "knee"):
    return hf_alibi.patch_model(make(), **{**OPTIONS, **MODES[mode]})


def left_padded():
    ids = random_ids(2, LENGTH, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    return ids, mask


@pytest.mark.parametrize("mode", MODES)
def test_every_attention_path_equals_the_reference_past_the_knee(mode):
    ids, mask = left_padded()
    model = converted(mode)
    expected = reference_logits(model, ids, mask, mode)
    real = mask.bool()
    for backend, path in [("eager", "auto"), ("sdpa", "folded"), ("sdpa", "bias"), ("flex_attention", "auto")]:
        model.set_attn_implementation(backend)
        hf_alibi.set_attention_path(model, path)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert (logits[real] - expected[real]).abs().max() < 2e-5, (backend, path)
    # the knee changed the numbers past it, and nothing before it; interpolation changes them everywhere but at 0
    plain = hf_alibi.patch_model(make(), **{**OPTIONS, "rotary_stretch": 1.0})
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        unslowed, slowed = (m(input_ids=ids[:1]).logits for m in (plain, model))
    if mode == "knee":
        assert torch.equal(slowed[:, :NATIVE], unslowed[:, :NATIVE])
    else:
        assert (slowed[:, 2:NATIVE] - unslowed[:, 2:NATIVE]).abs().max() > 1e-4
    assert (slowed[:, NATIVE + 2 :] - unslowed[:, NATIVE + 2 :]).abs().max() > 1e-4  # float noise: 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_generation_through_the_cache_reads_its_positions(mode):
    """Chunks fed through the KV cache (positions counted from the cache) give one forward's logits, and greedy
    decoding past the knee the reference's tokens."""
    model = converted(mode)
    ids = random_ids(1, LENGTH, seed=4)
    expected = reference_logits(model, ids, mode=mode)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        parts = [model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).logits
                 for a, b in [(0, 10), (10, 17), (17, 18), (18, LENGTH)]]  # fmt: skip
    assert (torch.cat(parts, 1) - expected).abs().max() < 2e-5
    generated = model.generate(ids[:, :12], max_new_tokens=LENGTH - 12, do_sample=False, min_new_tokens=LENGTH - 12)
    for step in range(12, LENGTH):
        step_logits = reference_logits(model, generated[:, :step], mode=mode)[0, -1]
        assert generated[0, step] == step_logits.argmax()


@pytest.mark.parametrize("mode", MODES)
def test_packed_rows_restart_the_knee_in_each_document(mode):
    model = converted(mode)
    first, second = random_ids(1, 28, seed=5), random_ids(1, 22, seed=6)
    positions = torch.cat([torch.arange(28), torch.arange(22)])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions).logits
    assert (packed[:, :28] - reference_logits(model, first, mode=mode)).abs().max() < 2e-5
    assert (packed[:, 28:] - reference_logits(model, second, mode=mode)).abs().max() < 2e-5


@pytest.mark.parametrize("mode", MODES)
def test_compiled_in_one_graph_equals_eager(mode):
    model = converted(mode)
    ids = random_ids(1, LENGTH, seed=7)
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        compiled = torch.compile(model, fullgraph=True)(input_ids=ids).logits
    assert (compiled - eager).abs().max() < 2e-5


@pytest.mark.parametrize("mode", MODES)
def test_saved_reloaded_and_said(tmp_path, mode):
    model = converted(mode)
    ids = random_ids(1, LENGTH, seed=8)
    model.save_pretrained(tmp_path / "knee")
    saved = hf_alibi.AlibiSettings.from_dict(transformers.AutoConfig.from_pretrained(tmp_path / "knee").alibi)
    assert (saved.rotary_knee, saved.rotary_stretch, saved.rotary_interpolation) == (
        KNEE,
        MODES[mode]["rotary_stretch"],
        MODES[mode]["rotary_interpolation"],
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "knee").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    from hf_alibi.core.settings import describe_options

    said = describe_options(saved)
    assert ("turn 4x slower past position 16" in said) == (mode != "interpolation")
    assert (f"interpolated {MODES[mode]['rotary_interpolation']:g}x at every position" in said) == (mode != "knee")


def test_the_preset_puts_the_knee_at_the_original_length():
    settings = hf_alibi.AlibiSettings.from_dict(hf_alibi.patch_model(make(), preset="pretrained").config.alibi)
    assert settings.rotary_knee == NATIVE and settings.rotary_stretch > 1


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rotary_stretch=0.5, rotary_knee=16.0, rotary_max_wavelength=100.0), "rotary_stretch must be a finite"),
        (dict(rotary_stretch=2.0, rotary_max_wavelength=100.0), "give rotary_knee"),
        (dict(rotary_stretch=2.0, rotary_knee=16.0), "keep the rotary frequencies"),
        (dict(rotary_knee=0.0, rotary_max_wavelength=100.0), "rotary_knee must be a number >= 1"),
        (dict(rotary_interpolation=0.5, rotary_knee=16.0, rotary_max_wavelength=100.0), "rotary_interpolation must"),
        (dict(rotary_interpolation=2.0, rotary_max_wavelength=100.0), "give rotary_knee"),
        (dict(rotary_interpolation=2.0, rotary_knee=16.0), "keep the rotary frequencies"),
    ],
)
def test_bad_values_are_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        hf_alibi.patch_model(make(), **options)
