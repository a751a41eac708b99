"""``hf-alibi convert`` / ``info``: every registered architecture, the model card, bad inputs."""

import json
import re
import subprocess
import sys
import traceback

import pytest
import torch
import transformers
from huggingface_hub import ModelCard
from sharing import (
    REPO_ROOT,
    TINY_BY_TYPE,
    example_inputs,
    folder_hash,
    last_json_line,
    make_tokenizer,
    output_tensor,
    run_child,
    run_cli,
)
from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM, GPTJConfig, GPTJForCausalLM

import hf_alibi
from hf_alibi import checkpoints, cli
from hf_alibi.hub import auto_classes_for

ARCHITECTURES = sorted(TINY_BY_TYPE)  # the full cases (tests/arch_cases.py)
SUPPORTED = hf_alibi.supported_model_types()


def _convert(model_type, tmp_path_factory):
    """An unpatched tiny checkpoint with a tokenizer, as a user would have on disk, and its conversion."""
    src = tmp_path_factory.mktemp(f"src_{model_type}")
    TINY_BY_TYPE[model_type].make().save_pretrained(src)
    make_tokenizer(src)
    # a name of its own: transformers copies a local folder's code to transformers_modules/<its name>
    out = tmp_path_factory.mktemp(f"out_{model_type}") / f"alibi_{model_type}"
    before = folder_hash(src)
    assert cli.main(["convert", str(src), str(out)]) == 0
    assert folder_hash(src) == before, "convert modified SRC"
    return src, out


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    """Every model type converted once for the module: {model type: (src, out), or the traceback of its failure}."""
    done = {}
    for model_type in ARCHITECTURES:
        try:
            done[model_type] = _convert(model_type, tmp_path_factory)
        except Exception:  # that model type's tests fail with it; the others go on
            done[model_type] = traceback.format_exc()
    return done


@pytest.fixture(params=ARCHITECTURES)
def converted(request, conversions):
    model_type = request.param
    if isinstance(conversions[model_type], str):
        pytest.fail(f"converting {model_type} failed:\n{conversions[model_type]}")
    return (model_type, *conversions[model_type])


def test_convert_writes_a_complete_alibi_checkpoint(converted):
    model_type, src, out = converted
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_alibi.py", "README.md", "tokenizer.json"} <= names
    assert not any(name.endswith(".bin") for name in names)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"alibi_{model_type}"
    assert config["alibi"]["base_model_type"] == model_type
    assert set(config["auto_map"]) == {"AutoConfig", *auto_classes_for(model_type)}
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("w1 w5 w96")["input_ids"] == AutoTokenizer.from_pretrained(src)("w1 w5 w96")["input_ids"]


def test_converted_checkpoint_equals_patch_model_of_the_source(converted):
    model_type, src, out = converted
    original_class = checkpoints.model_class_for(json.loads((src / "config.json").read_text()))
    reference = hf_alibi.patch_model(original_class.from_pretrained(src)).eval()
    loaded = type(reference).from_pretrained(out).eval()
    assert type(loaded) is type(reference)
    inputs = example_inputs(model_type, reference)
    with torch.no_grad():
        assert torch.equal(output_tensor(loaded(**inputs)), output_tensor(reference(**inputs)))


def test_model_card_header_parses(converted):
    model_type, src, out = converted
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers"
    assert {"alibi", "hf_alibi", model_type} <= set(card.data.tags)
    assert card.data.base_model is None  # a local SRC is no Hub id
    settings = json.loads((out / "config.json").read_text())["alibi"]
    assert f"| `heads` | `{settings['heads']}` |" in card.text
    assert "trust_remote_code=True" in card.text


@pytest.mark.parametrize("preset", [None, "pretrained"])
def test_model_card_says_what_the_settings_mean_for_training(preset):
    """The card's note comes from the settings: the paper's conversion must be trained before use, the pretrained
    preset's runs without training (and says what it kept); the slopes listed are the ones in use."""
    from hf_alibi.hub.card import model_card

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf_alibi.patch_model(transformers.LlamaForCausalLM(config), preset=preset)
    card = model_card(model.config)
    settings = hf_alibi.get_settings(model.config)
    in_use = ", ".join(f"{m * settings.slope_scale:.6g}" for m in hf_alibi.get_slopes_list(4))
    assert f"Slopes `m_h` in use, head by head: {in_use}." in card
    assert "Converting does not train" not in card and "Note: converting does not train." in card
    if preset is None:
        assert "must be fine-tuned (or recovered" in card and "keep part of what" not in card
    else:
        assert "must be fine-tuned" not in card and "runs without training" in card
        kept = (
            "(sinks: 1; slopes: the paper's x 0.01; rotary frequencies: kept up to wavelength 16384; rotary "
            "wavelengths > 16 turn 2x slower past position 16)"
        )
        assert f"These settings keep part of what the pretrained weights learned about order {kept}" in card
    recovered = model_card(model.config, recovery="\n## Recovery\n\nsteps\n")
    assert "must be fine-tuned" not in recovered and "was recovered after conversion" in recovered
    assert recovered.rstrip().endswith("## Recovery\n\nsteps")


