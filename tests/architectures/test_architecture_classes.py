"""Other classes of the registered model types than the suite's task models."""

import torch
import transformers
from arch_cases import _BERT, CASES
from reference import bert_reference_logits, gpt2_reference_logits
from sharing import last_json_line, run_python
from tiny import random_ids, tiny_gpt2

import hf_alibi


def test_t5_encoder_model_equals_the_full_models_encoder():
    case = next(case for case in CASES if case.model_type == "t5")
    full = hf_alibi.patch_model(case.make(), encoder_variant="nonsymmetric")
    encoder = transformers.T5EncoderModel(case.make().config).eval()  # shares its config with its stack
    encoder.load_state_dict(full.state_dict(), strict=False)
    hf_alibi.patch_model(encoder, encoder_variant="nonsymmetric")
    ids = random_ids(2, 50)
    with torch.no_grad():
        expected = full(input_ids=ids, decoder_input_ids=ids[:, :3]).encoder_last_hidden_state
        torch.testing.assert_close(encoder(ids).last_hidden_state, expected, rtol=0, atol=1e-6)


def test_bert_as_a_decoder_is_causal_and_generates_with_cache():
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(transformers.BertConfig(**_BERT, is_decoder=True)).eval()
    hf_alibi.patch_model(model)
    prompt = random_ids(1, 5)
    with torch.no_grad():
        reference = bert_reference_logits(model, random_ids(1, 40), "causal")
        torch.testing.assert_close(model(random_ids(1, 40)).logits, reference.float(), rtol=0, atol=1e-5)
        cached = model.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)
        ids = prompt
        for _ in range(30):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)


def test_bert_inputs_embeds_and_token_types_past_the_original_maximum():
    model = hf_alibi.patch_model(transformers.BertForMaskedLM(transformers.BertConfig(**_BERT)).eval())
    ids = random_ids(2, 70)
    with torch.no_grad():
        by_ids = model(ids).logits
        by_embeds = model(inputs_embeds=model.bert.embeddings.word_embeddings(ids)).logits
        zeros = model(ids, token_type_ids=torch.zeros_like(ids)).logits
        ones = model(ids, token_type_ids=torch.ones_like(ids)).logits
    torch.testing.assert_close(by_embeds, by_ids, rtol=0, atol=1e-6)
    torch.testing.assert_close(zeros, by_ids, rtol=0, atol=0)
    assert (ones - zeros).abs().max() > 1e-3  # token types still count


def test_gpt2_cross_attention_layers_get_no_bias():
    model = hf_alibi.patch_model(tiny_gpt2(add_cross_attention=True))
    assert all(hasattr(block.attn, "alibi") for block in model.transformer.h)
    assert not any(hasattr(block.crossattention, "alibi") for block in model.transformer.h)


def test_gpt2_in_bf16_at_16x_n_positions_stays_close_to_the_fp32_reference():
    model = hf_alibi.patch_model(tiny_gpt2()).to(torch.bfloat16)
    ids = random_ids(1, 256)
    with torch.no_grad():
        logits = model(ids).logits.float()
        reference = gpt2_reference_logits(model.float(), ids)
    assert torch.isfinite(logits).all()
    assert (logits - reference).abs().max() < 0.25  # bf16 has 8 mantissa bits


def test_hf_alibi_models_names_make_their_classes_on_first_use(tmp_path):
    result = run_python(
        """
        import json, sys, transformers, hf_alibi
        def modeling():
            return sorted(m for m in sys.modules if m.startswith("transformers.models.llama.modeling"))
        before = modeling()
        cls, config_cls = hf_alibi.models.AlibiLlamaForCausalLM, hf_alibi.models.AlibiLlamaConfig
        config = config_cls(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, alibi={"base_model_type": "llama", "heads": 4})
        try:
            hf_alibi.models.AlibiNoSuchModel
            missing = "resolved"
        except AttributeError as error:
            missing = str(error)
        print(json.dumps({
            "before": before, "after": modeling(), "base": cls.__bases__[-1] is transformers.LlamaForCausalLM,
            "config": cls.config_class is config_cls, "missing": missing,
            "auto": type(transformers.AutoModelForCausalLM.from_config(config)) is cls,
        }))
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json_line(result.stdout)
    assert report["before"] == [] and report["after"] == ["transformers.models.llama.modeling_llama"], report
    assert report["base"] and report["config"] and report["auto"], report
    assert "has no attribute 'AlibiNoSuchModel'" in report["missing"], report
