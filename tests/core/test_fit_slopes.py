"""Per-layer slopes (one list per self-attention layer) and ``hf_alibi.fit_slopes``, against references written
here: loop-built float64 biases per layer (tests/reference.py) and mean attention distances summed by loops over
transformers' own eager attention maps."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from reference import first_real_tokens, gpt2_reference_logits, sink_bias
from sharing import assert_every_path_matches
from tiny import VOCAB, random_ids, tiny_gpt2

import hf_alibi

LENGTH = 20  # past the tiny GPT-2's 16 positions
PER_LAYER = [[0.3, 0.05, 0.7, 0.01], [0.02, 0.9, 0.1, 0.4]]  # tiny_gpt2: 2 layers x 4 heads


def left_padded():
    ids = random_ids(2, LENGTH, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def test_per_layer_slopes_match_the_reference_on_every_path():
    ids, mask = left_padded()
    model = hf_alibi.patch_model(tiny_gpt2(), slopes=PER_LAYER, sinks=1)
    starts = first_real_tokens(mask, 2)
    bias = [sink_bias("causal", layer, LENGTH, 1, starts) for layer in PER_LAYER]
    expected = gpt2_reference_logits(model, ids, bias=bias, key_padding=mask.bool())
    assert_every_path_matches(model, ids, mask, expected)
    # each layer has its own: the first layer's list everywhere is another model
    same = gpt2_reference_logits(model, ids, bias=bias[0], key_padding=mask.bool())
    real = mask.bool()
    assert (same[real] - expected[real]).abs().max() > 1e-3


def test_per_layer_slopes_are_saved_and_rebuilt(tmp_path):
    ids, _ = left_padded()
    model = hf_alibi.patch_model(tiny_gpt2(), slopes=PER_LAYER, sinks=1)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["alibi"]["slopes"] == PER_LAYER
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize(
    ("slopes", "message"),
    [
        ([[0.1] * 4], "slopes lists 1 layers, but this gpt2 model has 2 self-attention layers"),
        ([[0.1] * 4, [0.1] * 3], r"one slope per head \(layer 1\): 4 numbers, got 3"),
        ([[0.1] * 4, [0.1, 0.1, -0.1, 0.1]], r"finite numbers > 0 \(the bias is -slope \* distance\) \(layer 1\)"),
    ],
)
def test_bad_per_layer_slopes_are_refused_and_change_nothing(slopes, message):
    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        hf_alibi.patch_model(model, slopes=slopes, preset="pretrained")
    assert model.config.model_type == "gpt2" and type(model) is transformers.GPT2LMHeadModel
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------------ fit_slopes


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def tiny_bert_model():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.BertModel(config).eval()


def loop_slopes(maps, scale: float, sinks: int, skip: int) -> list[list[float]]:
    """scale / mean over queries i >= skip of sum_j p_ij |i - j| / sum_j p_ij over keys j >= sinks, by loops."""
    out = []
    for layer in maps:  # (B, H, T, T)
        batch, heads, length, _ = layer.shape
        row = []
        for h in range(heads):
            total, count = 0.0, 0
            for b in range(batch):
                for i in range(skip, length):
                    weights = [layer[b, h, i, j].item() for j in range(sinks, length)]
                    total += sum(w * abs(i - j) for w, j in zip(weights, range(sinks, length))) / sum(weights)
                    count += 1
            row.append(scale / max(total / count, 1.0))
        out.append(row)
    return out


@pytest.mark.parametrize(("make", "skip"), [(tiny_llama, 48 // 16), (tiny_bert_model, 0)])
def test_fit_slopes_is_scale_over_each_heads_mean_distance(make, skip):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = random_ids(2, 48, seed=3)
    fitted = hf_alibi.fit_slopes(model, ids, scale=0.3, sinks=1)
    assert model.config._attn_implementation == "sdpa", "the attention implementation is given back"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    reference = make()
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        maps = reference(input_ids=ids, output_attentions=True).attentions
    expected = loop_slopes(maps, 0.3, 1, skip)
    assert len(fitted) == 2 and all(len(layer) == 4 for layer in fitted)
    torch.testing.assert_close(torch.tensor(fitted), torch.tensor(expected), rtol=1e-4, atol=0)
    # and they convert: patch_model takes them as they come
    converted = hf_alibi.patch_model(make(), preset="pretrained", slopes=fitted)
    assert hf_alibi.get_settings(converted.config).slopes == fitted


def test_fit_slopes_refuses_what_it_cannot_fit():
    converted = hf_alibi.patch_model(tiny_llama())
    with pytest.raises(ValueError, match="ORIGINAL model's attention: pass the model before patch_model"):
        hf_alibi.fit_slopes(converted, random_ids(1, 16))
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    )
    with pytest.raises(ValueError, match="decoder-only and encoder models, not 't5': use slope_scale"):
        hf_alibi.fit_slopes(t5, random_ids(1, 16))
    with pytest.raises(ValueError, match="T > sinks \\+ 1 tokens"):
        hf_alibi.fit_slopes(tiny_llama(), random_ids(1, 2))
    with pytest.raises(ValueError, match="scale must be > 0"):
        hf_alibi.fit_slopes(tiny_llama(), random_ids(1, 16), scale=0)


# ------------------------------------------------------------------------------------------------ hf-alibi convert


@pytest.fixture
def llama_folder(tmp_path):
    from sharing import make_tokenizer

    src = tmp_path / "llama"
    tiny_llama().save_pretrained(src)
    make_tokenizer(src)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 90 + 1}" for i in range(300)))
    return src, text


@pytest.mark.parametrize("spelling", ["switch", "old"])
def test_cli_convert_fits_the_slopes_on_the_text(llama_folder, tmp_path, capsys, spelling):
    # --fit-slopes is a switch as in `recover`, the text --fit-text; the old --fit-slopes TEXT_FILE still runs, noted
    from sharing import run_cli
    from transformers import AutoTokenizer

    src, text = llama_folder
    out = tmp_path / "out"
    fit = ["--fit-slopes", "--fit-text", text] if spelling == "switch" else ["--fit-slopes", text]
    code, _, err = run_cli("convert", src, out, "--preset", "pretrained", *fit, "--fit-tokens", 40, capsys=capsys)
    assert code == 0, err
    assert ("--fit-slopes TEXT_FILE is now --fit-slopes --fit-text TEXT_FILE" in err) == (spelling == "old")
    ids = AutoTokenizer.from_pretrained(src)(text.read_text(), return_tensors="pt")["input_ids"][:, :40]
    expected = hf_alibi.fit_slopes(transformers.AutoModelForCausalLM.from_pretrained(src), ids, sinks=1)
    saved = json.loads((out / "config.json").read_text())["alibi"]
    assert saved["slopes"] == expected and saved["slope_scale"] == 1.0 and saved["sinks"] == 1
    assert saved["slopes_source"] == "fit_slopes"  # recorded as fitted, not as slopes given by hand
    code, stdout, _ = run_cli("info", out, capsys=capsys)
    assert code == 0 and "slopes: per layer (2 layers x 4 heads), from " in stdout
    assert "slopes: fitted per layer and head on text (fit_slopes)" in stdout and "explicit" not in stdout


def test_slopes_given_by_hand_are_not_called_fitted(tmp_path):
    model = hf_alibi.patch_model(tiny_llama(), slopes=[[0.5, 0.25, 0.125, 0.0625]] * 2)
    assert hf_alibi.get_settings(model.config).slopes_source is None
    fitted = hf_alibi.fit_slopes(tiny_llama(), random_ids(1, 16))
    model = hf_alibi.patch_model(tiny_llama(), slopes=fitted)
    assert hf_alibi.get_settings(model.config).slopes_source == "fit_slopes"
    model.save_pretrained(tmp_path)  # kept through a reload
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf_alibi.get_settings(reloaded.config).slopes_source == "fit_slopes"
    assert hf_alibi.get_settings(reloaded.config).slopes == hf_alibi.get_settings(model.config).slopes


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fit-scale", "0.2"], "--fit-scale applies to --fit-slopes only"),
        (["--fit-slopes", "--fit-text", "TEXT", "--slope-scale", "0.1"], "--fit-slopes computes the slopes: drop"),
        (["--fit-slopes", "--fit-text", "TEXT", "--fit-scale", "-1"], "--fit-scale must be > 0"),
        (["--fit-slopes", "--fit-text", "MISSING"], "is not a file: pass the path of a text file"),
        (["--fit-slopes"], "convert has no training text: add --fit-text TEXT_FILE"),
        (["--fit-slopes", "TEXT", "--fit-text", "TEXT"], "both name a text: keep --fit-text"),
    ],
)
def test_cli_fit_slopes_bad_flags_write_nothing(llama_folder, tmp_path, capsys, extra, message):
    from sharing import run_cli

    src, text = llama_folder
    extra = [str(text) if a == "TEXT" else str(tmp_path / "missing.txt") if a == "MISSING" else a for a in extra]
    code, _, err = run_cli("convert", src, tmp_path / "out", *extra, capsys=capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
