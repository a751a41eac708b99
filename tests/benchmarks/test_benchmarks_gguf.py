"""benchmarks/gguf_export.py: its perplexity against a float64 log-softmax written here; end to end on a tiny converted
Llama, llama.cpp's F32 perplexity equal to transformers' (needs llama_cpp: skipped without it)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from arch_cases import CASES

import hf_alibi
from hf_alibi.train.data import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gguf", ROOT / "benchmarks" / "gguf_export.py")
bench = sys.modules["bench_gguf"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_nll_is_the_summed_next_token_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 11, generator=generator, dtype=torch.float64) * 5
    window = torch.randint(0, 11, (9,), generator=generator).tolist()
    expected = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="sum")
    value, count = bench.nll(logits.float().numpy(), window)
    assert count == 8 and value == pytest.approx(expected.item(), rel=1e-6)
    assert bench.windows(list(range(10)), 4, 5) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_llama_cpp_f32_perplexity_equals_transformers(tmp_path):
    pytest.importorskip("llama_cpp")
    text = "def add(x, y):\n    return x + y  # the sum of two numbers, as code\n" * 40
    tokenizer = train_tokenizer([text], vocab_size=300)
    case = next(c for c in CASES if c.name == "llama")
    model = hf_alibi.patch_model(case.make(vocab_size=len(tokenizer)))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text(text)
    args = ["--model", str(tmp_path / "model"), "--text", str(tmp_path / "text.txt"), "--trained", "16"]
    args += ["--lengths", "16", "64", "--tokens", "256", "--outtypes", "f32", "--repeats", "1", "--new-tokens", "4"]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gguf_export.py"), *args], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \(\dx\) \| ([\d.]+) \| ([\d.]+) \(([\d.]+)\) \|$", result.stdout, re.M)
    assert [row[0] for row in rows] == ["16", "64"], result.stdout
    for _, reference, found, ratio in rows:
        assert float(found) == pytest.approx(float(reference), rel=1e-4) and abs(float(ratio) - 1) < 1e-4
    assert np.isfinite(float(re.search(r"interleaved \| (\d+) \|", result.stdout).group(1)))
