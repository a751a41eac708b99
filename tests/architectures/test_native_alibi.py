"""The models trained with ALiBi (BLOOM, MPT, Falcon-RW) on hf_alibi's attention paths, each against transformers'
own class as the reference: the same instance before ``patch_model`` (deep-copied), or transformers' model built from
the same config and weights (MPT with a larger ``max_seq_len``, since its own code crashes past it). flash-attn,
continuous batching and Falcon's bias rounded per key: test_native_kernels.py, against the same references.

Two transformers bugs shape the references (transformers 5.24): its MPT always uses bias max 8 (``MptModel.forward``
does not pass ``attn_config.alibi_bias_max`` to ``build_mpt_alibi_tensor``), so for another bias max the reference is
transformers' MPT with that one call given the config's value on the instance, as MosaicML's code and llama.cpp read
it; and its Falcon eager path adds the ALiBi bias twice (the layer adds it, then the mask the model merged it into),
so Falcon's reference is transformers' sdpa path, its default.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers
from arch_cases import MAX_LEN, NativeCase
from arch_cases import NATIVE_CASES as CASES
from sharing import run_child, run_cli
from tiny import VOCAB, random_ids
from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

import hf_alibi
from hf_alibi.core.dispatch import FOLD_MIN_QUERIES
from hf_alibi.native import is_native

LONG = 40  # past MPT's max_seq_len
IDS = [case.name for case in CASES]
BACKENDS = ("sdpa", "eager", "flex_attention")
PATHS = {"sdpa": "folded", "eager": "bias", "flex_attention": "flex"}  # what each backend runs on LONG


def patched(case: NativeCase, **overrides):
    """(transformers' model, hf_alibi's copy of it)."""
    original = case.make(**overrides)
    return original, hf_alibi.patch_model(copy.deepcopy(original))


def attentions(model):
    return [m for m in model.modules() if isinstance(getattr(m, "alibi", None), hf_alibi.AlibiBias)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_registry_knows_the_native_types(case):
    assert case.model_type in hf_alibi.native_model_types()
    assert case.model_type not in hf_alibi.supported_model_types()  # nothing of theirs is converted
    assert hf_alibi.get_native_architecture(case.model_type).strategy == "native"


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("length", [12, LONG])
def test_logits_equal_transformers_on_every_backend(case, length):
    original, model = patched(case)
    ids = random_ids(2, length)
    with torch.no_grad():
        expected = case.reference(original, length)(ids).logits
        for backend in BACKENDS:
            model.set_attn_implementation(backend)
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=2e-5, msg=backend)
            if length >= FOLD_MIN_QUERIES:  # fewer queries take the bias path on sdpa
                assert {a.alibi.last_path for a in attentions(model)} == {PATHS[backend]}


def test_mpt_transformers_own_code_fails_past_max_seq_len_and_hf_alibi_runs():
    case = CASES[2]
    original, model = patched(case)
    with pytest.raises(RuntimeError), torch.no_grad():
        original(random_ids(1, MAX_LEN + 1))
    with torch.no_grad():
        assert model(random_ids(1, 4 * MAX_LEN)).logits.shape == (1, 4 * MAX_LEN, VOCAB)


def _transformers_slopes(case: NativeCase, model) -> list[float]:
    """The slopes transformers' own code builds for the model (its functions, not hf_alibi's)."""
    heads = model.config.num_attention_heads
    if case.model_type == "mpt":
        bias_max = model.config.attn_config.alibi_bias_max
        return (-build_mpt_alibi_tensor(heads, 2, bias_max)[:, 0, 0]).tolist()  # the bias of key 0, 1 back
    if case.model_type == "falcon":  # its own bias (slopes rounded to bf16) of key 1, added before 1 / sqrt(head_dim)
        slopes = falcon_alibi(torch.ones(1, 2, dtype=torch.long), heads, torch.float32).view(heads, 2)[:, 1]
        return (slopes.double() / math.sqrt(model.config.hidden_size // heads)).tolist()
    # the bias of key 1 (its build_alibi_tensor, in every 5.x; 5.24's _get_alibi_slopes is not in 5.19)
    return bloom_alibi(torch.ones(1, 2, dtype=torch.long), heads, torch.float32).view(heads, 2)[:, 1].tolist()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_layer_carries_the_models_own_slopes_in_its_order(case):
    _, model = patched(case)
    expected = _transformers_slopes(case, model)
    for attention in attentions(model):
        assert list(attention.alibi.slope_values) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_weight_is_kept(case):
    original, model = patched(case)
    before, after = original.state_dict(), model.state_dict()
    assert list(before) == list(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert type(model).__name__ == type(original).__name__ and is_native(model) and not is_native(original)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_left_padding_equals_transformers(case):
    original, model = patched(case)
    ids = random_ids(2, 14)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        expected = case.reference(original, 14)(ids, attention_mask=mask).logits
        for backend in BACKENDS:
            model.set_attn_implementation(backend)
            got = model(ids, attention_mask=mask).logits
            torch.testing.assert_close(got[0], expected[0], rtol=0, atol=2e-5, msg=backend)
            torch.testing.assert_close(got[1, 5:], expected[1, 5:], rtol=0, atol=2e-5, msg=backend)


@pytest.mark.parametrize("case", CASES[::2], ids=IDS[::2])
def test_greedy_generation_with_the_cache_equals_transformers(case):
    original, model = patched(case)
    ids = random_ids(2, 6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    new = 12  # past MPT's max_seq_len: the reference is built longer
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = case.reference(original, 6 + new).generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs), expected)


def padded_prompts(length: int, pad: int, new_tokens: int) -> tuple[torch.Tensor, dict]:
    """Two prompts of ``length``, the first left padded by ``pad``, and greedy generate()'s keywords returning every
    step's scores (the cache asked for: MPT's config turns it off)."""
    ids = random_ids(2, length)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                     pad_token_id=0, use_cache=True, return_dict_in_generate=True, output_scores=True)  # fmt: skip


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]], ids=lambda c: c.name)
def test_static_cache_generation_scores_equal_transformers_dynamic_cache(case):
    """generate(cache_implementation="static"), left padded, on every backend: each step's scores against transformers'
    own class with its dynamic cache (its own Falcon fails with a static cache; MPT's config turns the cache off by
    default: use_cache=True asks for it). generate() hands a static cache's models a 4D mask it makes itself, eager's
    additive, which MPT's forward would cast to bool the wrong way round."""
    original, model = patched(case)
    ids, kwargs = padded_prompts(10, 3, 8)
    with torch.no_grad():
        expected = case.reference(original, 18).generate(ids, **kwargs)
        for backend in BACKENDS:
            model.set_attn_implementation(backend)
            got = model.generate(ids, cache_implementation="static", **kwargs)
            assert type(got.past_key_values).__name__ == "StaticCache"
            assert torch.equal(got.sequences, expected.sequences), backend
            for mine, theirs in zip(got.scores, expected.scores):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-5, msg=backend)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_packed_rows_equal_each_document_alone(case):
    _, model = patched(case)
    lengths = (5, 7, 4)
    docs = [random_ids(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = [case.reference(case.make(), n)(doc).logits for doc, n in zip(docs, lengths)]
        for backend in ("sdpa", "eager"):
            model.set_attn_implementation(backend)
            packed = model(torch.cat(docs, dim=1), position_ids=position_ids).logits
            torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=2e-5, msg=backend)


@pytest.mark.parametrize("case", [c for c in CASES if c.model_type != "falcon"], ids=lambda c: c.name)
def test_attention_weights_on_eager_equal_transformers(case):
    # (Falcon's own eager path adds the bias twice, see the module docstring: no reference there)
    original, model = patched(case)
    model.set_attn_implementation("eager")
    ids = random_ids(1, 12)
    with torch.no_grad():
        expected = case.reference(original, 12)(ids, output_attentions=True).attentions
        got = model(ids, output_attentions=True).attentions
    assert len(got) == len(expected) == 2
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=lambda c: c.name)
def test_training_step_gradients_equal_transformers(case):
    original, model = patched(case)
    reference = case.reference(original, 24).train()
    model.train()
    ids = random_ids(2, 24)
    reference(ids, labels=ids).loss.backward()
    model(ids, labels=ids).loss.backward()
    grads = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=lambda c: c.name)
