"""Train short (sequence-length scaling), test long (evaluation at many lengths), the embedded corpus."""

import math

import pytest
import torch
from tiny import VOCAB, random_ids, tiny_gpt2

import hf_alibi
from hf_alibi.evaluate import evaluate_lengths, evaluate_perplexity, format_table, plot_results, score_windows
from hf_alibi.train.data import SPLITS, build_corpus_files, embedded_corpus, split_of, stdlib_files
from hf_alibi.train.length_scaling import SequenceLengthScalingCollator, scale_sequence_length

# ---------------------------------------------------------------- sequence-length scaling


def _batch(b, n):
    ids = torch.arange(b * n).view(b, n)
    return {"input_ids": ids, "labels": ids + 1000, "attention_mask": torch.ones(b, n, dtype=torch.long)}


def test_scaling_quarter_cuts_each_row_into_consecutive_pieces():
    out = scale_sequence_length(_batch(2, 8), 0.25)
    expected = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]])
    assert torch.equal(out["input_ids"], expected)
    assert torch.equal(out["labels"], expected + 1000)
    assert out["attention_mask"].shape == (8, 2)


def test_scaling_two_joins_consecutive_rows():
    out = scale_sequence_length(_batch(4, 3), 2)
    assert torch.equal(out["input_ids"], torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]))
    assert torch.equal(out["labels"], out["input_ids"] + 1000)


def test_scaling_one_is_a_no_op():
    batch = _batch(3, 5)
    assert scale_sequence_length(batch, 1) is batch
    assert scale_sequence_length(batch, 1.0) is batch


@pytest.mark.parametrize("s", [0, -0.5, float("nan"), "0.25", True, 0.3, 3])
def test_scaling_rejects_bad_values(s):
    with pytest.raises(ValueError, match="train_sequence_length_scaling"):
        scale_sequence_length(_batch(4, 8), s)