def test_info_reports_the_settings(converted, capsys):
    model_type, src, out = converted
    code, stdout, _ = run_cli("info", out, "--json", capsys=capsys)
    assert code == 0
    info = json.loads(stdout)
    settings = json.loads((out / "config.json").read_text())["alibi"]
    assert info["is_alibi"] is True and info["base_model_type"] == model_type
    assert (info["heads"], info["encoder_variant"]) == (settings["heads"], settings["encoder_variant"])
    assert info["slopes"] == hf_alibi.get_slopes_list(settings["heads"])
    assert info["remote_code_file"] is True and info["tokenizer"] is True

    code, stdout, _ = run_cli("info", src, "--json", capsys=capsys)
    assert code == 0
    assert json.loads(stdout) | {} == json.loads(stdout) and json.loads(stdout)["is_alibi"] is False
    assert json.loads(stdout)["convertible"] is True

    code, stdout, _ = run_cli("info", out, capsys=capsys)
    assert code == 0 and f"ALiBi checkpoint of {model_type}" in stdout


def test_console_script_is_declared_and_runs_as_a_module(gpt2_src, tmp_path):
    """The entry point, once (the per-architecture conversions above run in this process): ``hf-alibi`` (its
    entry, hf_alibi.cli.main, which parses before the library is imported) and ``python -m hf_alibi`` run a job."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[project\.scripts\]\nhf-alibi = "([^"]+)"', pyproject, re.M).group(1) == "hf_alibi.cli:main"
    out = tmp_path / "alibi"
    assert cli.main(["convert", str(gpt2_src), str(out)]) == 0
    entry = "import sys, hf_alibi.cli; sys.exit(hf_alibi.cli.main())"
    old_entry = "import sys, hf_alibi_boot; sys.exit(hf_alibi_boot.main())"  # the script of an older install
    for command in (
        [sys.executable, "-m", "hf_alibi"],
        [sys.executable, "-c", entry],
        [sys.executable, "-c", old_entry],
    ):
        result = subprocess.run([*command, "info", str(out)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "ALiBi checkpoint of" in result.stdout


def test_convert_with_encoder_variant_for_a_decoder_only_model_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    TINY_BY_TYPE["gpt2"].make().save_pretrained(src)
    code, _, err = run_cli("convert", src, tmp_path / "out", "--encoder-variant", "learned", capsys=capsys)
    assert code == 2 and "decoder-only" in err
    code, _, err = run_cli("convert", src, tmp_path / "out", "--heads", "3", capsys=capsys)
    assert code == 2 and "--heads 3 does not match SRC's 4 attention heads" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ bad inputs


def _break_config(src):
    (src / "config.json").write_text('{"model_type": "gpt2", ')


def _break_weights(src):
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])


def _no_config(src):
    (src / "config.json").unlink()


def _unsupported(src):
    for path in src.iterdir():
        path.unlink()
    GPTJForCausalLM(GPTJConfig(n_layer=1, n_embd=16, n_head=2, rotary_dim=4)).save_pretrained(src)  # no row


def _native(src):
    for path in src.iterdir():
        path.unlink()
    BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=16, n_head=2)).save_pretrained(src)  # trained with ALiBi


def _already_alibi(src):
    model = hf_alibi.patch_model(TINY_BY_TYPE["gpt2"].make())
    for path in src.iterdir():
        path.unlink()
    model.save_pretrained(src)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_break_config, "not valid JSON"),
        (_break_weights, "Could not load the model from SRC"),
        (_no_config, "has no config.json"),
        (_unsupported, "cannot convert model_type='gptj'. Supported model types: " + ", ".join(SUPPORTED)),
        (_native, "model_type='bloom' was trained with ALiBi: there is nothing to convert"),
        (_already_alibi, "already an ALiBi checkpoint"),
    ],
    ids=["corrupt-config", "corrupt-weights", "no-config", "unsupported", "native", "already-alibi"],
)
def test_bad_source_is_a_clear_error_and_nothing_is_written(gpt2_src, tmp_path, capsys, damage, message):
    damage(gpt2_src)
    before = folder_hash(gpt2_src)
    out = tmp_path / "out"
    code, _, err = run_cli("convert", gpt2_src, out, capsys=capsys)
    assert code == 2
    assert err.startswith("hf-alibi: error: ") and message in err, err
    assert not out.exists()
    assert folder_hash(gpt2_src) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no staging folder left


def test_missing_source(tmp_path, capsys):
    code, _, err = run_cli("convert", tmp_path / "nothing", tmp_path / "out", capsys=capsys)
    assert code == 2 and "is not a folder" in err
    code, _, err = run_cli("info", tmp_path / "nothing", capsys=capsys)
    assert code == 2 and "PATH" in err and "is not a folder" in err


def test_existing_out_needs_overwrite(gpt2_src, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before_src, before_out = folder_hash(gpt2_src), folder_hash(out)
    code, _, err = run_cli("convert", gpt2_src, out, capsys=capsys)
    assert code == 2 and "--overwrite" in err
    assert folder_hash(out) == before_out and folder_hash(gpt2_src) == before_src

    code, _, _ = run_cli("convert", gpt2_src, out, "--overwrite", capsys=capsys)
    assert code == 0
    assert not (out / "keep.txt").exists() and (out / "modeling_alibi.py").exists()
    assert folder_hash(gpt2_src) == before_src


@pytest.mark.parametrize("where", ["same", "inside"])
def test_out_overlapping_src_is_refused(gpt2_src, capsys, where):
    before = folder_hash(gpt2_src)
    out = gpt2_src if where == "same" else gpt2_src / "alibi"
    code, _, err = run_cli("convert", gpt2_src, out, "--overwrite", capsys=capsys)
    assert code == 2 and "never writes into SRC" in err
    assert folder_hash(gpt2_src) == before


LOAD_WITHOUT_HF_ALIBI = """
import json, os, traceback, torch, transformers
reports = {}
for model_type, (auto_name, folder, expected_file) in ROWS.items():
    try:  # a failure is this model type's report: it hides no other
        expected = torch.load(expected_file)
        model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True).eval()
        with torch.no_grad():
            out = model(**expected["inputs"])
        names = ("logits", "prediction_logits", "last_hidden_state")
        out = next(getattr(out, n) for n in names if getattr(out, n, None) is not None)
        reports[model_type] = {"module": type(model).__module__, "diff": (out - expected["out"]).abs().max().item()}
    except Exception:
        reports[model_type] = {"error": traceback.format_exc()}
