"""save_pretrained / from_pretrained in fresh processes, with and without hf_alibi."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import random_ids, tiny_gpt2

import hf_alibi
from hf_alibi.core.config import REMOVED_FIELD_MARKER


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,  # transformers asks on stdin whether to trust the checkpoint's remote code
    )  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("alibi_gpt2")
    model = hf_alibi.patch_model(tiny_gpt2())
    ids = random_ids(2, 40)
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(path)
    torch.save({"ids": ids, "logits": logits}, path / "expected.pt")
    return path


def test_config_json_records_the_settings(saved):
    config = json.loads((saved / "config.json").read_text())
    assert config["model_type"] == "alibi_gpt2"
    assert config["architectures"] == ["AlibiGPT2LMHeadModel"]
    assert config["alibi"] == {
        "base_model_type": "gpt2", "encoder_variant": None, "heads": 4, "hf_alibi_version": hf_alibi.__version__,
        "architecture": {  # the row, so that the checkpoint rebuilds the same way wherever it is loaded
            "model_type": "gpt2", "strategy": "absolute", "position": ["wpe"], "attention": ["h.*.attn"],
            "removed_config_fields": ["n_positions"], "bidirectional": False, "placeholder": 1,
            "extra_classes": ["GPT2DoubleHeadsModel"],
        },
    }  # fmt: skip
    assert config["n_positions"].startswith(REMOVED_FIELD_MARKER)
    assert "AutoModelForCausalLM.from_pretrained or hf_alibi.models.AlibiGPT2LMHeadModel" in config["n_positions"]
    assert "_attn_implementation_internal" not in config
    assert (saved / "model.safetensors").exists()


@pytest.mark.parametrize("auto_class", ["AutoModelForCausalLM", "AutoModel"])
def test_reload_in_fresh_process_gives_identical_outputs(saved, auto_class):
    result = run_python(
        f"""
        import torch, hf_alibi, transformers
        expected = torch.load("expected.pt")
        model = transformers.{auto_class}.from_pretrained(".").eval()
        assert type(model).__name__.startswith("Alibi"), type(model)
        with torch.no_grad():
            out = model(expected["ids"])
        if "{auto_class}" == "AutoModelForCausalLM":
            assert torch.equal(out.logits, expected["logits"]), (out.logits - expected["logits"]).abs().max()
        else:
            hidden = out.last_hidden_state
            assert hidden.shape == (2, 40, 32) and torch.isfinite(hidden).all()
        print("OK", model.config._attn_implementation)
        """,
        cwd=saved,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK alibi_sdpa" in result.stdout


@pytest.mark.parametrize(
    "loader", ["AutoModelForCausalLM.from_pretrained('.')", "GPT2LMHeadModel.from_pretrained('.')"]
)
def test_plain_transformers_never_loads_it_as_gpt2(saved, loader):
    result = run_python(
        f"""
        import sys
        from transformers import AutoModelForCausalLM, GPT2LMHeadModel
        try:
            model = {loader}
        except Exception as error:
            print("REFUSED", type(error).__name__, error)
            sys.exit(0)
        print("LOADED", type(model).__name__)
        """,
        cwd=saved,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # (transformers' trust prompt may come first on stdout: the folder has remote code since issue 5)
    assert "REFUSED" in result.stdout and "LOADED" not in result.stdout, result.stdout
    # it says what to do: `import hf_alibi` (the marker), or trust_remote_code=True (the auto_map)
    assert "import hf_alibi" in result.stdout or "trust_remote_code=True" in result.stdout, result.stdout


def test_child_did_not_import_hf_alibi(saved):
    result = run_python(
        """
        import sys
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained('.')
        except ValueError:
            pass
        print("hf_alibi" in sys.modules)
        """,
        cwd=saved,
    )
    assert result.stdout.strip().splitlines()[-1].endswith("False"), result.stderr[-2000:]
