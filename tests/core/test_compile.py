"""torch.compile of a converted model: one graph, no break, no recompile, the eager numbers.

The unpatched GPT-2 and Llama trace to one graph with no break; their conversions must too, on the
eager backend (the bias path and the shared mask) and on sdpa (the fold). ``fullgraph=True`` runs with
the ``aot_eager`` compiler backend: it traces through AOT autograd as inductor does, without inductor's
C++ build (20 to 50 s per tiny model on this CPU), which is the part that has nothing of hf_alibi's.
"""

import pytest
import torch
from arch_cases import CASES
from tiny import random_ids

import hf_alibi

CASE = {case.name: case for case in CASES}
LENGTH = 40  # past FOLD_MIN_QUERIES (the fold is taken on sdpa)
# the unpatched models (the graph-count reference) must reach LENGTH positions too
ROOM = {"gpt2": {"n_positions": LENGTH}, "llama": {"max_position_embeddings": LENGTH}}


def padded_inputs(seed: int = 1) -> dict:
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :7] = 0  # left padding: transformers' mask and the bias are merged in the graph
    return {"input_ids": random_ids(2, LENGTH, seed=seed), "attention_mask": mask, "use_cache": False}


def logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def alibi_layers(model) -> list:
    return [module for module in model.modules() if isinstance(module, hf_alibi.AlibiBias)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_explain_finds_one_graph_and_no_break_like_the_unpatched_model(name, backend):
    inputs = padded_inputs()
    counts = {}
    for converted in (False, True):
        model = CASE[name].make(attn_implementation=backend, **ROOM[name])
        if converted:
            hf_alibi.patch_model(model)
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(**inputs)
        reasons = [str(reason.reason).splitlines()[0] for reason in explained.break_reasons]
        counts[converted] = (explained.graph_count, explained.graph_break_count, reasons)
    assert counts[False] == (1, 0, [])  # the reference: transformers' own model
    assert counts[True] == counts[False]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fullgraph_compile_equals_eager_and_does_not_recompile(name, backend):
    case = CASE[name]
    model = hf_alibi.patch_model(case.make(attn_implementation=backend))
    inputs, other = padded_inputs(), padded_inputs(seed=2)
    expected, expected_other = logits(model, inputs), logits(model, other)
    plain = {"input_ids": random_ids(1, LENGTH, seed=3), "use_cache": False}
    with torch.no_grad():
        reference = case.reference(model, {"input_ids": plain["input_ids"]}, None)
    shared = alibi_layers(model)[0].shared

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(logits(compiled, inputs), expected, rtol=0, atol=1e-5)
    # the same shapes again, other values: the graph serves them (a dict filled while tracing would
    # fail its guard here and recompile)
    with torch.compiler.set_stance("fail_on_recompile"):
        torch.testing.assert_close(logits(compiled, other), expected_other, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(compiled, plain), reference.float(), rtol=0, atol=1e-5)
    assert {layer.last_path for layer in alibi_layers(model)} == {"folded" if backend == "sdpa" else "bias"}
    # the traced forward cleared what it set for layers that drop keyword arguments; eager forwards still share
    # one mask (the bias path's; the fold makes none)
    assert shared.traced is None
    last = next(m for m in model.modules() if getattr(m, "alibi", None) is alibi_layers(model)[-1])
    seen = []
    handle = last.register_forward_pre_hook(
        lambda m, a, kwargs: seen.append(kwargs["alibi_forward"]), with_kwargs=True
    )
    logits(model, inputs)
    handle.remove()
    assert seen[0].builds == (1 if backend == "eager" else 0)