print(json.dumps(reports))
"""


@pytest.fixture(scope="module")
def loaded_without_hf_alibi(conversions, tmp_path_factory):
    """One fresh process that cannot import hf_alibi loads every converted folder with the folder's own code."""
    rows, failed = {}, {}
    for model_type, conversion in conversions.items():
        if isinstance(conversion, str):
            continue  # the converted fixture reports it
        src, out = conversion
        try:
            model = checkpoints.model_class_for(json.loads((src / "config.json").read_text())).__name__
            auto_name = next(a for a, c in auto_classes_for(model_type).items() if c == model)
            reference = getattr(transformers, auto_name).from_pretrained(out).eval()  # hf_alibi's classes
            inputs = example_inputs(model_type, reference)
            expected = tmp_path_factory.mktemp(f"expected_{model_type}") / "expected.pt"
            with torch.no_grad():
                torch.save({"inputs": inputs, "out": output_tensor(reference(**inputs))}, expected)
            rows[model_type] = (auto_name, str(out), str(expected))
        except Exception:
            failed[model_type] = {"error": traceback.format_exc()}
    # the model types run one after another in the child: allow each one what a child of its own had
    code = f"ROWS = {rows!r}\n" + LOAD_WITHOUT_HF_ALIBI
    result = run_child(code, tmp_path_factory.mktemp("load"), tmp_path_factory.mktemp("hf"), block_hf_alibi=True,
                       timeout=300 * max(len(rows), 1))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return last_json_line(result.stdout) | failed


def test_converted_checkpoint_loads_without_hf_alibi(converted, loaded_without_hf_alibi):
    """The CLI's folder (converted from a checkpoint read with from_pretrained) loads with its own code."""
    model_type, src, out = converted
    report = loaded_without_hf_alibi[model_type]
    assert "error" not in report, report["error"]
    # the class comes from this folder's own copy of the code (transformers_modules.<folder>.<hash>.)
    assert report["module"].startswith(f"transformers_modules.{out.name}."), report
    assert report["module"].endswith("modeling_alibi") and report["diff"] <= 1e-5, report
