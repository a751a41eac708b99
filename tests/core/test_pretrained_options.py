"""The options for pretrained checkpoints (sinks, retained rotary frequencies, scaled or explicit slopes)
against hand-written references (tests/reference.py: loop-built float64 biases, inverse frequencies from
theta), on every path, with caches and padding, saved and reloaded, and their errors. Their one declaration
and the presets: test_declared_options.py."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from reference import (
    bert_reference_logits,
    fairseq_slopes,
    first_real_tokens,
    gpt2_reference_logits,
    retained_rotary_reference_logits,
    sink_bias,
)
from tiny import VOCAB, random_ids, tiny_gpt2

import hf_alibi
from hf_alibi.convert.patch import PRESETS
from hf_alibi.core.flash import flash_alibi_attention

LENGTH = 24  # past the tiny configs' 16 positions
THETA = 10000.0
ROTARY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": THETA},
)  # fmt: skip
BERT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=16, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
# (name, builder): llama (full rotary, grouped KV heads), phi3 (half of each head rotated), gpt2 (no rotary)
DECODERS = {
    "llama": lambda attn="sdpa": transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**ROTARY, attn_implementation=attn)
    ),
    "phi3": lambda attn="sdpa": transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**ROTARY, partial_rotary_factor=0.5, attn_implementation=attn)
    ),
    "gpt2": lambda attn="sdpa": tiny_gpt2(attn_implementation=attn),
}
# sdpa: the fold (forced) and the bias tensor (forced), eager, flex (forward, CPU)
PATHS = [("eager", "auto"), ("sdpa", "folded"), ("sdpa", "bias"), ("flex_attention", "auto")]
OPTIONS = dict(sinks=2, slope_scale=0.5)
WAVELENGTH = 100.0  # llama's 4 frequencies (1, 0.1, 0.01, 0.001): 2 kept; phi3's 2 (1, 0.01): 1 kept


def make(name: str, attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    return DECODERS[name](attn).eval()


def options_for(name: str) -> dict:
    return {**OPTIONS, "rotary_max_wavelength": WAVELENGTH} if name != "gpt2" else dict(OPTIONS)


def left_padded(batch: int = 2, length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(batch, length, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def reference(name: str, model, ids, mask, slopes: list[float], sinks: int) -> torch.Tensor:
    bias = sink_bias("causal", slopes, ids.shape[1], sinks, first_real_tokens(mask, ids.shape[0]))
    if name == "gpt2":
        return gpt2_reference_logits(model, ids, bias=bias, key_padding=mask.bool())
    return retained_rotary_reference_logits(
        lambda **kw: make(name, kw["attn_implementation"]), model, ids, mask, bias, WAVELENGTH, THETA
    )


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoders_match_the_reference_on_every_path(name):
    ids, mask = left_padded()
    model = hf_alibi.patch_model(make(name), **options_for(name))
    slopes = [0.5 * s for s in fairseq_slopes(4)]
    expected = reference(name, model, ids, mask, slopes, sinks=2)
    real = mask.bool()
    for backend, path in PATHS:
        if backend == "flex_attention" and not model._supports_flex_attn:  # GPT-2: transformers allows no flex
            continue
        model.set_attn_implementation(backend)
        hf_alibi.set_attention_path(model, path)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        taken = {m.last_path for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)}
        assert taken == {"flex" if backend == "flex_attention" else "bias" if path == "auto" else path}
        assert (logits[real] - expected[real]).abs().max() < 2e-5, (backend, path)
    # the options changed the numbers: the paper's conversion of the same weights is far from this reference
    plain = hf_alibi.patch_model(make(name))
    with torch.no_grad():
        assert (plain(input_ids=ids, attention_mask=mask).logits[real] - expected[real]).abs().max() > 1e-2


def test_explicit_slopes_and_the_fold_without_a_mask():
    slopes = [0.3, 0.05, 0.7, 0.01]
    model = hf_alibi.patch_model(make("llama"), slopes=slopes, sinks=3, rotary_max_wavelength=WAVELENGTH)
    ids = random_ids(1, LENGTH, seed=6)
    expected = reference("llama", model, ids, None, slopes, sinks=3)
    for path in ("folded", "bias"):  # no mask: the fold runs SDPA's causal kernel (is_causal)
        hf_alibi.set_attention_path(model, path)
        with torch.no_grad():
            assert (model(input_ids=ids).logits - expected).abs().max() < 2e-5, path


@pytest.mark.parametrize("variant", ["symmetric", "nonsymmetric"])
def test_bert_first_key_exempt(variant):
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**BERT, attn_implementation="sdpa")).eval()
    model = hf_alibi.patch_model(model, encoder_variant=variant, sinks=1, slope_scale=2.0)
    ids = random_ids(2, LENGTH, seed=7)
    for padding in ("right", "left"):
        mask = torch.ones_like(ids)
        mask[1, -6:] = 0 if padding == "right" else 1
        mask[1, :6] = 0 if padding == "left" else 1
        starts = first_real_tokens(mask, 2)
        bias = sink_bias(variant, [2 * s for s in fairseq_slopes(4)], LENGTH, 1, starts)
        expected = bert_reference_logits(model, ids, variant, mask, bias=bias)
        real = mask.bool()
        for backend in ("eager", "sdpa", "flex_attention"):
            model.set_attn_implementation(backend)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
            assert (logits[real] - expected[real]).abs().max() < 2e-5, (padding, backend)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_left_padded_batch_equals_each_prompt_alone(name):
    model = hf_alibi.patch_model(make(name), **options_for(name))
    ids, mask = left_padded()
    for backend in ("sdpa", "eager"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            batch = model(input_ids=ids, attention_mask=mask).logits
            alone = model(input_ids=ids[1:, 5:]).logits
        assert (batch[1, 5:] - alone[0]).abs().max() < 2e-5, backend


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_equals_recomputation(cache):
    model = hf_alibi.patch_model(make("llama"), **options_for("llama"))
    ids, mask = left_padded(length=12)
    options = dict(max_new_tokens=14, do_sample=False, output_logits=True, return_dict_in_generate=True)
    if cache == "static":
        options["cache_implementation"] = "static"
    for backend in ("sdpa", "eager"):  # sdpa: prefill folded, decoding steps on the bias path
        model.set_attn_implementation(backend)
        cached = model.generate(input_ids=ids, attention_mask=mask, **options)
        recomputed = model.generate(input_ids=ids, attention_mask=mask, use_cache=False, **options)
        assert torch.equal(cached.sequences, recomputed.sequences), backend
        difference = max((a - b).abs().max().item() for a, b in zip(cached.logits, recomputed.logits))
        assert difference < 2e-5, (backend, difference)


def test_chunked_prefill_equals_one_forward():
    model = hf_alibi.patch_model(make("llama"), **options_for("llama"))
    ids, mask = left_padded(length=LENGTH)
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits
        cache = transformers.DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
        second = model(input_ids=ids[:, 9:], attention_mask=mask, past_key_values=cache, use_cache=True)
    assert (first.logits[mask[:, :9].bool()] - whole[:, :9][mask[:, :9].bool()]).abs().max() < 2e-5
    assert (second.logits - whole[:, 9:]).abs().max() < 2e-5


def test_rotary_keeps_exactly_the_short_wavelengths():
    model = hf_alibi.patch_model(make("llama"), rotary_max_wavelength=WAVELENGTH)
    with torch.no_grad():
        model(input_ids=random_ids(1, 4))
    # head_dim 8: frequencies theta^(-k/4), k = 0..3, in Llama's halves layout (each twice)
    wavelengths = [2 * 3.141592653589793 * THETA ** (k / 4) for k in range(4)] * 2
    assert model.model.rotary_emb.kept.tolist() == [w <= WAVELENGTH for w in wavelengths]


def test_a_dynamic_rope_keeps_its_trained_frequencies_past_the_length_and_reloads(tmp_path):
    """Dynamic NTK rope (rescaled past max_position_embeddings, which a converted config no longer has): with
    retained rotary it runs at its trained frequencies, i.e. as the same weights with the default rope type."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**ROTARY, "rope_parameters": dynamic})).eval()
    reference = make("llama")  # rope_type default
    reference.load_state_dict(model.state_dict())
    hf_alibi.patch_model(model, preset="pretrained")
    hf_alibi.patch_model(reference, preset="pretrained")
    ids = random_ids(1, 3 * 16)  # 3 x the 16 positions: the dynamic update would rescale here
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=0, atol=1e-6)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=0, atol=1e-6)


