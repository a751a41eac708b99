"""save_pretrained / from_pretrained of every architecture and encoder variant, in fresh processes.

One child process reloads every checkpoint (cheap), another checks that plain transformers refuses
each one, through the Auto class and through the concrete class.
"""

import json

import pytest
import torch
from arch_cases import FULL_VARIANT_IDS as VARIANT_IDS  # the reduced cases skip persistence
from arch_cases import FULL_VARIANT_PARAMS as VARIANT_PARAMS
from arch_cases import MAX_LEN
from safetensors import safe_open
from sharing import run_python

import hf_alibi
from hf_alibi.core.config import REMOVED_FIELD_MARKER


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{variant id: checkpoint folder}, each with expected.pt (inputs, logits, base model output)."""
    root = tmp_path_factory.mktemp("alibi_checkpoints")
    folders = {}
    for (case, variant), name in zip(VARIANT_PARAMS, VARIANT_IDS):
        model = hf_alibi.patch_model(case.make(), encoder_variant=variant)
        if variant == "learned":  # slopes away from their init: a reload must read them from the weights
            for module in model.modules():
                if isinstance(module, hf_alibi.AlibiBias):
                    module.reset_parameters()
        inputs = case.inputs(2, 3 * MAX_LEN)
        with torch.no_grad():
            out = model(**inputs)
        hidden = out.encoder_last_hidden_state if case.kind == "seq2seq" else None
        if hidden is None:
            with torch.no_grad():
                hidden = model.base_model(**inputs).last_hidden_state
        path = root / name
        model.save_pretrained(path)
        torch.save({"inputs": inputs, "logits": out.logits, "hidden": hidden}, path / "expected.pt")
        folders[name] = (case, variant, path)
    return folders


@pytest.mark.parametrize("name", VARIANT_IDS)
def test_config_json_and_weights_record_the_conversion(saved, name):
    case, variant, path = saved[name]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == f"alibi_{case.model_type}"
    assert config["alibi"]["encoder_variant"] == variant
    assert config["alibi"]["base_model_type"] == case.model_type
    assert all(config[field].startswith(REMOVED_FIELD_MARKER) for field in case.removed_fields)
    # the marker names the classes that load it (not the original class)
    assert all(case.auto_class in config[field] for field in case.removed_fields), config[case.removed_fields[0]]
    with safe_open(path / "model.safetensors", "pt") as weights:
        keys = list(weights.keys())
    learned = [key for key in keys if "slopes_" in key]
    assert bool(learned) == (variant == "learned")
    if learned:  # left and right per self-attention layer
        layers = sum(1 for _ in hf_alibi.patch_model(case.make(), encoder_variant="learned").modules()
                     if isinstance(_, hf_alibi.AlibiBias) and _.kind == "learned")  # fmt: skip
        assert len(learned) == 2 * layers


def test_gpt2_config_json_holds_exactly_the_settings_and_the_row(saved):
    """One row in full: what config.json says, key for key (the others: the loop above)."""
    config = json.loads((saved["gpt2"][2] / "config.json").read_text())
    assert config["model_type"] == "alibi_gpt2"
    assert config["architectures"] == ["AlibiGPT2LMHeadModel"]
    assert config["alibi"] == {
        "base_model_type": "gpt2", "encoder_variant": None, "heads": 4, "hf_alibi_version": hf_alibi.__version__,
        "sinks": 0, "rotary_max_wavelength": None, "slope_scale": 1.0, "slopes": None,  # the paper's method
        "rotary_knee": None, "rotary_stretch": 1.0, "rotary_interpolation": 1.0, "rotary_window": None,
        "rotary_window_stretch": 1.0,
        "position_mean": 0, "table_max_wavelength": None, "table_rows": 0, "slopes_source": None,
        "architecture": {  # the row, so that the checkpoint rebuilds the same way wherever it is loaded
            "model_type": "gpt2", "strategy": "absolute", "position": ["wpe"], "attention": ["h.*.attn"],
            "removed_config_fields": ["n_positions"], "bidirectional": False, "placeholder": 1,
            "extra_classes": ["GPT2DoubleHeadsModel"],
        },
    }  # fmt: skip
    assert config["n_positions"].startswith(REMOVED_FIELD_MARKER)
    advice = "AutoModelForCausalLM.from_pretrained(path) or hf_alibi.models.AlibiGPT2LMHeadModel"
    assert advice in config["n_positions"]
    assert "_attn_implementation_internal" not in config
    assert (saved["gpt2"][2] / "model.safetensors").exists()


def test_every_checkpoint_reloads_in_a_fresh_process_with_identical_outputs(saved):
    # AutoModel (the base model from the same weights) once per architecture, the task class for all
    loaders = {name: [case.auto_class] + (["AutoModel"] if variant == case.variants[0] else [])
               for name, (case, variant, _) in saved.items()}  # fmt: skip
    checks = [(name, loaders[name], case.auto_class, case.kind, str(path)) for name, (case, _, path) in saved.items()]
    result = run_python(
        f"""
        import sys, torch, hf_alibi, transformers
        # import hf_alibi makes no model class: the first Alibi config made registers its type's classes
        modeling = [m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m]
        assert modeling == ["transformers.models.auto.modeling_auto"], modeling
        for name, loaders, auto_class, kind, path in {checks!r}:
            expected = torch.load(path + "/expected.pt")
            for loader in loaders:
                model = getattr(transformers, loader).from_pretrained(path).eval()
                assert type(model).__name__.startswith("Alibi"), type(model)
                assert hf_alibi.is_alibi(model)
                with torch.no_grad():
                    out = model(**expected["inputs"])
                if loader == auto_class:
                    same = torch.equal(out.logits, expected["logits"])
                else:
                    hidden = out.encoder_last_hidden_state if kind == "seq2seq" else out.last_hidden_state
                    same = torch.equal(hidden, expected["hidden"])
                print("OK" if same else "DIFFERENT", name, loader, model.config._attn_implementation)
        """,
        cwd=next(iter(saved.values()))[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == sum(map(len, loaders.values()))
    # transformers' default backend: sdpa, or eager where the model has no sdpa (gemma2 soft-caps)
    default = {name: "sdpa" if "sdpa" in case.backends else "eager" for name, (case, _, _) in saved.items()}
    assert all(line.startswith("OK ") and line.endswith(f" alibi_{default[line.split()[1]]}") for line in lines), (
        result.stdout
    )


def test_plain_transformers_refuses_every_checkpoint(saved):
    checks = [(name, case.auto_class, case.plain_class, str(path)) for name, (case, _, path) in saved.items()]
    result = run_python(
        f"""
        import sys, transformers
        for name, auto_class, plain_class, path in {checks!r}:
            for loader in (auto_class, plain_class):
                try:
                    model = getattr(transformers, loader).from_pretrained(path)
                except Exception as error:
                    message = str(error).replace("\\n", " ")
                    # says what to do: import hf_alibi (the marker) or trust the checkpoint's code (auto_map)
                    says_what_to_do = "import hf_alibi" in message or "trust_remote_code=True" in message
                    print("\\nREFUSED", name, loader, says_what_to_do)
                else:
                    print("\\nLOADED", name, loader, type(model).__name__)
        print("hf_alibi imported:", "hf_alibi" in sys.modules)
        """,
        cwd=next(iter(saved.values()))[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # (transformers' trust prompt may precede a line: the folders carry remote code)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("REFUSED", "LOADED", "hf_alibi"))]
    assert lines[-1] == "hf_alibi imported: False"
    assert len(lines[:-1]) == 2 * len(saved)
    assert all(line.startswith("REFUSED ") and line.endswith(" True") for line in lines[:-1]), result.stdout