def test_bf16_fold_is_as_close_as_transformers_own_bf16(case):
    original, model = patched(case)
    ids = random_ids(2, 64)
    with torch.no_grad():
        expected = case.reference(original, 64)(ids).logits
        own = copy.deepcopy(case.reference(original, 64)).to(torch.bfloat16)(ids).logits.float()
        got = model.to(torch.bfloat16)(ids).logits.float()
    assert {a.alibi.last_path for a in attentions(model)} == {"folded"}
    own_error = (own - expected).abs().max().item()
    assert (got - expected).abs().max().item() <= 2 * own_error + 1e-2


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=lambda c: c.name)
def test_compiled_fullgraph_equals_transformers(case):
    original, model = patched(case)
    ids = random_ids(1, 20)
    with torch.no_grad():
        expected = case.reference(original, 20)(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("mpt", dict(attn_config=dict(alibi=False)), "attn_config.alibi=False"),
        ("falcon", dict(alibi=False), "alibi=False"),
        ("falcon", dict(multi_query=True), "multi_query"),
        ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2), "new_decoder_architecture"),
    ],
)
def test_models_without_alibi_or_another_layout_are_refused_unchanged(model_type, overrides, message):
    case = next(c for c in CASES if c.model_type == model_type)
    model = case.make(**overrides)
    before = copy.deepcopy(model.state_dict())
    cls = type(model)
    with pytest.raises(ValueError, match=message) as error:
        hf_alibi.patch_model(model)
    assert "\n" not in str(error.value)
    assert type(model) is cls and not is_native(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "options", [dict(preset="pretrained"), dict(sinks=1), dict(slope_scale=0.5), dict(encoder_variant="symmetric")]
)
def test_conversion_options_are_refused(options):
    model = CASES[0].make()
    with pytest.raises(ValueError, match="trained with ALiBi") as error:
        hf_alibi.patch_model(model, **options)
    assert "\n" not in str(error.value) and not is_native(model)