def test_settings_are_saved_and_reload(tmp_path):
    model = hf_alibi.patch_model(make("llama"), preset="pretrained", slope_scale=0.25)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["alibi"]
    # the preset's values, the explicit slope_scale over the preset's, the bound = 1024 x the original 16 positions
    assert saved["sinks"] == PRESETS["pretrained"]["sinks"] == 1
    assert saved["rotary_max_wavelength"] == 16384.0 and saved["slope_scale"] == 0.25 and saved["slopes"] is None
    ids, mask = left_padded()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    assert type(loaded.model.rotary_emb).__name__ == "RetainedRotary"


def test_the_preset_on_a_model_without_rotary_sets_no_bound():
    model = hf_alibi.patch_model(tiny_gpt2(), preset="pretrained")
    assert model.config.alibi["rotary_max_wavelength"] is None and model.config.alibi["sinks"] == 1


def test_old_settings_without_the_new_keys_are_the_paper():
    settings = hf_alibi.AlibiSettings.from_dict({"base_model_type": "gpt2", "heads": 4})
    assert (settings.sinks, settings.rotary_max_wavelength, settings.slope_scale, settings.slopes) == (
        0,
        None,
        1.0,
        None,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(sinks=-1), "sinks must be an integer >= 0"),
        (dict(sinks=1.5), "sinks must be an integer >= 0"),
        (dict(slope_scale=0.0), "slope_scale must be a finite number > 0"),
        (dict(slopes=[0.5, 0.25]), "one slope per head: 4 numbers, got 2"),
        (dict(slopes=[0.5, 0.25, 0.1, -1.0]), "slopes must be finite numbers > 0"),
        (dict(slopes=[0.5] * 4, slope_scale=0.5), "either slopes or slope_scale"),
        (dict(rotary_max_wavelength=-3.0), "rotary_max_wavelength must be a number > 0"),
        (dict(preset="nope"), "Unknown preset 'nope'"),
    ],
)
def test_bad_options_are_refused_up_front(kwargs, message):
    model = make("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        hf_alibi.patch_model(model, **kwargs)
    assert type(model).__name__ == "LlamaForCausalLM"  # untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rotary_bound_on_a_model_without_rotary_and_sinks_on_t5_are_refused():
    with pytest.raises(ValueError, match="rotary_max_wavelength applies to rotary models only; gpt2"):
        hf_alibi.patch_model(tiny_gpt2(), rotary_max_wavelength=100.0)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    )
    with pytest.raises(ValueError, match="sinks=2 is not supported for encoder-decoder models"):
        hf_alibi.patch_model(t5, sinks=2)
    # the preset (recover's default) leaves the sinks out there, and keeps its slopes
    settings = hf_alibi.get_settings(hf_alibi.patch_model(t5, preset="pretrained").config)
    assert (settings.sinks, settings.slope_scale, settings.position_mean) == (0, 0.01, 0)
    with pytest.raises(ValueError, match="rotary_max_wavelength applies to rotary models only"):
        hf_alibi.AlibiSettings("gpt2", 4, architecture={"model_type": "gpt2", "strategy": "absolute"},
                               rotary_max_wavelength=10.0)  # fmt: skip


