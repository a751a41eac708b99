"""The rotary window (``rotary_window``, ``rotary_window_stretch``): a query-key pair at distance ``d >= W`` reads
the kept rotary frequencies of wavelength longer than ``rotary_knee`` at distance ``W + (d - W) / stretch``; closer
pairs read every angle as trained. Checked against a reference written here and in tests/reference.py (the original
architecture, its rotary frequencies recomputed from theta, and a float64 attention that turns each far pair's key
by hand, with the sink bias) on every path a converted model takes on this CPU: eager and sdpa (each path below the
window), left padding, the KV cache, generation, packed rows, torch.compile(fullgraph=True), saved and reloaded; and
the refusals of the paths that cannot carry it past the window.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from reference import fairseq_slopes, first_real_tokens, register_window_reference, sink_bias
from sharing import assert_every_path_matches
from tiny import VOCAB, random_ids

import hf_alibi
from hf_alibi.core.kernels import KERNEL_BY_NAME, kernel_refusal

THETA, NATIVE = 10000.0, 16
KNEE, WAVELENGTH = 16.0, 1000.0  # frequencies 1, 0.1, 0.01, 0.001: kept 1 (plain), 0.1 and 0.01 (slowed)
WINDOW, STRETCH = 12, 3.0
LENGTH = 40
ROTARY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=NATIVE, bos_token_id=0, eos_token_id=0,
    pad_token_id=0, attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": THETA},
)  # fmt: skip
OPTIONS = dict(
    sinks=1, slope_scale=0.25, rotary_max_wavelength=WAVELENGTH, rotary_knee=KNEE, rotary_window=WINDOW,
    rotary_window_stretch=STRETCH,
)  # fmt: skip


def make(attn: str = "sdpa") -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**ROTARY, attn_implementation=attn)).eval()


def converted(**options):
    return hf_alibi.patch_model(make(), **{**OPTIONS, **options})


def reference_logits(model, ids, mask=None) -> torch.Tensor:
    """The converted ``model``'s weights in the original Llama, rotary frequencies of wavelength > WAVELENGTH
    removed, and the float64 window attention of tests/reference.py with the sink bias."""
    width = ROTARY["head_dim"]
    frequency = [THETA ** (-2 * k / width) for k in range(width // 2)]
    kept = [f if 2 * math.pi / f <= WAVELENGTH else 0.0 for f in frequency]
    slowed = [f if f and 2 * math.pi / f > KNEE else 0.0 for f in kept]
    assert sum(1 for f in slowed if f) == 2  # the window has channels to slow, and channels to leave
    slopes = [0.25 * s for s in fairseq_slopes(4)]
    mapped = lambda d: d if d < WINDOW else WINDOW + (d - WINDOW) / STRETCH  # noqa: E731  (far pairs' penalty too)
    bias = sink_bias("causal", slopes, ids.shape[1], 1, first_real_tokens(mask, ids.shape[0]), mapped)
    name = "hf_alibi_tests_window_reference"
    register_window_reference(name, bias, WINDOW, STRETCH, slowed)
    reference = make(name)
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in n for n in missing), (missing, unexpected)
    reference.model.rotary_emb.inv_freq.copy_(torch.tensor(kept))
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=mask).logits


def test_every_attention_path_equals_the_reference_past_the_window():
    ids = random_ids(2, LENGTH, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    model = converted()
    expected = reference_logits(model, ids, mask)

    def took_the_window(backend, path):
        assert model.model.layers[0].self_attn.alibi.last_path == "window", (backend, path)

    assert_every_path_matches(model, ids, mask, expected, after=took_the_window)
    # inside the window the model is the conversion without one, to the bit; past it, another model
    plain = hf_alibi.patch_model(make(), **{**OPTIONS, "rotary_window": None, "rotary_window_stretch": 1.0})
    hf_alibi.set_attention_path(model, "auto")
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        inside = [m(input_ids=ids[:1, :WINDOW]).logits for m in (plain, model)]
        past = [m(input_ids=ids[:1]).logits for m in (plain, model)]
    assert torch.equal(*inside)
    assert model.model.layers[0].self_attn.alibi.last_path == "window"
    assert (past[0][:, WINDOW + 2 :] - past[1][:, WINDOW + 2 :]).abs().max() > 1e-4


def test_the_cache_and_generation_read_the_window_from_the_row():
    """Chunks fed through the KV cache give the reference's logits (the queries' distances counted from the cache),
    and greedy decoding past the window the reference's tokens."""
    model = converted()
    ids = random_ids(1, LENGTH, seed=4)
    expected = reference_logits(model, ids)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        parts = [model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).logits
                 for a, b in [(0, 10), (10, 17), (17, 18), (18, LENGTH)]]  # fmt: skip
    assert (torch.cat(parts, 1) - expected).abs().max() < 2e-5
    generated = model.generate(ids[:, :8], max_new_tokens=24, do_sample=False, min_new_tokens=24)
    reference = reference_logits(model, generated[:, :-1])[0].argmax(-1)
    assert torch.equal(generated[0, 8:], reference[7:])


