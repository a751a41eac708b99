"""scripts/run_clm.py end to end: a few steps, then evaluation at every requested length."""

import json
import os
import shutil
import subprocess
import sys
from itertools import chain
from pathlib import Path

import pytest
import torch
from sharing import free_port
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_alibi
from hf_alibi.evaluate import evaluate_perplexity

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "run_clm.py")
TINY = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=32,n_head=4,n_positions=16"]
COMMON = ["--per_device_train_batch_size", "4", "--max_steps", "3", "--report_to", "none", "--seed", "0"]
COMMON += ["--tokenizer_vocab_size", "512", "--save_strategy", "no", "--eval_lengths_batch_size", "8"]


def _env(cache):
    return dict(os.environ, HF_ALIBI_CACHE=str(cache), HF_DATASETS_CACHE=str(cache / "datasets"))


def _run(args, cache, launcher=(sys.executable,), stderr: list | None = None):
    """The script's stdout (its stderr appended to ``stderr`` when given); fails on a non-zero exit."""
    result = subprocess.run([*launcher, *args], capture_output=True, text=True, env=_env(cache), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if stderr is not None:
        stderr.append(result.stderr)
    return result.stdout


def _check_results(output_dir, lengths, tokens, splits):
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["lengths"] == lengths and results["alibi"] is True
    assert sorted(results["splits"]) == sorted(splits)
    for split in splits:
        for protocol in ("nonoverlapping", "sliding"):
            figures = results["splits"][split][protocol]
            assert sorted(figures, key=int) == [str(n) for n in lengths]
            for n in lengths:
                assert figures[str(n)]["tokens"] == tokens - 1  # every target once, at every length
                assert 1 < figures[str(n)]["perplexity"] < 1e6
    assert (output_dir / "ppl_vs_length.png").read_bytes()[:4] == b"\x89PNG"
    return results


def _reevaluate(output_dir, split_text, tokens, length, stride):
    """The saved checkpoint, reloaded and evaluated in this process: the figures the script wrote."""
    model = AutoModelForCausalLM.from_pretrained(str(output_dir)).eval()
    assert hf_alibi.is_alibi(model)
    tokenizer = AutoTokenizer.from_pretrained(str(output_dir))
    ids = torch.tensor(list(chain(*tokenizer(split_text)["input_ids"])))[:tokens]
    return evaluate_perplexity(model, ids, length, stride)


def test_run_clm_alibi_embedded_corpus(tmp_path):
    out = tmp_path / "out"
    lengths = [32, 64, 128]  # training at 32 (block 64, s = 0.5), n_positions 16 is no limit
    stderr = []
    stdout = _run(
        [SCRIPT, *TINY, "--alibi", "--alibi_heads", "4", *COMMON, "--block_size", "64", "--do_train"]
        + ["--train_sequence_length_scaling", "0.5", "--use_cpu", "--output_dir", str(out)]
        + ["--eval_lengths", "32,64,128", "--max_eval_tokens", "600", "--export_gguf", "f32"]
        + ["--disable_tqdm", "true"],
        tmp_path / "cache",
        stderr=stderr,
    )
    assert "Perplexity against evaluation length" in stdout and "nonoverlapping" in stdout
    # --disable_tqdm true: no progress bar at all (a bar redraws with \r and counts it/s), and no loss_type warning
    printed = stdout + stderr[0]
    assert "it/s]" not in printed and "\r" not in printed and "loss_type" not in printed, printed[-2000:]
    results = _check_results(out, lengths, 600, ["validation", "test"])
    assert results["train_length"] == 32 and results["world_size"] == 1
    assert json.loads((out / "config.json").read_text())["model_type"] == "alibi_gpt2"
    from hf_alibi.train.data import embedded_corpus

    text = list(embedded_corpus(tmp_path / "cache")["validation"]["text"])
    again = _reevaluate(out, text, 600, 128, 64)
    assert again["perplexity"] == pytest.approx(results["splits"]["validation"]["sliding"]["128"]["perplexity"], 1e-5)
    _check_gguf(out, "\n".join(text)[:4000])


def _check_gguf(out, text):
    """--export_gguf: the trained model and the embedded tokenizer in llama.cpp give the saved model's ids and logits
    at 4x the training length."""
    assert (out / "model-f32.gguf").read_bytes()[:4] == b"GGUF"
    llama_cpp = pytest.importorskip("llama_cpp")
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    llm = llama_cpp.Llama(
        model_path=str(out / "model-f32.gguf"), n_ctx=128, logits_all=True, verbose=False, n_threads=1,
        type_k=0, type_v=0, flash_attn=False,
    )  # fmt: skip
    ids = tokenizer(text)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids and len(ids) >= 128
    llm.eval(ids[:128])
    with torch.no_grad():
        expected = model(torch.tensor([ids[:128]])).logits[0]
    # llama.cpp's CPU GELU (mpt) reads an fp16 table: tests/export/test_gguf.py
    torch.testing.assert_close(torch.tensor(llm.scores[:128]), expected, rtol=0, atol=3e-4)


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not installed")
def test_run_clm_two_processes_ddp(tmp_path):
    # local text files keep it fast; two ranks share the windows of the evaluation and sum them
    stdlib = Path(os.__file__).parent
    (tmp_path / "train.txt").write_text((stdlib / "argparse.py").read_text() + (stdlib / "typing.py").read_text())
    validation = (stdlib / "textwrap.py").read_text()
    (tmp_path / "validation.txt").write_text(validation)
    out = tmp_path / "out"
    # accelerate 1.15: `--cpu --num_processes 2` runs ONE process (its multi-CPU path is mpirun); on a
    # machine without GPUs `--multi_gpu` launches torchrun ranks that use gloo on the CPU.
    launcher = ("accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1")
    launcher += ("--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()))
    _run(
        [SCRIPT, *TINY, "--alibi", *COMMON, "--block_size", "32", "--do_train", "--use_cpu", "--output_dir", str(out)]
        + ["--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "validation.txt")]
        + ["--eval_lengths", "32,64,128", "--eval_stride", "16", "--max_eval_tokens", "500"],
        tmp_path / "cache",
        launcher,
    )
    results = _check_results(out, [32, 64, 128], 500, ["validation"])
    assert results["world_size"] == 2
    # the text loader splits lines and keeps line breaks: the same text, tokenized line by line
    lines = validation.splitlines(keepends=True)
    for length in (32, 128):
        again = _reevaluate(out, lines, 500, length, 16)
        got = results["splits"]["validation"]["sliding"][str(length)]["perplexity"]
        assert again["perplexity"] == pytest.approx(got, rel=1e-5)
