"""Every registered architecture, one parametrized suite: numbers against tests/reference.py."""

import copy

import pytest
import torch
from arch_cases import CASE_IDS, CASES, MAX_LEN, VARIANT_IDS, VARIANT_PARAMS

import hf_alibi

DECODING = [case for case in CASES if case.kind != "encoder"]
# every (case, variant) with every backend transformers allows for it
WITH_BACKENDS = [(case, variant, backend) for case, variant in VARIANT_PARAMS for backend in case.backends]
WITH_BACKENDS_IDS = [f"{name}-{backend}" for name, (case, _) in zip(VARIANT_IDS, VARIANT_PARAMS)
                     for backend in case.backends]  # fmt: skip
DECODING_BACKENDS = [(case, backend) for case in DECODING for backend in case.backends]
BIDIRECTIONAL = [(case, variant) for case, variant in VARIANT_PARAMS if case.bidirectional]
BIDIRECTIONAL_IDS = [name for name, (case, _) in zip(VARIANT_IDS, VARIANT_PARAMS) if case.bidirectional]


def logits(model, inputs, **kwargs):
    with torch.no_grad():
        return model(**inputs, **kwargs).logits


def test_suite_covers_exactly_the_registered_architectures():
    assert sorted({case.model_type for case in CASES}) == hf_alibi.supported_model_types()


@pytest.mark.parametrize(("case", "variant", "backend"), WITH_BACKENDS, ids=WITH_BACKENDS_IDS)
def test_logits_match_reference_at_four_times_max_length(case, variant, backend):
    model = case.make(attn_implementation=backend)
    short, long = case.inputs(2, 12), case.inputs(2, 4 * MAX_LEN)
    original = logits(model, short)
    hf_alibi.patch_model(model, encoder_variant=variant)
    assert model.config._attn_implementation == f"alibi_{backend}"
    patched = logits(model, short)
    assert (patched - original).abs().max() > 1e-3  # the conversion did something (100x the tolerance below)
    out = logits(model, long)
    with torch.no_grad():
        reference = case.reference(model, long, variant)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_position_path_is_gone(case):
    model = hf_alibi.patch_model(case.make())
    names = list(model.state_dict())
    removed = ("wpe", "position_embeddings", "embed_positions", "relative_attention")
    assert not any(word in name for name in names for word in removed)
    # a length answers transformers' "no maximum" (VERY_LARGE_INTEGER, comparable), anything else None
    expected = {"n_positions": int(1e30), "max_position_embeddings": int(1e30)}
    assert all(getattr(model.config, field) == expected.get(field) for field in case.removed_fields)
    if not case.takes_position_ids:  # T5: the relative bias was its only position path
        return
    inputs = case.inputs(1, 2 * MAX_LEN)
    shuffled = torch.randperm(2 * MAX_LEN, generator=torch.Generator().manual_seed(0))[None]
    torch.testing.assert_close(logits(model, inputs, position_ids=shuffled), logits(model, inputs), rtol=0, atol=0)


DECODING_WITH_IDS = [case for case in DECODING if case.takes_position_ids]


@pytest.mark.parametrize("preset", ["paper", "pretrained"])
@pytest.mark.parametrize("case", DECODING_WITH_IDS, ids=[c.name for c in DECODING_WITH_IDS])
def test_a_decoding_steps_position_ids_change_nothing(case, preset):
    # one token a row keeps its ids where nothing reads them (the paper's conversion) and loses them where a
    # retained table or rotary does (the pretrained preset): either way the step is the one without ids
    model = hf_alibi.patch_model(case.make(), **({"preset": "pretrained"} if preset == "pretrained" else {}))
    prompt = case.inputs(2, MAX_LEN)["input_ids"]
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
        step, other = prompt[:, -1:], copy.deepcopy(cache)  # sliding caches cannot be cropped back
        far = model(input_ids=step, past_key_values=cache, position_ids=torch.tensor([[7], [100_000]])).logits
        counted = model(input_ids=step, past_key_values=other).logits
    torch.testing.assert_close(far, counted, rtol=0, atol=0)


@pytest.mark.parametrize(("case", "backend"), DECODING_BACKENDS, ids=[f"{c.name}-{b}" for c, b in DECODING_BACKENDS])
def test_generate_with_cache_equals_full_recomputation(case, backend):
    model = hf_alibi.patch_model(case.make(attn_implementation=backend))
    new = MAX_LEN + 8
    eos = model.generation_config.eos_token_id

    def greedy(step_logits):  # min_new_tokens keeps generate() from choosing eos: the same here
        step_logits[:, eos] = float("-inf")
        return step_logits.argmax(-1, keepdim=True)

    if case.kind == "seq2seq":
        source = case.inputs(1, 20)["input_ids"]
        with torch.no_grad():
            cached = model.generate(source, max_new_tokens=new, do_sample=False, use_cache=True, min_new_tokens=new)
            target = torch.zeros(1, 1, dtype=torch.long)  # decoder_start_token_id
            for _ in range(new):
                step = model(source, decoder_input_ids=target, use_cache=False).logits[:, -1]
                target = torch.cat([target, greedy(step)], dim=1)
        assert torch.equal(cached, target)
    else:
        prompt = case.inputs(1, 5)["input_ids"]
        with torch.no_grad():
            cached = model.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0)
            ids = prompt
            for _ in range(new):
                ids = torch.cat([ids, greedy(model(ids, use_cache=False).logits[:, -1])], dim=1)
        assert torch.equal(cached, ids)
    assert cached.shape[1] > MAX_LEN


