"""hf_alibi.evaluate's compare (and ``hf-alibi compare``): every figure against a reference written here (perplexity
by hand from one forward's logits), the JSON read against the printed table and the plot, and every bad input's one
line with nothing written and no model loaded. Tiny GPT-2s from configs, a byte tokenizer built in code."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_alibi
from hf_alibi.cli import main as cli_main
from hf_alibi.evaluate import by_position, compare, format_comparison, passkey_hits, passkey_prompt, position_nll
from hf_alibi.evaluate import comparison as compare_module
from hf_alibi.evaluate.passkey import QUESTION, found_key, keys, needle
from hf_alibi.evaluate.report import draw
from hf_alibi.evaluate.stream import position_bounds

NATIVE = 32
PNG = b"\x89PNG\r\n\x1a\n"
TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps by the fox. " * 30


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte, its id the byte's value (GPT-2's byte-level alphabet, no merges): nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's bytes_to_unicode: these are themselves
    others = [b for b in range(256) if b not in printable]
    vocab = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def tiny_gpt2(vocab: int = 256, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=NATIVE, vocab_size=vocab, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A tiny GPT-2 (32 learned positions), its conversion (pretrained preset), both with the byte tokenizer."""
    root = tmp_path_factory.mktemp("compare")
    model, tokenizer = tiny_gpt2(), byte_tokenizer()
    model.save_pretrained(root / "original")
    tokenizer.save_pretrained(root / "original")
    hf_alibi.patch_model(model, preset="pretrained")
    model.save_pretrained(root / "converted")
    tokenizer.save_pretrained(root / "converted")
    (root / "text.txt").write_text(TEXT)
    return {"original": root / "original", "converted": root / "converted", "text": root / "text.txt", "root": root}


def _ids() -> torch.Tensor:
    return torch.tensor(list(TEXT.encode()))  # the byte tokenizer's ids, read apart from it


