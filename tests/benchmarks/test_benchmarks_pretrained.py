"""benchmarks/pretrained.py: its arms (parsing, fitted slopes, YaRN, recovery) and --quick end to end. Its measurements
are hf_alibi.evaluate's, tested against references in tests/evaluate/test_compare.py."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_alibi

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its siblings like the other benchmarks
_spec = importlib.util.spec_from_file_location("bench_pretrained", ROOT / "benchmarks" / "pretrained.py")
bench = sys.modules["bench_pretrained"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def test_arms_parse_and_bad_options_say_what_to_use():
    assert bench.parse_arm("pretrained").options == {"preset": "pretrained"}
    assert bench.parse_arm("yarn:4").options == {"factor": 4.0}
    arm = bench.parse_arm("preset=pretrained,sinks=1,slope_scale=0.03")
    assert (arm.kind, arm.options) == ("alibi", {"preset": "pretrained", "sinks": 1, "slope_scale": 0.03})
    with pytest.raises(SystemExit, match="unknown option 'slope'"):
        bench.parse_arm("slope=0.1")
    assert bench.parse_arm("preset=pretrained,fit=0.1").options == {"preset": "pretrained", "fit": 0.1}


def test_a_fit_arm_gets_the_originals_fitted_slopes(tmp_path):
    _llama().save_pretrained(tmp_path)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    arm = bench.fit_arm(str(tmp_path), bench.parse_arm("preset=pretrained,fit=0.3"), 32, ids)
    expected = hf_alibi.fit_slopes(_llama(), ids, scale=0.3, sinks=1)  # the preset's one sink
    assert arm.options == {"preset": "pretrained", "slopes": expected}
    assert bench.fit_arm(str(tmp_path), bench.parse_arm("paper"), 32, ids).options == {}


def test_quick_run_rows_and_token_counts():
    rows = bench.main(
        ["--quick", "--arms", "original", "yarn:2", "--arm", "sinks=1,slope_scale=0.5", "--passkey_lengths"]
    )
    assert [r["arm"] for r in rows] == [
        "original",
        "yarn:2",
        "sinks=1,slope_scale=0.5",
        "sinks=1,slope_scale=0.5 +2 steps",
    ]
    windows = (512 // 32) * 32 + (512 // 64) * 64 + (512 // 128) * 128
    assert all(r["tokens"] == windows + 256 for r in rows)  # + the by-position stream
    assert rows[-1]["recover_tokens"] == 2 * 2 * 32
    assert rows[-1]["recover_lr"] == 2e-4  # an arm without a preset recovers as the paper's conversion (its rate)
    assert list(rows[0])[:4] == ["arm", "ppl@32", "ppl@64", "ppl@128"]


def test_recovery_gets_the_arms_conversion_not_recovers_default_preset():
    # recover() takes every conversion option itself (recover() would default to the preset)
    assert bench.recover_options({"sinks": 1}) == {"preset": None, "fit_slopes": False, "sinks": 1}
    assert bench.recover_options({"preset": "pretrained"}) == {"preset": "pretrained", "fit_slopes": False}
    # a fitted arm's slopes reach the recovered student (recover() passes no slopes of its own then)
    slopes = [[0.01, 0.02, 0.03, 0.04], [0.05, 0.06, 0.07, 0.08]]
    direct = bench.recover_options({"preset": "pretrained", "slopes": slopes, "sinks": 2})
    stream = torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(4))
    result = bench.recover(_llama(), stream, length=16, max_steps=1, batch_size=2, progress=False, log=None, **direct)
    saved = hf_alibi.get_settings(result.student.config)
    assert (saved.slopes, saved.sinks, saved.slope_scale) == (slopes, 2, 1.0)


def test_text_defaults_to_the_pydoc_prose_and_a_missing_file_is_one_line(tmp_path):
    from pydoc_data.topics import topics

    prose = bench.read_prose(None)
    assert prose.startswith(topics[min(topics)]) and prose.endswith(topics[max(topics)])
    assert prose.count(topics["assert"]) >= 1 and len(prose) > 400_000  # every topic, not one
    (tmp_path / "t.txt").write_text("some words")
    assert bench.read_prose(str(tmp_path / "t.txt")) == "some words"
    with pytest.raises(SystemExit, match=r"--text .*missing.txt: no such file"):
        bench.read_prose(str(tmp_path / "missing.txt"))


def test_a_yarn_conversion_arm_keeps_the_yarn_scaled_frequencies(tmp_path):
    _llama().save_pretrained(tmp_path)
    arm = bench.parse_arm("preset=pretrained,yarn=2")
    assert arm.options == {"preset": "pretrained", "yarn": 2.0}
    converted = bench.load(str(tmp_path), arm, 32)
    yarn = bench.load(str(tmp_path), bench.parse_arm("yarn:2"), 32)  # YaRN alone, the same factor
    x, positions = torch.zeros(1, 1, 8), torch.arange(32)[None]  # inside the preset's rotary knee
    with torch.no_grad():
        (cos, sin), (yarn_cos, yarn_sin) = (
            converted.model.rotary_emb(x, positions),
            yarn.model.rotary_emb(x, positions),
        )
        plain_cos, _ = _llama().model.rotary_emb(x, positions)
    kept = converted.model.rotary_emb.kept
    assert (
        kept.any()
        and torch.equal(cos[..., kept], yarn_cos[..., kept])
        and torch.equal(sin[..., kept], yarn_sin[..., kept])
    )
    assert not torch.allclose(cos[..., kept], plain_cos[..., kept])  # YaRN moved them
    with pytest.raises(SystemExit, match="measured untrained only"):
        bench.recovered(str(tmp_path), arm, 32, None, None)