def test_a_static_cache_places_its_keys_from_the_sequence_end():
    model = converted()
    ids = random_ids(1, 30, seed=9)
    dynamic = model.generate(ids[:, :8], max_new_tokens=20, do_sample=False, min_new_tokens=20)
    static = model.generate(
        ids[:, :8], max_new_tokens=20, do_sample=False, min_new_tokens=20, cache_implementation="static"
    )
    assert torch.equal(static, dynamic)


def test_packed_rows_keep_each_document_to_itself():
    model = converted()
    first, second = random_ids(1, 28, seed=5), random_ids(1, 22, seed=6)
    positions = torch.cat([torch.arange(28), torch.arange(22)])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions).logits
    assert (packed[:, :28] - reference_logits(model, first)).abs().max() < 2e-5
    assert (packed[:, 28:] - reference_logits(model, second)).abs().max() < 2e-5


def test_compiled_in_one_graph_equals_eager():
    model = converted()
    ids = random_ids(1, LENGTH, seed=7)
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        compiled = torch.compile(model, fullgraph=True)(input_ids=ids).logits
    assert (compiled - eager).abs().max() < 2e-5


def test_gradients_flow_through_the_window():
    model = converted()
    model.train()
    ids = random_ids(1, LENGTH, seed=10)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_saved_reloaded_and_said(tmp_path):
    model = converted()
    ids = random_ids(1, LENGTH, seed=8)
    model.save_pretrained(tmp_path / "window")
    saved = hf_alibi.AlibiSettings.from_dict(transformers.AutoConfig.from_pretrained(tmp_path / "window").alibi)
    assert (saved.rotary_window, saved.rotary_window_stretch) == (WINDOW, STRETCH)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "window").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    from hf_alibi.core.settings import describe_options

    assert "and the penalty read distance W + (d - W) / 3 past distance W = 12" in describe_options(saved)


def test_kernels_that_cannot_carry_it_refuse_past_the_window_only():
    alibi = converted(sinks=0, slope_scale=1.0).model.layers[0].self_attn.alibi  # what every fused kernel renders
    model = converted()
    for name in ("flash_attention_2", "alibi_flash_attention_4", "cudnn"):
        if KERNEL_BY_NAME.get(name.removeprefix("alibi_")) is None:
            continue
        assert kernel_refusal(name, alibi, WINDOW) is None
        reason = kernel_refusal(name, alibi, WINDOW + 1)
        assert "cannot carry the rotary window past 12 tokens" in reason and "'sdpa'" in reason
    ids = random_ids(1, LENGTH, seed=11)
    model.set_attn_implementation("flex_attention")
    with torch.no_grad():
        model(input_ids=ids[:, :WINDOW])  # inside the window flex runs the same math
        with pytest.raises(NotImplementedError, match="flex_attention cannot carry the rotary window past 12"):
            model(input_ids=ids)


def test_continuous_batching_refuses_past_the_window():
    model = converted()
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batches = transformers.ContinuousBatchingConfig(num_blocks=32, page_size=16, max_batch_tokens=16,
                                                    max_requests_per_batch=2)  # fmt: skip
    prompts = random_ids(1, 6, seed=12)[0].tolist(), random_ids(1, 20, seed=13)[0].tolist()
    short, long = (list(model.generate_batch([prompt], generation_config=config, continuous_batching_config=batches,
                                             progress_bar=False).values())[0] for prompt in prompts)  # fmt: skip
    assert short.error is None and len(short.generated_tokens) == 4  # 10 tokens: inside the window
    expected = model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert short.generated_tokens == expected[0, 6:].tolist()
    assert "Continuous batching cannot carry the rotary window past 12 tokens" in str(long.error)
    assert "generate()" in str(long.error)