def test_patching_twice_is_refused():
    _, model = patched(CASES[0])
    with pytest.raises(ValueError, match="already runs on hf_alibi"):
        hf_alibi.patch_model(model)


def test_convert_says_there_is_nothing_to_convert():
    with pytest.raises(ValueError, match="trained with ALiBi: there is nothing to convert"):
        hf_alibi.get_architecture("bloom")


def test_a_pickled_patched_model_loads_in_a_fresh_process_on_hf_alibis_paths(tmp_path):
    """torch.save(model) (pickle) of a patched MPT, loaded where hf_alibi has made none of its classes yet: the same
    classes, still past max_seq_len, transformers' logits (its own MPT with a longer max_seq_len as the reference)."""
    case = CASES[3]
    original, model = patched(case)
    torch.save(model, tmp_path / "model.pt")
    ids = random_ids(1, LONG)
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = case.reference(original, LONG)(ids).logits
    child = run_child(
        f"""
        import torch
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})).logits, {str(tmp_path / "logits.pt")!r})
        from hf_alibi.native import is_native
        print(type(model).__module__, type(model).__name__, is_native(model))
        """,
        cwd=tmp_path,
        hf_home=tmp_path / "hf",
        block_hf_alibi=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[-3:] == ["hf_alibi.native", type(original).__name__, "True"]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=2e-5)


