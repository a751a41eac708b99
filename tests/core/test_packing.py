"""Packed rows (several documents in one row, position ids restarting, no attention mask) against the
same documents run alone: every row that takes position ids, every backend, the fold and the bias path,
sinks and the pretrained preset (first tokens of each document), half precision.

The reference is the converted model itself on each document alone (a plain forward, no position ids,
no packing code involved), which tests/architectures/test_architectures.py checks against tests/reference.py.
"""

import pytest
import torch
from arch_cases import CASES, VOCAB

import hf_alibi
from hf_alibi.core.bias import BIAS

# two rows of 64 tokens (4x every tiny config's original length), three and two documents
DOCUMENTS = [(20, 33, 11), (40, 24)]
# T5 takes no position ids: transformers has no packed format for it
PACKABLE = [case for case in CASES if case.takes_position_ids]
CONVERSIONS = {"paper": {}, "sinks": {"sinks": 2}, "pretrained": {"preset": "pretrained"}}


def packed_batch(case, seed: int = 0):
    """``(input_ids, position_ids, documents)``: each row the concatenation of its documents, position ids
    restarting at the first position for each (RoBERTa's positions begin at padding_idx + 1)."""
    generator = torch.Generator().manual_seed(seed)
    start = case.make().config.pad_token_id + 1 if case.model_type == "roberta" else 0
    documents = [[torch.randint(3, VOCAB, (n,), generator=generator) for n in row] for row in DOCUMENTS]
    ids = torch.stack([torch.cat(row) for row in documents])
    positions = torch.stack([torch.cat([torch.arange(start, start + len(d)) for d in row]) for row in documents])
    return ids, positions, documents


def paths(model) -> set:
    return {m.last_path for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)}


def split_logits(model, ids, documents, **kwargs):
    """The logits of a packed forward (with ``kwargs``), the paths it took, and each document's logits alone."""
    with torch.no_grad():
        packed = model(input_ids=ids, use_cache=False, **kwargs).logits if kwargs else None
        taken = paths(model)
        alone = [[model(input_ids=d[None]).logits[0] for d in row] for row in documents]
    return packed, alone, taken


def assert_packed_equals_alone(packed, alone, atol):
    for r, row in enumerate(alone):
        offset = 0
        for logits in row:
            torch.testing.assert_close(packed[r, offset : offset + len(logits)], logits, rtol=0, atol=atol)
            offset += len(logits)


def convert(case, backend, variant, conversion):
    model = case.make(attn_implementation=backend)
    return hf_alibi.patch_model(model, encoder_variant=variant, **CONVERSIONS[conversion])


# every row on each backend; the bias path, sinks and the preset on the rows that run the whole suite
# (arch_cases.REDUCED rows share their layout with a full one)
PARAMS = [
    (case, variant, backend, path, conversion)
    for case in PACKABLE
    for variant in case.variants
    for backend in case.backends
    for path in ((None, BIAS) if backend == "sdpa" and case.full else (None,))
    for conversion in (CONVERSIONS if case.full else ["paper"])
]
IDS = [f"{c.name}-{v or 'causal'}-{b}{'-bias' if p else ''}-{n}" for c, v, b, p, n in PARAMS]


@pytest.mark.parametrize(("case", "variant", "backend", "path", "conversion"), PARAMS, ids=IDS)
def test_packed_rows_equal_documents_run_alone(case, variant, backend, path, conversion):
    model = convert(case, backend, variant, conversion)
    if path is not None:
        hf_alibi.set_attention_path(model, path)
    ids, positions, documents = packed_batch(case)
    packed, alone, taken = split_logits(model, ids, documents, position_ids=positions)
    assert_packed_equals_alone(packed, alone, atol=1e-5)
    if case.kind == "decoder" and backend == "sdpa" and path is None:
        assert taken == {"folded"}  # the fold takes the documents' mask (no L x L bias tensor)


@pytest.mark.parametrize("case", PACKABLE, ids=[c.name for c in PACKABLE])
def test_without_packing_the_documents_would_mix(case):
    # the check above can fail: the same rows as one sequence each (ids that do not restart) differ
    model = convert(case, case.backends[-1], case.variants[0], "paper")
    ids, positions, documents = packed_batch(case)
    with torch.no_grad():
        unpacked = model(input_ids=ids, use_cache=False).logits
    later = slice(len(documents[0][0]), None)  # the documents after the first of row 0
    assert (unpacked[0, later] - torch.cat(split_logits(model, ids, documents)[1][0][1:])).abs().max() > 1e-4