def test_scaling_collator_wraps_default_collator():
    collator = SequenceLengthScalingCollator(0.5)
    rows = [list(range(i * 4, i * 4 + 4)) for i in range(2)]
    features = [{"input_ids": row, "labels": row} for row in rows]
    out = collator(features)
    assert out["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="> 0"):
        SequenceLengthScalingCollator(0)


# ---------------------------------------------------------------- evaluation windows


def test_windows_match_hand_written_spans():
    # 11 tokens -> targets t1..t10; L = 4
    assert score_windows(11, 4) == [(0, 4, 0), (4, 8, 4), (8, 10, 8)]
    # stride 2: the first window scores t1..t4, then each window scores its last 2 targets
    assert score_windows(11, 4, 2) == [(0, 4, 0), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert score_windows(11, 4, 3) == [(0, 4, 0), (3, 7, 4), (6, 10, 7)]
    with pytest.raises(ValueError, match="stride"):
        score_windows(11, 4, 5)


def _reference_nll(model, ids, contexts):
    """Sum over targets j of -log p(t_j | ids[c_j:j]), each target run on its own context."""
    total = 0.0
    with torch.no_grad():
        for j, start in contexts.items():
            logits = model(ids[start:j][None]).logits[0, -1].double()
            total -= torch.log_softmax(logits, -1)[ids[j]].item()
    return total


@pytest.mark.parametrize(
    "stride, contexts",
    [
        # non-overlapping, L = 4: targets 1-4 see t0.., 5-8 see t4.., 9-10 see t8..
        (None, {1: 0, 2: 0, 3: 0, 4: 0, 5: 4, 6: 4, 7: 4, 8: 4, 9: 8, 10: 8}),
        # sliding, L = 4, stride 2: windows [0,4) [2,6) [4,8) [6,10)
        (2, {1: 0, 2: 0, 3: 0, 4: 0, 5: 2, 6: 2, 7: 4, 8: 4, 9: 6, 10: 6}),
        # sliding, stride 1: every target past the first window has exactly L = 4 tokens of context
        (1, {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 2, 7: 3, 8: 4, 9: 5, 10: 6}),
    ],
)
@pytest.mark.parametrize("alibi", [True, False])
def test_perplexity_equals_hand_computed_loss(stride, contexts, alibi):
    model = tiny_gpt2(attn_implementation="eager")
    if alibi:
        hf_alibi.patch_model(model)
    ids = random_ids(1, 11, seed=3)[0]
    expected = _reference_nll(model, ids, contexts)
    for batch_size in (1, 3):
        got = evaluate_perplexity(model, ids, 4, stride, batch_size=batch_size)
        assert got["tokens"] == 10  # every target t1..t10 exactly once
        assert got["loss"] == pytest.approx(expected / 10, rel=1e-5)
        assert got["perplexity"] == pytest.approx(math.exp(expected / 10), rel=1e-5)


def test_evaluate_lengths_reports_what_cannot_run(tmp_path):
    ids = random_ids(1, 70, seed=4)[0]
    plain = tiny_gpt2()  # n_positions = 16
    alibi = hf_alibi.patch_model(tiny_gpt2())
    plain_results = evaluate_lengths(plain, {"validation": ids}, [8, 16, 32], stride=4)
    alibi_results = evaluate_lengths(alibi, {"validation": ids}, [8, 16, 32], stride=4)
    for protocol in ("nonoverlapping", "sliding"):
        assert "cannot run" in plain_results["splits"]["validation"][protocol]["32"]["error"]
        for n in ("8", "16", "32"):
            assert alibi_results["splits"]["validation"][protocol][n]["tokens"] == 69
        # at 16 the unpatched model runs; same figures as a direct call
        direct = evaluate_perplexity(plain, ids, 16, None if protocol == "nonoverlapping" else 4)
        assert plain_results["splits"]["validation"][protocol]["16"]["loss"] == pytest.approx(direct["loss"], rel=1e-6)
    table = format_table(plain_results)
    assert "n/a" in table and "learned positions" in table
    png = plot_results(alibi_results, str(tmp_path / "plot.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_format_table_prints_three_decimals():
    """What the main job prints, and docs/training.md copies: perplexity and ratio, each to 3 decimals, the
    ratio taken from the unrounded perplexities."""
    figures = {"128": {"perplexity": 181.8249}, "256": {"perplexity": 176.78449}}
    sliding = {"128": {"perplexity": 108.76449}, "256": {"perplexity": 108.7661}}
    results = {
        "lengths": [128, 256],
        "stride": None,
        "splits": {"validation": {"tokens": 8192, "nonoverlapping": figures, "sliding": sliding}},
    }
    rows = format_table(results).splitlines()
    assert rows[0] == "validation (8192 tokens)"
    cells = [[c.strip() for c in row.split("|")] for row in rows[2:4]]
    # by hand: 176.78449 / 181.8249 = 0.97228...; 108.7661 / 108.76449 = 1.0000148
    assert cells[0] == ["128", "181.825", "1.000", "108.764", "1.000"]
    assert cells[1] == ["256", "176.784", "0.972", "108.766", "1.000"]
    assert rows[-1] == "ratio = ppl(length) / ppl(128); sliding stride = length // 2"


def test_loss_is_near_uniform_for_untrained_model():
    # sanity anchor independent of the windows: an untrained tiny model is close to uniform
    model = hf_alibi.patch_model(tiny_gpt2())
    got = evaluate_perplexity(model, random_ids(1, 200, seed=5)[0], 32)
    assert abs(got["loss"] - math.log(VOCAB)) < 0.3


# ---------------------------------------------------------------- embedded corpus


def _fake_stdlib(root):
    for name in ["a.py", "b.py", "pkg/c.py", "pkg/d.py", "test/e.py", "site-packages/f.py", "pkg/tests/g.py"]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\nx = {len(name)}\n")
    (root / "bad.py").write_bytes(b"\xff\xfe not utf-8 \x81")
    for i in range(40):
        (root / f"m{i}.py").write_text(f"value_{i} = {i}\n")


def test_corpus_is_deterministic_and_splits_are_disjoint(tmp_path):
    root = tmp_path / "lib"
    _fake_stdlib(root)
    files = stdlib_files(root)
    assert "test/e.py" not in files and "site-packages/f.py" not in files and "pkg/tests/g.py" not in files
    first = build_corpus_files(tmp_path / "c1", root)
    second = build_corpus_files(tmp_path / "c2", root)
    for split in SPLITS:
        assert first[split].read_bytes() == second[split].read_bytes()
    corpus = embedded_corpus(tmp_path / "c1", root)
    seen = {split: list(corpus[split]["path"]) for split in SPLITS}
    assert all(split_of(path) == split for split in SPLITS for path in seen[split])
    everything = [p for split in SPLITS for p in seen[split]]
    assert len(everything) == len(set(everything))  # disjoint
    assert sorted(everything) == [f for f in files if f != "bad.py"]  # complete, undecodable file skipped
    assert all(seen[split] for split in SPLITS)  # 45 files: every split gets some
    text = dict(zip(corpus["train"]["path"], corpus["train"]["text"]))
    assert all(text[p] == (root / p).read_text() for p in text)
