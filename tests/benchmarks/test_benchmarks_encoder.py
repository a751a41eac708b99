"""benchmarks/encoder.py: retrieval against a model whose embedding is a token histogram; --quick end to end."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its siblings like the other benchmarks
_spec = importlib.util.spec_from_file_location("bench_encoder", ROOT / "benchmarks" / "encoder.py")
bench = sys.modules["bench_encoder"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

CLS, SEP, FILLER = 1, 2, 3


class Histogram(torch.nn.Module):
    """Its last hidden state is each token's one-hot row: the mean-pooled embedding is the token histogram."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.weight = vocab, torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(is_encoder_decoder=False)

    def forward(self, input_ids, output_hidden_states=True):
        assert (input_ids[:, 0] == CLS).all() and (input_ids[:, -1] == SEP).all(), "every input is framed"
        return SimpleNamespace(hidden_states=(F.one_hot(input_ids, self.vocab).float(),))


def test_retrieval_finds_a_passage_only_in_what_the_model_reads():
    # 5 documents of 7 tokens: the same 3 filler tokens, then 4 of the document's own. Every 4-token passage
    # holds at least one of the document's own tokens.
    docs = torch.tensor([[FILLER] * 3 + [10 + i] * 4 for i in range(5)])
    model, frame = Histogram(20), ((CLS,), (SEP,))
    accuracy, tokens = bench.retrieval(model, docs, 7, 4, frame, seeds=3)
    assert accuracy == 1.0
    assert tokens == 5 * (7 + 2) + 3 * 5 * 4
    # reading the first 3 tokens, every document looks the same: every query ties, the first document wins
    accuracy, tokens = bench.retrieval(model, docs, 3, 4, frame, seeds=3)
    assert accuracy == pytest.approx(1 / 5)
    assert tokens == 5 * (3 + 2) + 3 * 5 * 4


def test_arms_parse_and_bad_options_say_what_to_use():
    assert bench.parse_arm("paper").options == {}
    assert bench.parse_arm("pretrained").options == {"preset": "pretrained"}
    arm = bench.parse_arm("preset=pretrained,position_mean=0,slope_scale=0.1")
    assert arm.options == {"preset": "pretrained", "position_mean": 0, "slope_scale": 0.1}
    assert bench.parse_arm("preset=pretrained,fit=0.3").options == {"preset": "pretrained", "fit": 0.3}
    with pytest.raises(SystemExit, match="unknown option 'rotary'"):
        bench.parse_arm("rotary=3")


def test_quick_run_rows():
    removed = "preset=pretrained,table_max_wavelength=0"  # the preset without the table's kept wavelengths
    rows = bench.main(["--quick", "--arms", "original", "pretrained", "--arm", removed])
    assert [r["arm"] for r in rows] == [
        "original",
        "pretrained",
        "pretrained +2 steps",
        "preset=pretrained,table_max_wavelength=0",
        "preset=pretrained,table_max_wavelength=0 +2 steps",
    ]
    assert rows[0]["cos@32"] == pytest.approx(1.0) and rows[0]["cos@64"] == pytest.approx(1.0)
    assert rows[0]["reads"] == 64 and all(r["reads"] == 128 for r in rows[1:])  # the original stops at its 64
    assert rows[1]["cos@64"] != rows[3]["cos@64"], "each arm is its own conversion"
    assert all(0.0 <= r["retrieval@128"] <= 1.0 for r in rows)
    assert rows[2]["recover_tokens"] == 2 * 2 * 32 and rows[2]["recover_lr"] == 1e-4  # the encoder's preset rate