def test_flash_attention_refuses_sinks_with_a_clear_error():
    model = hf_alibi.patch_model(make("llama"), sinks=1)
    attention = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(NotImplementedError, match="flash-attn's ALiBi cannot exempt the first 1 keys"):
        flash_alibi_attention(attention, q, q[:, :2], q[:, :2], None)


LOAD_WITHOUT_HF_ALIBI = """
import json, sys, torch, transformers
expected = torch.load("expected.pt")
model = transformers.AutoModelForCausalLM.from_pretrained(".", trust_remote_code=True).eval()
report = {"hf_alibi": "hf_alibi" in sys.modules, "rotary": type(model.model.rotary_emb).__name__}
report["slopes"] = model.config.alibi["slopes"]
for backend in ("sdpa", "eager"):
    model.set_attn_implementation(backend)
    with torch.no_grad():
        logits = model(input_ids=expected["ids"], attention_mask=expected["mask"]).logits
    report[backend] = (logits - expected["logits"]).abs().max().item()
inputs = {"input_ids": expected["ids"], "attention_mask": expected["mask"]}
generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)
report["generated"] = torch.equal(generated, expected["generated"])
bert = transformers.AutoModel.from_pretrained("bert", trust_remote_code=True).eval()  # position_mean folded
report["bert_position_mean"] = bert.config.alibi["position_mean"]
report["bert_table"] = type(bert.embeddings.position_embeddings).__name__
with torch.no_grad():
    hidden = bert(input_ids=expected["bert_ids"]).last_hidden_state
report["bert"] = (hidden - expected["bert_hidden"]).abs().max().item()
print(json.dumps(report))
"""