def _nll_by_hand(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[target], computed here from one forward's logits."""
    with torch.no_grad():
        logits = model(input_ids=inputs[None]).logits[0].double()
    return -(logits - logits.logsumexp(-1, keepdim=True)).gather(1, targets[:, None])[:, 0]


def _reference(model, ids: torch.Tensor, length: int, stride: int | None) -> float:
    """fairseq's protocols written out: non-overlapping windows each score all their targets; a sliding window ends
    ``stride`` later than the last and scores only the targets it adds."""
    targets, losses, scored = ids.numel() - 1, [], 0
    while scored < targets:
        end = min(scored + (stride or length) if scored else length, targets)
        start = max(0, end - length) if stride else scored
        nll = _nll_by_hand(model, ids[start:end], ids[start + 1 : end + 1])
        losses.append(nll[scored - start :])
        scored = end
    return math.exp(torch.cat(losses).mean().item())


@pytest.fixture(scope="module")
def run(pair, tmp_path_factory):
    """``hf-alibi compare`` on the pair, as a user runs it; its printed table and its JSON."""
    out = tmp_path_factory.mktemp("cmp") / "out"
    argv = ["compare", str(pair["original"]), str(pair["converted"]), "--lengths", "16", "32", "64", "--protocols",
            "nonoverlapping", "sliding", "--stride", "8", "--max-tokens", "300", "--passkey-lengths", "128",
            "--text", str(pair["text"]), "--out", str(out)]  # fmt: skip
    return argv, out


def test_compare_figures_equal_references_written_here(pair, run, capsys):
    argv, out = run
    assert cli_main(argv) == 0
    table = capsys.readouterr().out
    results = json.loads((out / "compare.json").read_text())
    ids = _ids()
    span = ids[:301]
    assert results["text"]["tokens"] == ids.numel() and results["text"]["evaluated"] == 301
    original, converted = (hf_alibi.patch_model(tiny_gpt2(), preset="pretrained") if i else tiny_gpt2()
                           for i in range(2))  # fmt: skip
    for model, row in zip((original, converted), results["models"]):
        for length in (16, 32, 64):
            for protocol, stride in (("nonoverlapping", None), ("sliding", 8)):
                figures = row["perplexity"][protocol][str(length)]
                if row["name"] == str(pair["original"]) and length > NATIVE:
                    assert "32 learned positions" in figures["error"]  # its row says why, not a number
                    continue
                assert figures["perplexity"] == pytest.approx(_reference(model, span, length, stride), rel=1e-5)
    # by position: one stream of 2x the native length (64), against one forward over it (the converted model: no
    # limit; the original's stops at its 32 positions)
    stream = ids[:65]
    nll = _nll_by_hand(converted, stream[:-1], stream[1:])
    assert results["position"]["bounds"] == [0, 4, 8, 16, 32, 64]
    expected = {f"{a}-{b}": math.exp(nll[a:b].mean().item()) for a, b in [(0, 4), (4, 8), (8, 16), (16, 32), (32, 64)]}
    assert results["models"][1]["by_position"] == pytest.approx(expected, rel=1e-5)
    assert results["models"][0]["by_position"]["32-64"] is None
    assert results["models"][0]["passkey"]["128"]["error"].startswith("cannot run")
    assert [m["native"] for m in results["models"]] == [NATIVE, NATIVE]  # the conversion: its original's length
    _table_says_what_the_json_says(table, results)


def test_rope_baselines_are_rows_of_the_same_run_and_the_stream_passes_the_native_length(tmp_path):
    """``rope=["yarn:2", "linear:2"]`` (``--rope``) adds the original run with transformers' rope_parameters of each
    type at that factor, right after it, named for it: its figures equal that model's, loaded here with the
    parameters written out. The default stream reads to 2x the native length whatever ``max_tokens`` bounds the
    windows at (compare's question is what happens past the native length)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=NATIVE,
                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    for name in ("llama", "llama-alibi"):
        if name == "llama-alibi":
            hf_alibi.patch_model(model, preset="pretrained")
        model.save_pretrained(tmp_path / name)
        byte_tokenizer().save_pretrained(tmp_path / name)
    (tmp_path / "text.txt").write_text(TEXT)
    folders = [str(tmp_path / "llama"), str(tmp_path / "llama-alibi")]
    results = compare(folders, lengths=[16], max_tokens=16, passkey_lengths=(), rope=["yarn:2", "linear:2"],
                      text=tmp_path / "text.txt")  # fmt: skip
    assert [m["label"] for m in results["models"]] == ["llama", "llama yarn x2", "llama linear x2", "llama-alibi"]
    assert [m.get("rope") for m in results["models"]] == [
        None, {"rope_type": "yarn", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}, None
    ]  # fmt: skip
    assert results["position"]["tokens"] == 2 * NATIVE and results["position"]["bounds"][-1] == 2 * NATIVE
    stream = _ids()[: 2 * NATIVE + 1]
    for row, parameters in zip(results["models"][1:3], (
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE, "rope_theta": 500.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    )):  # fmt: skip
        stretched = LlamaForCausalLM.from_pretrained(folders[0], rope_parameters=parameters,
                                                     max_position_embeddings=2 * NATIVE).eval()  # fmt: skip
        nll = _nll_by_hand(stretched, stream[:-1], stream[1:])
        bounds = results["position"]["bounds"]
        expected = {f"{a}-{b}": math.exp(nll[a:b].mean().item()) for a, b in zip(bounds, bounds[1:])}
        assert row["by_position"] == pytest.approx(expected, rel=1e-5)
    assert results["models"][1]["by_position"] != results["models"][2]["by_position"]
    assert "yarn x2" in format_comparison(results)


def _table_says_what_the_json_says(table: str, results: dict) -> None:
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines() if line.startswith(("ppl", "passkey"))}
    first, second = results["models"]
    for protocol in ("nonoverlapping", "sliding"):
        for length in (16, 32, 64):
            cells = lines[f"ppl@{length} {protocol}"].split()[2:]
            a, b = (m["perplexity"][protocol][str(length)].get("perplexity") for m in (first, second))
            assert cells[0] == (f"{a:.3f}" if a else "n/a") and cells[1] == f"{b:.3f}"
            assert cells[2:] == ([f"{b / a:.3f}"] if a else [])
    for name, value in second["by_position"].items():
        assert f"{value:.3f}" in lines[f"ppl positions {name}"]
    assert lines["passkey@128"].split()[1:] == ["n/a", f"{second['passkey']['128']['hits']}/3"]
    assert "n/a: original at 64: cannot run: length 64 > the model's 32 learned positions" in table


def test_the_plot_is_a_png_and_draws_the_jsons_figures(run, capsys):
    argv, out = run
    if not (out / "compare.json").exists():
        assert cli_main(argv) == 0
    assert (out / "compare.png").read_bytes()[:8] == PNG
    from PIL import Image

    with Image.open(out / "compare.png") as image:
        assert image.format == "PNG" and image.size[0] > image.size[1] > 100
    results = json.loads((out / "compare.json").read_text())
    figure = draw(results)
    by_length, by_pos = figure.axes[:2]
    lines = {line.get_label(): line for line in by_length.get_lines()}
    row = results["models"][1]["perplexity"]["sliding"]
    assert list(lines["converted (sliding)"].get_ydata()) == [row[str(n)]["perplexity"] for n in (16, 32, 64)]
    assert list(lines["original (nonoverlapping)"].get_xdata()) == [16, 32]  # 64: not run, not drawn
    natives = [line.get_xdata()[0] for line in by_length.get_lines() if line.get_linestyle() == ":"]
    assert natives == [NATIVE, NATIVE]
    position = {line.get_label(): line for line in by_pos.get_lines()}
    assert list(position["converted"].get_ydata()) == list(results["models"][1]["by_position"].values())


@pytest.mark.parametrize("convert", [None, {}, {"preset": "pretrained"}], ids=["rope", "paper", "preset"])
def test_the_chunked_stream_through_the_cache_equals_one_forward(convert):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    if convert is not None:
        hf_alibi.patch_model(model, **convert)
    ids = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(1))
    chunked = position_nll(model, ids, chunk=16)  # 16 + 16 + 16 + 16 + 5, past the native 32
    torch.testing.assert_close(chunked, _nll_by_hand(model, ids[:-1], ids[1:]), atol=1e-4, rtol=1e-4)


def test_a_learned_table_stops_the_stream_at_its_limit():
    model, ids = tiny_gpt2(), torch.arange(50) % 256
    nll = position_nll(model, ids, chunk=8, limit=NATIVE)
    assert torch.isnan(nll[NATIVE:]).all() and not torch.isnan(nll[:NATIVE]).any()
    torch.testing.assert_close(nll[:NATIVE], _nll_by_hand(model, ids[:NATIVE], ids[1 : NATIVE + 1]))


def test_by_position_takes_each_range_mean_and_none_where_nothing_was_scored():
    nll = torch.tensor([0.0] * 4 + [1.0] * 4 + [2.0, 4.0] * 6 + [math.nan] * 4, dtype=torch.float64)  # 24
    out = by_position(nll, [0, 4, 8, 16, 32, 64])
    assert out == pytest.approx({"0-4": 1.0, "4-8": math.e, "8-16": math.exp(3.0), "16-32": math.exp(3.0),
                                 "32-64": None})  # fmt: skip
    assert position_bounds(8192) == [0, 1024, 2048, 4096, 8192, 16384]
    assert position_bounds(128, 64) == [0, 16, 32, 64]


@pytest.mark.parametrize("depth", [0.0, 0.5, 0.9])
def test_the_passkey_prompt_has_its_length_and_the_key_at_its_depth(depth):
    encode = lambda s: list(s.encode())  # noqa: E731
    prompt = bytes(passkey_prompt(encode, 400, depth, 12345)).decode()
    assert len(prompt) == 400 and prompt.endswith("What is the pass key? The pass key is")
    body = 400 - len(" The pass key is 12345. Remember it. 12345 is the pass key. ") - len(QUESTION)
    assert prompt.index(" The pass key is 12345.") == int(body * depth)
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(encode, 50, depth, 12345)


class _Reader(torch.nn.Module):
    """A stand-in model that answers ``offset`` + the key its prompt holds (0: a perfect reader), as bytes."""

    def __init__(self, offset: int):
        super().__init__()
        self.weight, self.offset = torch.nn.Parameter(torch.zeros(1)), offset
        self.config = SimpleNamespace(pad_token_id=0)

    def generate(self, x, **kwargs):
        key = int(re.search(r"pass key is (\d{5})", bytes(x[0].tolist()).decode()).group(1)) + self.offset
        return torch.cat([x, torch.tensor([list(f" {key}.".encode())])], 1)


def test_passkey_hits_count_the_answers_that_name_the_key():
    encode, decode = (lambda s: list(s.encode())), (lambda ids: bytes(ids).decode())
    assert passkey_hits(_Reader(0), encode, decode, 300) == (3, 3)
    assert passkey_hits(_Reader(1), encode, decode, 300) == (0, 3)
    assert len(set(keys(300, (0.1, 0.5, 0.9)))) == 3 and needle(12345).count("12345") == 2
    assert found_key(" 1 2 3 4 5 and 67890") == "12345" and found_key("no digits") is None


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(compare_module, "_load", refuse)


def _one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        cli_main(argv)
    assert exit.value.code == 2
    captured = capsys.readouterr()
    # transformers may log what it reads (TRANSFORMERS_VERBOSITY=info): the error is the one line in the CLI's form
    lines = [line for line in captured.err.splitlines() if line.startswith("hf-alibi: ")]
    assert len(lines) == 1 and lines[0].startswith("hf-alibi: error: ") and "Traceback" not in captured.err
    assert captured.out == ""
    return lines[0]


def test_every_bad_input_is_one_line_before_any_model_loads_and_writes_nothing(pair, tmp_path, capsys, no_model_loads):
    bert = tmp_path / "bert"
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=8,
                               vocab_size=256)).save_pretrained(bert)  # fmt: skip
    byte_tokenizer().save_pretrained(bert)
    wide = tmp_path / "wide"
    tiny_gpt2(vocab=300).save_pretrained(wide)
    other = tmp_path / "other"  # the same vocabulary size, another tokenizer
    tiny_gpt2().save_pretrained(other)
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, 256)}}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(other)
    short = tmp_path / "short.txt"
    short.write_text("Too short. " * 5)  # 55 bytes
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "compare.json").write_text("a user's results")
    orig, conv, text = str(pair["original"]), str(pair["converted"]), str(pair["text"])
    out = tmp_path / "out"
    defaults = {"--text": [text], "--out": [str(out)], "--lengths": ["16"], "--passkey-lengths": []}
    cases = [
        ([orig, str(bert)], "is not a causal LM (config.json: BertForMaskedLM)"),
        ([orig, str(wide)], "vocabularies differ (vocab_size:"),
        ([orig, str(other)], f"the tokenizers of {str(other)!r} differ from {orig!r}'s"),
        (
            [orig, conv, "--text", str(short), "--position-tokens", "64"],
            f"the text ({short}) has 55 tokens; the position stream of 64 tokens",
        ),
        ([orig, conv, "--rope", "yarn:1"], "--rope 'yarn:1': give TYPE:FACTOR with TYPE one of yarn, linear, dynamic"),
        ([orig, conv, "--rope", "ntk"], "--rope 'ntk': give TYPE:FACTOR"),
        ([orig, conv, "--rope", "yarn:2"], f"but {orig!r} is not a rotary original"),
        ([orig, conv, "--lengths", "64", "--max-tokens", "32"], "--lengths 64 is longer than --max-tokens 32"),
        ([orig, conv, "--text", str(tmp_path / "none.txt")], "none.txt' is not a file"),
        ([orig, conv, "--out", str(taken)], "already holds compare.json: pass --overwrite"),
        ([orig, str(tmp_path / "missing")], "is not a folder"),
        ([orig, "--passkey-lengths", "20"], "--passkey-lengths 20 is too short for the passkey prompt"),
    ]
    if not torch.cuda.is_available():
        cases.append(([orig, "--device", "cuda"], "--device cuda: torch sees no CUDA device here"))
    capsys.readouterr()  # the saves' own progress bars
    for argv, message in cases:
        given = [*argv, *(word for flag, value in defaults.items() if flag not in argv for word in (flag, *value))]
        line = _one_line_error(["compare", *given], capsys)
        assert message in line, (argv, line)
        assert not out.exists(), argv
    short_text = _one_line_error(["compare", orig, "--text", str(short), "--lengths", "64", "--out", str(out)], capsys)
    assert "has 55 tokens; the longest length 64 needs 65: give a longer text" in short_text
    assert (taken / "compare.json").read_text() == "a user's results" and not out.exists()


def test_the_library_refuses_what_the_command_line_does(pair, tmp_path, no_model_loads):
    with pytest.raises(compare_module.CompareError, match="--lengths 64 is longer than --max-tokens 32"):
        compare([pair["original"]], lengths=[64], max_tokens=32, text=pair["text"], out=tmp_path / "o")
    with pytest.raises(compare_module.CompareError, match="choose from nonoverlapping, sliding"):
        compare([pair["original"]], protocols=["strided"], text=pair["text"])
    assert not (tmp_path / "o").exists()


def test_the_table_names_the_first_model_as_the_ratios_base(pair, tmp_path):
    results = compare([pair["converted"], pair["original"]], lengths=[16], max_tokens=64, position_tokens=0,
                      passkey_lengths=[], text=pair["text"])  # fmt: skip
    table = format_comparison(results)
    head, row = table.splitlines()[:2]
    assert head.split() == ["measure", "converted", "original", "ratio"]
    a, b = (m["perplexity"]["nonoverlapping"]["16"]["perplexity"] for m in results["models"])
    assert row.split() == ["ppl@16", "nonoverlapping", f"{a:.3f}", f"{b:.3f}", f"{b / a:.3f}"]
    assert "by_position" not in results["models"][0] and results["position"]["bounds"] == []


def test_the_text_comes_from_a_file_a_datasets_name_or_the_embedded_corpus(tmp_path):
    from hf_alibi.evaluate.comparison import read_text
    from hf_alibi.train.data import embedded_corpus

    (tmp_path / "notes.txt").write_text("some notes")
    assert read_text(tmp_path / "notes.txt") == "some notes"
    data = tmp_path / "data"
    data.mkdir()  # a local dataset folder, as datasets.load_dataset reads one: a split per file
    (data / "validation.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("one", "two")))
    assert read_text(dataset=str(data)) == "one\n\ntwo"
    with pytest.raises(compare_module.CompareError, match="has no 'text' column"):
        (data / "validation.jsonl").write_text(json.dumps({"words": "x"}) + "\n")
        read_text(dataset=str(data))
    assert read_text() == "".join(embedded_corpus()["validation"]["text"])


def test_each_models_native_length_comes_from_its_config_its_training_or_its_original(pair, tmp_path):
    from hf_alibi.evaluate.comparison import model_lengths

    original = json.loads((pair["original"] / "config.json").read_text())
    converted = json.loads((pair["converted"] / "config.json").read_text())
    trained = tmp_path / "trained"  # a run_clm.py --alibi output: its training length in eval_results.json
    trained.mkdir()
    (trained / "eval_results.json").write_text(json.dumps({"train_length": 128}))
    facts = model_lengths({"o": original, "c": converted, "t": converted}, {"t": str(trained)})
    assert facts["o"] == {"native": NATIVE, "limit": NATIVE, "alibi": False}
    assert facts["c"] == {"native": NATIVE, "limit": None, "alibi": True}  # its original's, among the models
    assert facts["t"]["native"] == 128
    assert model_lengths({"c": converted}, {})["c"]["native"] is None  # no original given: not marked