# MPT in the default tier (its config's nested attn_config and max_seq_len); BLOOM and Falcon in the slow one (a
# child process each, 6 s)
SAVED_CASES = [pytest.param(CASES[1], marks=pytest.mark.slow), CASES[3],
               pytest.param(CASES[6], marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize("case", SAVED_CASES, ids=lambda c: c.name)
def test_saved_folder_is_the_original_format_and_plain_transformers_loads_it(case, tmp_path):
    original, model = patched(case)
    folder, plain = tmp_path / "saved", tmp_path / "plain"
    model.save_pretrained(folder)
    original.save_pretrained(plain)
    config = json.loads((folder / "config.json").read_text())
    assert config == json.loads((plain / "config.json").read_text())  # no marker, no auto_map, the same backend
    assert config["model_type"] == case.model_type and config["architectures"] == [type(original).__name__]
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in plain.iterdir())  # no remote code
    ids = random_ids(1, 12)
    with torch.no_grad():
        expected = original(ids).logits  # transformers' own, what plain transformers must give
        ours = case.reference(original, 12)(ids).logits  # with MPT's bias max (see the module docstring)
    torch.save(ids, tmp_path / "ids.pt")
    child = run_child(
        f"""
        import torch, transformers
        model = transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r}).eval()
        with torch.no_grad():
            logits = model(torch.load({str(tmp_path / "ids.pt")!r})).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        print(type(model).__module__, type(model).__name__)
        """,
        cwd=tmp_path,
        hf_home=tmp_path / "hf",
        block_hf_alibi=True,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[-1] == type(original).__name__ and "transformers.models" in child.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=0)
    reloaded = hf_alibi.patch_model(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ours, rtol=0, atol=2e-5)


def test_info_says_a_saved_folder_is_natively_alibi(tmp_path, capsys):
    _, model = patched(CASES[2])
    model.save_pretrained(tmp_path / "mpt")
    code, out, _ = run_cli("info", tmp_path / "mpt", capsys=capsys)
    assert code == 0 and "a mpt model trained with ALiBi (natively ALiBi: nothing to convert)" in out
    CASES[2].make(attn_config=dict(alibi=False)).save_pretrained(tmp_path / "plain")
    code, out, _ = run_cli("info", tmp_path / "plain", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["native_alibi"] is False
    code, _, err = run_cli("convert", tmp_path / "mpt", tmp_path / "out", capsys=capsys)
    assert code == 2 and "trained with ALiBi: there is nothing to convert" in err


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=lambda c: c.name)
def test_export_gguf_says_what_reads_the_original_format(case, tmp_path, capsys):
    """The folder stays the original format, which llama.cpp's own converter reads (bloom, mpt); its falcon is
    rotary only. One line, nothing written, for a saved folder and for the patched model object."""
    from hf_alibi.export.gguf import GGUFExportError

    _, model = patched(case)
    model.save_pretrained(tmp_path / "folder")
    code, _, err = run_cli("export-gguf", tmp_path / "folder", tmp_path / "m.gguf", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "trained with ALiBi and keeps transformers' own format" in err
    expected = "convert_hf_to_gguf.py" if case.model_type in ("bloom", "mpt") else "llama.cpp has no falcon with ALiBi"
    assert expected in err
    with pytest.raises(GGUFExportError, match="trained with ALiBi"):
        hf_alibi.export_gguf(model, tmp_path / "m.gguf", tokenizer=object())
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=lambda c: c.name)
def test_lora_on_the_fused_qkv_trains_as_on_transformers(case):
    peft = pytest.importorskip("peft")
    original, model = patched(case)
    reference = case.reference(original, 24)
    target = hf_alibi.get_native_architecture(case.model_type).qkv
    adapted = []
    for m in (reference, model):
        torch.manual_seed(5)  # the same LoRA initialisation in both
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[target], init_lora_weights=False)
        adapted.append(peft.get_peft_model(m, lora).train())
    ids = random_ids(2, 24)
    losses = [m(input_ids=ids, labels=ids).loss for m in adapted]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    for loss in losses:
        loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in adapted]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 4  # A and B of 2 layers
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