FLEX_CASES = [case for case in PACKABLE if case.name in ("opt", "llama", "mistral", "bert")]  # GPT-2 has no flex


@pytest.mark.parametrize("conversion", ["paper", "sinks"])
@pytest.mark.parametrize(
    ("case", "variant"),
    [(c, v) for c in FLEX_CASES for v in c.variants],
    ids=[f"{c.name}-{v or 'causal'}" for c in FLEX_CASES for v in c.variants],
)
def test_packed_rows_on_flex_attention(case, variant, conversion):
    model = convert(case, "flex_attention", variant, conversion)
    ids, positions, documents = packed_batch(case)
    packed, alone, taken = split_logits(model, ids, documents, position_ids=positions)
    assert taken == {"flex"}
    assert_packed_equals_alone(packed, alone, atol=1e-5)


HALF_CASES = [case for case in PACKABLE if case.name in ("gpt2", "llama", "qwen2", "gpt_neox", "bert")]


@pytest.mark.parametrize("conversion", ["paper", "sinks"])
@pytest.mark.parametrize("case", HALF_CASES, ids=[c.name for c in HALF_CASES])
def test_packed_rows_in_bfloat16(case, conversion):
    # bf16 rounds q, k, v and the weights (2^-8): packed and alone agree to the error each has against fp32
    model = convert(case, "sdpa", case.variants[0], conversion)
    ids, positions, documents = packed_batch(case)
    _, exact, _ = split_logits(model, ids, documents)
    model = model.to(torch.bfloat16)
    packed, alone, _ = split_logits(model, ids, documents, position_ids=positions)
    worst = max((a.float() - e).abs().max().item() for row_a, row_e in zip(alone, exact) for a, e in zip(row_a, row_e))
    assert 0 < worst < 0.1
    assert_packed_equals_alone(packed.float(), exact, atol=2 * worst)


def test_packed_batch_of_rows_with_one_position_row_each():
    # position ids (1, L) for a batch of 2 identical packed rows: transformers broadcasts them, so does hf_alibi
    case = next(c for c in PACKABLE if c.name == "llama")
    model = convert(case, "sdpa", None, "sinks")
    ids, positions, documents = packed_batch(case)
    ids = ids[:1].expand(2, -1)
    packed, alone, _ = split_logits(model, ids, documents[:1] * 2, position_ids=positions[:1])
    assert_packed_equals_alone(packed, alone, atol=1e-5)


def test_packed_row_with_a_cache_to_continue_is_not_packed():
    # ids that restart while a cache holds earlier tokens are a continuation, not a packed row: ignored
    case = next(c for c in PACKABLE if c.name == "llama")
    model = convert(case, "sdpa", None, "paper")
    ids, positions, _ = packed_batch(case)
    with torch.no_grad():
        first = model(input_ids=ids[:, :10], use_cache=True)
        ignored = model(input_ids=ids[:, 10:], past_key_values=first.past_key_values, position_ids=positions[:, 10:])
        first = model(input_ids=ids[:, :10], use_cache=True)
        plain = model(input_ids=ids[:, 10:], past_key_values=first.past_key_values)
    torch.testing.assert_close(ignored.logits, plain.logits, rtol=0, atol=0)


@pytest.mark.parametrize("tuner", ["lora", "adalora"])
@pytest.mark.parametrize("name", ["opt", "gpt2", "llama"])
def test_packed_rows_through_peft(name, tuner):
    # packed rows through PEFT's tuners: LoRA calls the model, AdaLoRA its forward (self.model.forward, past
    # nn.Module's hooks; OPT's head then runs its inner decoder, past the base model's). Adapters start at B = 0
    from peft import AdaLoraConfig, LoraConfig, get_peft_model

    case = next(c for c in PACKABLE if c.name == name)
    model = convert(case, "sdpa", None, "paper")
    targets = ["c_attn"] if name == "gpt2" else ["q_proj", "v_proj"]
    config = (
        LoraConfig(r=4, target_modules=targets)
        if tuner == "lora"
        else AdaLoraConfig(init_r=4, target_r=2, total_step=10, target_modules=targets)
    )
    model = get_peft_model(model, config)
    ids, positions, documents = packed_batch(case)
    packed, alone, _ = split_logits(model, ids, documents, position_ids=positions)
    assert_packed_equals_alone(packed, alone, atol=1e-5)
