"""The checkpoint's own code (``trust_remote_code=True``) rebuilds the same ALiBi model without hf_alibi."""

import ast
import json

import pytest
import torch
from sharing import TINY, TINY_BY_TYPE, example_inputs, last_json_line, output_tensor, run_child
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.hub import REMOTE_CODE_FILE, auto_classes_for
from hf_alibi.remote import modeling_alibi

ARCHITECTURES = sorted(TINY_BY_TYPE)


def test_every_registered_architecture_has_remote_code_and_tests():
    assert sorted(hf_alibi.supported_model_types()) == ARCHITECTURES
    assert sorted(modeling_alibi.CONVERTERS) == ARCHITECTURES
    for model_type in ARCHITECTURES:
        # the same config fields are removed by hf_alibi and by the remote code
        assert modeling_alibi.CONVERTERS[model_type][1] == hf_alibi.get_spec(model_type).removed_config_fields


def test_remote_code_imports_only_torch_and_transformers():
    tree = ast.parse(REMOTE_CODE_FILE.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports would need more files in the checkpoint"
            modules.add(node.module.split(".")[0])
    assert modules == {"__future__", "copy", "math", "torch", "transformers"}


def test_remote_slopes_and_bias_equal_hf_alibis():
    for heads in (1, 4, 6, 8, 12, 16):
        assert torch.equal(modeling_alibi.get_slopes(heads), hf_alibi.get_slopes(heads))
    slopes = hf_alibi.get_slopes(6)
    left, right = -torch.rand(6), -torch.rand(6)
    for kind in ("causal", "symmetric", "nonsymmetric"):
        for q_len, kv_len in ((7, 7), (1, 9), (3, 9)):
            assert torch.equal(
                modeling_alibi.alibi_bias(kind, q_len, kv_len, slopes),
                hf_alibi.alibi_bias(kind, q_len, kv_len, slopes),
            )
    assert torch.equal(
        modeling_alibi.alibi_bias("learned", 5, 5, left, right),
        hf_alibi.alibi_bias("learned", 5, 5, left, slopes_right=right),
    )


def _variant_dir(variant) -> str:
    return variant or "causal"


@pytest.fixture(scope="module", params=TINY, ids=[t.name for t in TINY])
def saved(request, tmp_path_factory):
    """Per encoder variant: a patched tiny model saved with save_pretrained, its inputs, hf_alibi's outputs."""
    case = request.param
    root = tmp_path_factory.mktemp(f"remote_{case.name}")
    for variant in case.variants:
        original = case.make()
        inputs = example_inputs(case.model_type, original)
        with torch.no_grad():
            original_out = output_tensor(original(**inputs))
        model = hf_alibi.patch_model(original, encoder_variant=variant)
        folder = root / _variant_dir(variant)
        model.save_pretrained(folder)
        expected = {"inputs": inputs}
        with torch.no_grad():
            expected["sdpa"] = output_tensor(model(**inputs))
            if model.can_generate():
                prompt = {"input_ids": inputs["input_ids"][:1, :6]}
                expected["generated"] = model.generate(**prompt, max_new_tokens=8, do_sample=False)
            model.set_attn_implementation("eager")
            expected["eager"] = output_tensor(model(**inputs))
        # converting changed the numbers: the comparison below cannot pass by loading the original model
        assert not torch.allclose(expected["sdpa"], original_out, atol=1e-3)
        torch.save(expected, folder / "expected.pt")
    auto_name = next(a for a, c in auto_classes_for(case.model_type).items() if c == type(case.make()).__name__)
    return case, root, auto_name


CHILD_COMPARE = """
import json, os, sys, torch, transformers
refusals = {}  # first, without trust_remote_code: the Auto class and the original class must refuse
os.chdir(os.path.join(ROOT, VARIANTS[0]))
for loader in (AUTO, BASE):
    try:
        getattr(transformers, loader).from_pretrained(".")
        refusals[loader] = "LOADED"
    except Exception as error:
        refusals[loader] = type(error).__name__ + ": " + str(error)
reports = {}
for variant in VARIANTS:
    os.chdir(os.path.join(ROOT, variant))
    expected = torch.load("expected.pt")
    model = getattr(transformers, AUTO).from_pretrained(".", trust_remote_code=True).eval()
    report = reports[variant] = {"class": type(model).__name__, "module": type(model).__module__,
                                 "attn": model.config._attn_implementation}
    def diff(name):
        with torch.no_grad():
            out = model(**expected["inputs"])
        out = next(getattr(out, n) for n in ("logits", "prediction_logits", "start_logits", "last_hidden_state")
                   if getattr(out, n, None) is not None)
        report[name] = (out - expected[name]).abs().max().item()
    diff("sdpa")
    if "generated" in expected:
        prompt = {"input_ids": expected["inputs"]["input_ids"][:1, :6]}
        generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
        report["generated_equal"] = torch.equal(generated, expected["generated"])
    model.set_attn_implementation("eager")
    report["attn_eager"] = model.config._attn_implementation
    diff("eager")
print(json.dumps({"hf_alibi_loaded": "hf_alibi" in sys.modules, "reports": reports, "refusals": refusals}))
"""


@pytest.fixture(scope="module")
def child_output(saved, tmp_path_factory):
    """One fresh process that cannot import hf_alibi loads every variant's folder (see CHILD_COMPARE)."""
    case, root, auto_name = saved
    variants = [_variant_dir(v) for v in case.variants]
    base = auto_classes_for(case.model_type)[auto_name]
    prelude = f"AUTO = {auto_name!r}\nBASE = {base!r}\nROOT = {str(root)!r}\nVARIANTS = {variants!r}\n"
    result = run_child(prelude + CHILD_COMPARE, root, tmp_path_factory.mktemp("hf"), block_hf_alibi=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return last_json_line(result.stdout)


def test_remote_code_without_hf_alibi_gives_hf_alibis_outputs(saved, child_output):
    case, root, auto_name = saved
    assert child_output["hf_alibi_loaded"] is False
    assert sorted(child_output["reports"]) == sorted(_variant_dir(v) for v in case.variants)
    for variant, report in child_output["reports"].items():
        assert report["module"].startswith("transformers_modules.") and report["module"].endswith(".modeling_alibi")
        assert report["class"] == "Alibi" + auto_classes_for(case.model_type)[auto_name]
        assert report["attn"] == "alibi_remote_sdpa" and report["attn_eager"] == "alibi_remote_eager"
        assert report["sdpa"] <= 1e-5, (variant, report)
        assert report["eager"] <= 1e-5, (variant, report)
        if "generated_equal" in report:
            assert report["generated_equal"], (variant, report)


def test_without_trust_remote_code_loading_fails_clearly(saved, child_output):
    case, root, auto_name = saved
    refusals = child_output["refusals"]
    # the Auto class sees the remote code and asks for trust_remote_code
    assert "trust_remote_code=True" in refusals[auto_name], refusals
    # the original class is refused by the marker in place of the removed position-table size
    assert "removed by hf_alibi" in refusals[auto_classes_for(case.model_type)[auto_name]], refusals


def test_remote_code_never_replaces_hf_alibis_functions(saved):
    case, root, auto_name = saved
    model_type, folder = case.model_type, root / _variant_dir(case.variants[0])
    before = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ("alibi_sdpa", "alibi_eager")}
    class_ref = f"modeling_alibi.Alibi{auto_classes_for(model_type)[auto_name]}"
    remote_cls = get_class_from_dynamic_module(class_ref, str(folder))
    assert remote_cls.__module__.endswith("modeling_alibi") and not remote_cls.__module__.startswith("hf_alibi")
    assert {name: ALL_ATTENTION_FUNCTIONS[name] for name in before} == before
    assert "alibi_remote_sdpa" in ALL_ATTENTION_FUNCTIONS and "alibi_remote_eager" in ALL_ATTENTION_FUNCTIONS
    # with hf_alibi imported, transformers prefers the registered (local) hf_alibi classes, trusted or not
    import transformers

    model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True)
    assert type(model).__module__ == "hf_alibi.models"
    assert model.config._attn_implementation == "alibi_sdpa"


def test_saved_config_points_auto_map_at_the_remote_code(saved):
    case, root, auto_name = saved
    model_type, folder = case.model_type, root / _variant_dir(case.variants[-1])
    config = json.loads((folder / "config.json").read_text())
    assert (folder / "modeling_alibi.py").read_text() == REMOTE_CODE_FILE.read_text()
    auto_map = config["auto_map"]
    assert auto_map["AutoConfig"].startswith("modeling_alibi.Alibi") and auto_map["AutoConfig"].endswith("Config")
    for name, class_name in auto_classes_for(model_type).items():
        assert auto_map[name] == f"modeling_alibi.Alibi{class_name}"
        assert getattr(modeling_alibi, "Alibi" + class_name).__name__ == "Alibi" + class_name