@pytest.mark.parametrize("case", DECODING, ids=[case.name for case in DECODING])
def test_cached_logits_equal_full_logits(case):
    """Chunked decoding against a cache (several queries per step) gives the full pass's logits."""
    model = hf_alibi.patch_model(case.make())
    inputs = case.inputs(1, 3 * MAX_LEN)
    target_key = "decoder_input_ids" if case.kind == "seq2seq" else "input_ids"
    target = inputs[target_key]
    fixed = {k: v for k, v in inputs.items() if k != target_key}
    full = logits(model, inputs)
    with torch.no_grad():
        out = model(**fixed, **{target_key: target[:, :20]}, use_cache=True)
        chunks, past = [out.logits], out.past_key_values
        for start in range(20, target.shape[1], 7):
            out = model(**fixed, **{target_key: target[:, start : start + 7]}, past_key_values=past, use_cache=True)
            chunks.append(out.logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(("case", "variant", "backend"), WITH_BACKENDS, ids=WITH_BACKENDS_IDS)
def test_padding_does_not_change_real_tokens(case, variant, backend, side):
    model = hf_alibi.patch_model(case.make(attn_implementation=backend), encoder_variant=variant)
    short, long = case.inputs(1, 6, seed=2), case.inputs(1, 10, seed=3)
    ids = short["input_ids"]
    pad = torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([pad, ids], 1) if side == "left" else torch.cat([ids, pad], 1)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0 if side == "left" else 1
    mask[0, 6:] = 0 if side == "right" else 1
    batch = {"input_ids": torch.cat([padded, long["input_ids"]]), "attention_mask": mask}
    if case.kind == "seq2seq":  # the source is padded; the targets are real and of equal length
        target = torch.cat([short["decoder_input_ids"][:, :3], long["decoder_input_ids"][:, :3]])
        batch["decoder_input_ids"] = target
        alone = logits(model, {"input_ids": ids, "decoder_input_ids": target[:1]})[0]
        long_alone = logits(model, {**long, "decoder_input_ids": target[1:]})[0]
        out = logits(model, batch)
        real = out[0]
    else:
        alone, long_alone = logits(model, short)[0], logits(model, long)[0]
        out = logits(model, batch)
        real = out[0, 4:] if side == "left" else out[0, :6]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(real, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], long_alone, rtol=0, atol=1e-5)


DECODER_ONLY = [case for case in DECODING if case.kind == "decoder"]


@pytest.mark.parametrize("case", DECODER_ONLY, ids=[case.name for case in DECODER_ONLY])
def test_left_padded_batch_generation_equals_each_prompt_alone(case):
    model = hf_alibi.patch_model(case.make())
    short, long = case.inputs(1, 4, seed=4)["input_ids"], case.inputs(1, 7, seed=5)["input_ids"]
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    options = dict(max_new_tokens=MAX_LEN, min_new_tokens=MAX_LEN, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, **options)
        alone = model.generate(short, **options)
        long_alone = model.generate(long, **options)
    assert together.shape[1] > MAX_LEN  # past the original maximum
    assert torch.equal(together[0, 3:], alone[0])
    assert torch.equal(together[1], long_alone[0])


@pytest.mark.parametrize(("case", "variant"), BIDIRECTIONAL, ids=BIDIRECTIONAL_IDS)
def test_padded_batch_matches_reference(case, variant):
    """The reference masks padded keys itself: the bias and transformers' mask are merged right."""
    model = hf_alibi.patch_model(case.make(), encoder_variant=variant)
    inputs = case.inputs(2, 2 * MAX_LEN)
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, -9:] = 0
    out = logits(model, inputs, attention_mask=mask)
    with torch.no_grad():
        reference = case.reference(model, inputs, variant, attention_mask=mask)
    real = slice(None) if case.kind == "seq2seq" else slice(0, 2 * MAX_LEN - 9)  # padded queries: anything finite
    torch.testing.assert_close(out[0, real], reference[0, real].float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], reference[1].float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_set_attn_implementation_keeps_the_bias(case):
    model = hf_alibi.patch_model(case.make(attn_implementation=case.backends[-1]))
    inputs = case.inputs(1, 2 * MAX_LEN)
    sdpa = logits(model, inputs)
    model.set_attn_implementation("eager")
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    assert {c._attn_implementation for c in configs.values()} == {"alibi_eager"}
    torch.testing.assert_close(logits(model, inputs), sdpa, rtol=0, atol=1e-5)