def test_vllm_refuses_the_window():
    from hf_alibi.serve.vllm.support import refusal

    assert "rotary_window" in refusal(converted().config)
    assert refusal(converted(rotary_window=None, rotary_window_stretch=1.0).config) is None


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rotary_window=0), "rotary_window must be an integer >= 1"),
        (dict(rotary_window=12.5), "rotary_window must be an integer >= 1"),
        (dict(rotary_window_stretch=0.5), "rotary_window_stretch must be a finite number >= 1"),
        (dict(rotary_knee=None), "give rotary_knee"),
        (dict(rotary_max_wavelength=None), "keep the rotary frequencies"),
        (dict(rotary_stretch=2.0), "use one"),
        (dict(rotary_interpolation=1.5), "use one"),
        (dict(rotary_window=None), "give rotary_window too"),
    ],
)
def test_bad_values_are_one_line(options, message):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        hf_alibi.patch_model(model, **{**OPTIONS, **options})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gguf_export_refuses_it():
    from hf_alibi.export.gguf import GGUFExportError, check_exportable

    with pytest.raises(GGUFExportError, match="llama.cpp cannot express .*rotary_window=12"):
        check_exportable(converted())


LOAD_WITHOUT_HF_ALIBI = """
import json, sys, torch, transformers
expected = torch.load("expected.pt")
model = transformers.AutoModelForCausalLM.from_pretrained(".", trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(input_ids=expected["ids"]).logits
path = model.model.layers[0].self_attn.alibi.last_path
print(json.dumps({"hf_alibi": "hf_alibi" in sys.modules, "error": (logits - expected["logits"]).abs().max().item(),
                  "path": path}))
"""


def test_remote_code_without_hf_alibi_carries_the_window(tmp_path):
    from sharing import last_json_line, run_child

    model = converted()
    ids = random_ids(1, LENGTH, seed=14)
    model.save_pretrained(tmp_path)
    torch.save({"ids": ids, "logits": reference_logits(model, ids)}, tmp_path / "expected.pt")
    result = run_child(LOAD_WITHOUT_HF_ALIBI, tmp_path, tmp_path / "hf", block_hf_alibi=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json_line(result.stdout)
    assert report["hf_alibi"] is False and report["path"] == "window" and report["error"] < 2e-5, report


@pytest.mark.parametrize("layout", ["halves", "pairs"])
def test_the_far_turn_rotates_each_slowed_pair_in_either_layout(layout):
    """``RotaryWindow.turn`` against complex multiplication, pair by pair: Llama's halves (channel c with c + w/2)
    and GPT-J's interleaved pairs (2c with 2c + 1), over a partial rotary width (the channels past it untouched)."""
    from types import SimpleNamespace

    from hf_alibi.core.window import RotaryWindow

    frequency = torch.tensor([1.0, 0.1, 0.01])  # per pair; the 0.01 pair is slowed (wavelength 628 > the knee 100)
    per_channel = torch.cat((frequency, frequency)) if layout == "halves" else frequency.repeat_interleave(2)
    rotary = SimpleNamespace(frequency=per_channel, kept=torch.ones(6, dtype=torch.bool))
    window = RotaryWindow(8, 2.0, 100.0, rotary)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)  # 6 rotary channels of 8
    shift = torch.tensor([0.0, 1.0, 7.5, -3.0, 100.0], dtype=torch.float64)
    turned = window.turn(x, shift)
    pairs = [(c, c + 3) if layout == "halves" else (2 * c, 2 * c + 1) for c in range(3)]
    for c, (a, b) in enumerate(pairs):
        z = torch.complex(x[..., a], x[..., b])
        expected = z * torch.exp(1j * shift * frequency[c].item()) if c == 2 else z  # only the slowed pair turns
        torch.testing.assert_close(turned[..., a], expected.real)
        torch.testing.assert_close(turned[..., b], expected.imag)
    torch.testing.assert_close(turned[..., 6:], x[..., 6:])
