"""``table_max_wavelength``: an encoder's learned position table keeps its short-wavelength Fourier components,
continued past the table, against references written here: each component's two coefficients summed by hand in
float64 (``cos`` and ``sin`` projections over the rows) and evaluated at the true position (not modulo the rows),
and the converted BERT run by hand (tests/reference.py) with those vectors added to its inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from reference import bert_reference_logits
from sharing import check_cli_convert
from tiny import VOCAB, random_ids, tiny_gpt2

import hf_alibi
from hf_alibi.convert.patch import PRESETS

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
ROWS = 40  # the tiny tables' length; inputs below run past it


def bert(cls=transformers.BertForMaskedLM, config_cls=transformers.BertConfig, **extra):
    torch.manual_seed(0)
    return cls(config_cls(**SMALL, max_position_embeddings=extra.pop("rows", ROWS), **extra)).eval()


def periodic_reference(table: torch.Tensor, max_wavelength: float, positions) -> torch.Tensor:
    """Sum over k >= 1 with rows / k <= max_wavelength of ``a_k cos(2 pi k p / N) + b_k sin(2 pi k p / N)``,
    ``a_k, b_k`` projected from the N rows one by one (float64), at each position ``p`` as given."""
    rows, width = table.shape
    x = table.double()
    out = torch.zeros(len(positions), width, dtype=torch.float64)
    for k in range(1, rows // 2 + 1):
        if rows / k > max_wavelength:
            continue
        weight = 1.0 / rows if 2 * k == rows else 2.0 / rows
        a = torch.zeros(width, dtype=torch.float64)
        b = torch.zeros(width, dtype=torch.float64)
        for n in range(rows):
            a += weight * math.cos(2 * math.pi * k * n / rows) * x[n]
            b += weight * math.sin(2 * math.pi * k * n / rows) * x[n]
        for i, p in enumerate(positions):
            out[i] += a * math.cos(2 * math.pi * k * p / rows) + b * math.sin(2 * math.pi * k * p / rows)
    return out.float()


def test_bert_keeps_the_short_wavelengths_continued_past_the_table():
    model = bert()
    table = model.bert.embeddings.position_embeddings.weight.detach().clone()
    hf_alibi.patch_model(model, table_max_wavelength=10)  # components k >= 4 of 40 rows
    ids = random_ids(2, 100)  # 2.5x the table
    positions = periodic_reference(table, 10, range(100))[None]
    with torch.no_grad():
        logits = model(ids).logits
        expected = bert_reference_logits(model, ids, "symmetric", positions=positions)
    torch.testing.assert_close(logits, expected, rtol=0, atol=2e-5)
    # without the positions it is another model: the kept part matters
    with torch.no_grad():
        assert (bert_reference_logits(model, ids, "symmetric") - logits).abs().max() > 1e-2
    settings = hf_alibi.get_settings(model.config)
    assert (settings.table_max_wavelength, settings.table_rows) == (10, ROWS)


def test_every_wavelength_kept_is_the_table_less_its_mean_inside_it():
    model = bert(transformers.BertModel)
    table = model.embeddings.position_embeddings.weight.detach().clone()
    hf_alibi.patch_model(model, table_max_wavelength=ROWS)
    kept = model.embeddings.position_embeddings(torch.arange(ROWS)[None])[0]
    mean = table.double().sum(0) / ROWS
    torch.testing.assert_close(kept, (table.double() - mean).float(), rtol=0, atol=1e-5)


def test_roberta_counts_from_its_first_position_and_padding_gets_nothing():
    model = bert(transformers.RobertaForMaskedLM, transformers.RobertaConfig, pad_token_id=1, rows=ROWS + 2)
    table = model.roberta.embeddings.position_embeddings.weight.detach().clone()
    hf_alibi.patch_model(model, table_max_wavelength=8)
    assert model.config.alibi["table_rows"] == ROWS  # rows 2 .. 41: padding_idx + 1 on
    ids = random_ids(2, 60, seed=3).clamp(min=2)
    mask = torch.ones_like(ids)
    ids[1, 45:], mask[1, 45:] = 1, 0  # right padding
    embeddings = model.roberta.embeddings
    with torch.no_grad():
        got = embeddings.position_embeddings(embeddings.create_position_ids_from_input_ids(ids, 1))
    expected = periodic_reference(table[2:], 8, range(60))
    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, :45], expected[:45], rtol=0, atol=1e-5)
    assert torch.equal(got[1, 45:], torch.zeros_like(got[1, 45:]))


def test_saved_checkpoint_and_the_cli_rebuild_the_same_model(tmp_path, capsys):
    model = hf_alibi.patch_model(bert(), table_max_wavelength=10)
    model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())["alibi"]
    assert (saved["table_max_wavelength"], saved["table_rows"]) == (10, ROWS)
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "m").eval()
    ids = random_ids(2, 90)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)

    bert().save_pretrained(tmp_path / "src")
    line = "position table's wavelengths <= 10 kept (40 rows, repeated)"
    check_cli_convert(tmp_path / "src", tmp_path / "out", ("--table-max-wavelength", "10"), line, model, ids, capsys)


def test_the_preset_keeps_every_wavelength_of_the_table_on_encoders_only():
    bound = PRESETS["pretrained"]["table_max_wavelength"]
    model = hf_alibi.patch_model(bert(), preset="pretrained")
    assert model.config.alibi["table_max_wavelength"] == bound.times * ROWS
    assert type(model.bert.embeddings.position_embeddings).__name__ == "RetainedTable"
    gpt2 = hf_alibi.patch_model(tiny_gpt2(), preset="pretrained")
    assert gpt2.config.alibi["table_max_wavelength"] is None
    explicit = hf_alibi.patch_model(bert(), preset="pretrained", table_max_wavelength=8)
    assert explicit.config.alibi["table_max_wavelength"] == 8
    removed = hf_alibi.patch_model(bert(), preset="pretrained", table_max_wavelength=0)  # 0: the table goes
    assert removed.config.alibi["table_max_wavelength"] is None
    assert type(removed.bert.embeddings.position_embeddings).__name__ == "NoPositionEmbedding"


@pytest.mark.parametrize(
    ("make", "value", "message"),
    [
        (tiny_gpt2, 8, "table_max_wavelength applies to encoders with a learned position table .* gpt2 is a decoder"),
        (bert, 1, "table_max_wavelength must be a number >= 2 .*, or 0 / None to remove the table"),
        (bert, -4, "table_max_wavelength must be a number >= 2"),
        (bert, "8", "table_max_wavelength must be a number >= 2"),
        (bert, True, "table_max_wavelength must be a number >= 2"),
    ],
)
def test_bad_values_are_refused_and_the_model_is_untouched(make, value, message):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        hf_alibi.patch_model(model, table_max_wavelength=value)
    assert not hf_alibi.is_alibi(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rotary_models_refuse_it():
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=16)
    with pytest.raises(ValueError, match="table_max_wavelength applies to encoders .* 'rotary' row"):
        hf_alibi.patch_model(transformers.LlamaForCausalLM(config), table_max_wavelength=8)