def test_remote_code_without_hf_alibi_applies_the_options(tmp_path):
    from sharing import last_json_line, run_child

    # the Llama with slopes fitted per layer and head (the BERT below keeps the preset's uniform scale)
    fitted = hf_alibi.fit_slopes(make("llama"), random_ids(1, 16))
    model = hf_alibi.patch_model(make("llama"), preset="pretrained", slopes=fitted)
    ids, mask = left_padded()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    # the options matter on this input: the paper's conversion of the same weights gives other logits
    with torch.no_grad():
        plain = hf_alibi.patch_model(make("llama"))(input_ids=ids, attention_mask=mask).logits
    assert (plain - logits).abs().max() > 1e-2
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(**BERT)).eval()
    # the table's mean and short wavelengths kept
    hf_alibi.patch_model(bert, preset="pretrained").save_pretrained(tmp_path / "bert")
    bert_ids = random_ids(2, LENGTH)
    with torch.no_grad():
        bert_hidden = bert(input_ids=bert_ids).last_hidden_state
    expected = {"ids": ids, "mask": mask, "logits": logits, "generated": generated}
    torch.save({**expected, "bert_ids": bert_ids, "bert_hidden": bert_hidden}, tmp_path / "expected.pt")
    result = run_child(LOAD_WITHOUT_HF_ALIBI, tmp_path, tmp_path / "hf", block_hf_alibi=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json_line(result.stdout)
    assert report["hf_alibi"] is False and report["rotary"] == "RetainedRotary", report
    assert report["sdpa"] <= 1e-5 and report["eager"] <= 1e-5 and report["generated"], report
    assert report["bert_position_mean"] == 128 and report["bert"] <= 1e-5, report
    assert report["bert_table"] == "RetainedTable", report  # the preset keeps the table's short wavelengths
    assert report["slopes"] == fitted and fitted[0] != fitted[1]  # each layer its own


def sliding(model_type: str, **extra):
    torch.manual_seed(0)
    config = transformers.CONFIG_MAPPING[model_type](**ROTARY, sliding_window=8, **extra)
    names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    model = getattr(transformers, names[model_type])(config).eval()
    return hf_alibi.patch_model(model, **options_for("llama"))


@pytest.mark.parametrize(
    ("model_type", "extra", "caches"),
    [
        ("mistral", {}, ("dynamic",)),  # every layer slides: the static cache's 4D mask is refused (below)
        ("gemma3_text", dict(layer_types=["sliding_attention", "full_attention"]), ("dynamic", "static")),
    ],
)
def test_sliding_windows_cached_generation_equals_recomputation(model_type, extra, caches):
    model = sliding(model_type, **extra)
    ids, mask = left_padded(length=12)  # 12 + 14 tokens: the sinks leave the window of 8
    options = dict(max_new_tokens=14, do_sample=False, output_logits=True, return_dict_in_generate=True)
    recomputed = model.generate(input_ids=ids, attention_mask=mask, use_cache=False, **options)
    for cache in caches:
        extra_options = {"cache_implementation": "static"} if cache == "static" else {}
        cached = model.generate(input_ids=ids, attention_mask=mask, **options, **extra_options)
        difference = max((a - b).abs().max().item() for a, b in zip(cached.logits, recomputed.logits))
        assert difference < 2e-5, (cache, difference)


def test_a_4d_mask_on_a_sliding_window_model_with_sinks_is_refused():
    model = sliding("mistral")
    ids, mask = left_padded(length=12)
    with pytest.raises(ValueError, match="sinks=2 with a 4D attention mask on a sliding-window model"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_the_sink_fold_in_every_dtype_against_the_reference(dtype, masked):
    from hf_alibi.core.folded import folded_causal_attention
    from hf_alibi.core.slopes import BiasSpec

    batch, heads, length, dim, sinks = 2, 4, 256, 16, 3
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator) for _ in range(3))
    slopes = [0.5 * s for s in fairseq_slopes(heads)]
    starts = [0, 37] if masked else [0, 0]
    real = torch.tensor([[j >= start for j in range(length)] for start in starts])  # (B, kv)
    mask = (real[:, None, None, :] & torch.ones(length, length, dtype=torch.bool).tril()) if masked else None
    bias = torch.zeros(batch, heads, length, length, dtype=torch.float64)  # by hand, vectorised over (i, j)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for b, start in enumerate(starts):
        for h, m in enumerate(slopes):
            value = (-m * (i - j)).double().masked_fill((j >= start) & (j < start + sinks), 0.0)
            bias[b, h] = value.masked_fill((j > i) | (j < start), float("-inf"))
    weights = torch.nan_to_num(torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) / 4 + bias, -1))
    expected = torch.einsum("bhqk,bhkd->bqhd", weights, v.double())
    out, _ = folded_causal_attention(
        None, q.to(dtype), k.to(dtype), v.to(dtype), mask, torch.tensor(slopes), scaling=0.25,
        bias=BiasSpec("causal", tuple(slopes), sinks=sinks), rows=(torch.tensor(starts) if masked else None, None),
    )  # fmt: skip
    rows = real[:, :, None, None].expand_as(expected)  # padded queries see nothing: not compared
    tolerance = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert (out.double() - expected)[rows].abs().max() < tolerance
