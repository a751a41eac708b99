"""``position_mean``: the mean of a learned position table's first rows kept in the embeddings when the table
goes, against references computed here by hand (float64 sums of the table's rows, the model's own first
positions: OPT's offset 2, RoBERTa's padding_idx + 1)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from sharing import check_cli_convert
from tiny import VOCAB, random_ids, tiny_gpt2

import hf_alibi

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)


def bert(cls=transformers.BertModel, config_cls=transformers.BertConfig, **extra):
    torch.manual_seed(0)
    return cls(config_cls(**SMALL, max_position_embeddings=40, type_vocab_size=2, **extra)).eval()


def opt(**extra):
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=40, word_embed_proj_dim=extra.pop("word_embed_proj_dim", 32), **extra,
    )  # fmt: skip
    return transformers.OPTForCausalLM(config).eval()


def row_mean(table: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """The mean of rows first .. first + rows - 1, summed one by one in float64."""
    total = torch.zeros(table.shape[1], dtype=torch.float64)
    for position in range(first, min(first + rows, table.shape[0])):
        total += table[position].double()
    return (total / (min(first + rows, table.shape[0]) - first)).float()


def test_gpt2_token_embeddings_take_the_mean_and_the_tied_head_follows():
    model = tiny_gpt2(n_positions=40)
    wte, wpe = model.transformer.wte.weight.detach().clone(), model.transformer.wpe.weight.detach().clone()
    hf_alibi.patch_model(model, position_mean=8)
    torch.testing.assert_close(model.transformer.wte.weight, wte + row_mean(wpe, 0, 8), rtol=0, atol=1e-6)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.config.alibi["position_mean"] == 8


def test_a_constant_table_gives_the_original_embeddings_and_the_same_next_token_distribution():
    """A table whose rows are all v: the first hidden state is the original's exactly, and the tied head's
    shift (v in every row) leaves the probabilities as they were without the fold."""
    original = tiny_gpt2(n_positions=40)
    with torch.no_grad():
        original.transformer.wpe.weight[:] = torch.randn(32, generator=torch.Generator().manual_seed(5))
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = original(ids, output_hidden_states=True).hidden_states[0]
    folded = tiny_gpt2(n_positions=40)
    folded.load_state_dict(original.state_dict())
    hf_alibi.patch_model(folded, position_mean=40)
    plain = tiny_gpt2(n_positions=40)
    plain.load_state_dict(original.state_dict())
    hf_alibi.patch_model(plain)
    with torch.no_grad():
        out = folded(ids, output_hidden_states=True)
        torch.testing.assert_close(out.hidden_states[0], expected, rtol=0, atol=1e-6)
        # the same model without the fold but with v added to every input embedding: equal probabilities
        v = original.transformer.wpe.weight[0]
        shifted = plain(inputs_embeds=plain.transformer.wte(ids) + v).logits
    torch.testing.assert_close(out.logits.log_softmax(-1), shifted.log_softmax(-1), rtol=1e-5, atol=1e-5)


def test_bert_token_types_take_the_mean_and_word_embeddings_stay():
    model = bert()
    words = model.embeddings.word_embeddings.weight.detach().clone()
    types = model.embeddings.token_type_embeddings.weight.detach().clone()
    table = model.embeddings.position_embeddings.weight.detach().clone()
    hf_alibi.patch_model(model, position_mean=16)
    torch.testing.assert_close(model.embeddings.word_embeddings.weight, words, rtol=0, atol=0)
    expected = types + row_mean(table, 0, 16)
    torch.testing.assert_close(model.embeddings.token_type_embeddings.weight, expected, rtol=0, atol=1e-6)


def test_roberta_and_opt_average_from_their_first_position():
    roberta = bert(transformers.RobertaModel, transformers.RobertaConfig, pad_token_id=1)
    types = roberta.embeddings.token_type_embeddings.weight.detach().clone()
    table = roberta.embeddings.position_embeddings.weight.detach().clone()
    hf_alibi.patch_model(roberta, position_mean=10)
    expected = types + row_mean(table, 2, 10)  # positions start at padding_idx + 1 = 2
    torch.testing.assert_close(roberta.embeddings.token_type_embeddings.weight, expected, rtol=0, atol=1e-6)

    model = opt()
    tokens = model.model.decoder.embed_tokens.weight.detach().clone()
    table = model.model.decoder.embed_positions.weight.detach().clone()
    hf_alibi.patch_model(model, position_mean=1000)  # more rows than the table has: all of them from 2
    expected = tokens + row_mean(table, 2, 1000)
    torch.testing.assert_close(model.model.decoder.embed_tokens.weight, expected, rtol=0, atol=1e-6)


def test_a_projection_before_the_table_is_refused_and_the_preset_leaves_it_out():
    model = opt(word_embed_proj_dim=16)  # OPT-350m's layout: project_in between the tokens and the table
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"position_mean cannot fold .*Pass position_mean=0"):
        hf_alibi.patch_model(model, position_mean=8)
    assert not hf_alibi.is_alibi(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    hf_alibi.patch_model(model, preset="pretrained")
    assert model.config.alibi["position_mean"] == 0
    torch.testing.assert_close(model.model.decoder.embed_tokens.weight, before["model.decoder.embed_tokens.weight"])


def test_the_preset_folds_128_rows_on_absolute_rows_only():
    assert hf_alibi.convert.patch.PRESETS["pretrained"]["position_mean"] == 128
    model = bert()
    types = model.embeddings.token_type_embeddings.weight.detach().clone()
    table = model.embeddings.position_embeddings.weight.detach().clone()
    hf_alibi.patch_model(model, preset="pretrained")
    expected = types + row_mean(table, 0, 128)  # the table has 40 rows: all of them
    torch.testing.assert_close(model.embeddings.token_type_embeddings.weight, expected, rtol=0, atol=1e-6)
    llama_config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=16)
    llama = hf_alibi.patch_model(transformers.LlamaForCausalLM(llama_config), preset="pretrained")
    assert llama.config.alibi["position_mean"] == 0
    with pytest.raises(ValueError, match="position_mean applies to learned absolute position tables only"):
        hf_alibi.patch_model(transformers.LlamaForCausalLM(llama_config), position_mean=4)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="position_mean must be an integer >= 0"):
        hf_alibi.patch_model(tiny_gpt2(), position_mean=value)


def test_saved_folded_checkpoint_reloads_with_the_same_outputs_and_the_cli_records_it(tmp_path, capsys):
    model = hf_alibi.patch_model(bert(transformers.BertForMaskedLM), position_mean=16)
    model.save_pretrained(tmp_path / "m")
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "m").eval()
    ids = random_ids(2, 60)  # past the 40 positions
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["alibi"]["position_mean"] == 16

    bert(transformers.BertForMaskedLM).save_pretrained(tmp_path / "src")
    line = "position table's mean (first 16 rows) kept in the embeddings"
    check_cli_convert(tmp_path / "src", tmp_path / "out", ("--position-mean", "16"), line, model, ids, capsys)
