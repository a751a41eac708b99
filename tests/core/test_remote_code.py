"""The checkpoint's own code (``trust_remote_code=True``) rebuilds the same ALiBi model without hf_alibi."""

import ast
import inspect
import json
import traceback
from pathlib import Path

import pytest
import torch
from sharing import REPO_ROOT, TINY, example_inputs, last_json_line, output_tensor, run_child
from tiny import VOCAB
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_alibi
from hf_alibi.convert.registry import alibi_classes
from hf_alibi.core import modeling_alibi
from hf_alibi.core.architectures import find_architecture
from hf_alibi.core.kernels import KERNELS
from hf_alibi.hub import REMOTE_CODE_FILE, auto_classes_for
from hf_alibi.recover.trainer import loss_is_per_batch_mean

CORE = Path(hf_alibi.__file__).parent / "core"
# What a checkpoint's code may import besides its sibling files: torch, transformers, the standard library.
ALLOWED_IMPORTS = {"__future__", "collections", "contextlib", "contextvars", "copy", "ctypes", "dataclasses",
                   "functools", "importlib", "inspect", "math", "os", "platform", "struct", "threading", "torch",
                   "transformers", "typing", "warnings"}  # fmt: skip


def test_remote_code_is_the_library_core_byte_for_byte(tmp_path):
    model = hf_alibi.patch_model(TINY[0].make())
    model.save_pretrained(tmp_path)
    written = sorted(path.name for path in tmp_path.glob("*.py"))
    # every core module but the package's __init__ (the entry module imports them all) and the deprecated alias
    # modeling.py (CONTRIBUTING's deprecated names: nothing imports it, a checkpoint needs none)
    left_out = ("__init__.py", "modeling.py")
    assert written == sorted(path.name for path in CORE.glob("*.py") if path.name not in left_out)
    # every kernel's file, named by its row (kernels.py's lines for the copier; dispatch.py imports it by name)
    assert {f"{row.module}.py" for row in KERNELS if row.runs} <= set(written)
    for name in written:
        assert (tmp_path / name).read_bytes() == (CORE / name).read_bytes(), name
    assert REMOTE_CODE_FILE == CORE / "modeling_alibi.py"
    assert len(REMOTE_CODE_FILE.read_text().splitlines()) <= 30  # the entry module is short


# what only the server, the command line or the Trainer run (a loaded checkpoint never does): the modules they live
# in, and the names of transformers' and hf_alibi's shims for them
FOREIGN_MODULES = ("transformers.cli", "transformers.trainer", "transformers.training_args", "uvicorn", "fastapi",
                   "starlette", "typer", "argparse", "accelerate", "hf_alibi")  # fmt: skip
FOREIGN_NAMES = {"Trainer", "TrainingArguments", "Seq2SeqTrainer", "is_serve_available", "build_server", "app",
                 "_cb_manager", "loss_is_scaled_for_ga", "model_accepts_loss_kwargs", "transformers_cli_app",
                 "wrap_server_builder", "cb_worker_fatal_error", "serving_available",
                 "loss_is_per_batch_mean"}  # fmt: skip


def server_cli_or_trainer_code(source: str) -> set[str]:
    """What of the server, the command line or the Trainer a module's code (not its prose) names: modules imported
    from :data:`FOREIGN_MODULES`, and :data:`FOREIGN_NAMES` imported, read, defined or asked for by name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found |= {m for m in modules if m.startswith(FOREIGN_MODULES)}
            found |= {a.name for a in node.names} & FOREIGN_NAMES
        name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        if name in FOREIGN_NAMES:
            found.add(name)
    return found


def test_remote_code_holds_no_server_cli_or_trainer_code(tmp_path):
    """The files save_pretrained copies (the entry module and what it imports, followed as transformers follows
    them) hold no server, command line or Trainer code: those shims live in their wings (serve/compat.py,
    recover/trainer.py), not in core/compat.py."""
    model = hf_alibi.patch_model(TINY[0].make())
    model.save_pretrained(tmp_path)
    copied = {path.name: path.read_text() for path in tmp_path.glob("*.py")}
    assert "compat.py" in copied and "modeling_alibi.py" in copied
    found = {name: sorted(server_cli_or_trainer_code(text)) for name, text in copied.items()}
    assert {name: hits for name, hits in found.items() if hits} == {}
    # the check finds the shims where they live now (what core/compat.py held before)
    assert server_cli_or_trainer_code((REPO_ROOT / "hf_alibi" / "serve" / "compat.py").read_text()) >= {
        "transformers.cli.transformers", "transformers_cli_app", "app", "build_server", "_cb_manager",
        "is_serve_available", "serving_available",
    }  # fmt: skip
    trainer = inspect.getsource(loss_is_per_batch_mean) + "from transformers import Trainer\n"
    assert server_cli_or_trainer_code(trainer) >= {"loss_is_scaled_for_ga", "model_accepts_loss_kwargs", "Trainer"}


# each kernel file's optional packages, from the kernel table: file (the row's module) -> packages; and DeepSpeed,
# which partitions.py imports only where a weight is a ZeRO-3 partition
OPTIONAL = {row.module: row.packages for row in KERNELS if row.packages} | {"partitions": ("deepspeed",)}


def test_optional_packages_are_imported_in_try_blocks_only():
    """transformers' check_imports refuses a checkpoint whose code imports a missing package outside a try block."""
    assert OPTIONAL and all((CORE / f"{stem}.py").is_file() for stem in OPTIONAL)  # read off the table
    for stem, packages in OPTIONAL.items():
        tree = ast.parse((CORE / f"{stem}.py").read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                if any(name.split(".")[0] in packages for name in names):
                    assert id(node) in guarded, (stem, node.lineno)


def test_remote_code_imports_only_torch_transformers_the_stdlib_and_its_siblings():
    siblings = {path.stem for path in CORE.glob("*.py")} - {"__init__"}
    for path in CORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = {alias.name.split(".")[0] for alias in node.names}
                assert tops <= ALLOWED_IMPORTS | set(OPTIONAL.get(path.stem, ())), (path.name, node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                top = node.module.split(".")[0]
                # a kernel's optional packages (its row of the table) are imported inside a try block only, in its
                # own file (transformers' check_imports skips those)
                assert top in ALLOWED_IMPORTS or top in OPTIONAL.get(path.stem, ()), (path.name, top)
            elif isinstance(node, ast.ImportFrom):  # flat relative imports, as the dynamic-module loader follows
                assert node.level == 1 and node.module in siblings, (path.name, node.module)


def test_the_core_and_the_registry_answer_with_one_row():
    assert sorted(hf_alibi.ARCHITECTURES) == hf_alibi.supported_model_types()
    # every row is in tests/arch_cases.py (test_architectures.py checks it); the full cases run here
    assert {case.model_type for case in TINY} <= set(hf_alibi.supported_model_types())
    for model_type, row in hf_alibi.ARCHITECTURES.items():
        assert hf_alibi.get_architecture(model_type) is row and find_architecture(model_type) is row
    assert find_architecture("mamba") is None  # the core's answer where the registry raises


def long_inputs(case, model) -> dict:
    """Inputs 3x past the original maximum, long enough that causal layers take the folded path."""
    ids = torch.randint(1, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    if model.config.is_encoder_decoder:
        return {"input_ids": ids, "decoder_input_ids": ids[:, :40]}
    return {"input_ids": ids}


def default_backend(model_type: str) -> str:
    """transformers' default backend for the model type's classes: sdpa where they allow it (gemma2: eager)."""
    return "sdpa" if all(c._supports_sdpa for c in alibi_classes(model_type).values()) else "eager"


def _variant_dir(variant) -> str:
    return variant or "causal"


def _folder_name(case, variant) -> str:
    """Distinct per row and variant: transformers copies a local folder's code to transformers_modules/<its name>."""
    name = f"remote_{case.name}_{_variant_dir(variant)}"
    assert name.isidentifier(), name  # transformers would rename it (and the module check below would not match)
    return name


def _save(case, root: Path) -> str:
    """Per encoder variant: the patched tiny model saved with save_pretrained, its inputs, hf_alibi's outputs."""
    for variant in case.variants:
        original = case.make()
        inputs = example_inputs(case.model_type, original)
        with torch.no_grad():
            original_out = output_tensor(original(**inputs))
        model = hf_alibi.patch_model(original, encoder_variant=variant)
        model.set_attn_implementation(default_backend(case.model_type))  # the one from_pretrained picks
        folder = root / _folder_name(case, variant)
        model.save_pretrained(folder)
        expected = {"inputs": inputs}
        with torch.no_grad():
            expected["sdpa"] = output_tensor(model(**inputs))
            expected["long_inputs"] = long_inputs(case, model)
            expected["long"] = output_tensor(model(**expected["long_inputs"]))
            expected["paths"] = sorted({m.last_path for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)})
            if model.can_generate():
                prompt = {"input_ids": inputs["input_ids"][:1, :6]}
                expected["generated"] = model.generate(**prompt, max_new_tokens=8, do_sample=False)
            model.set_attn_implementation("eager")
            expected["eager"] = output_tensor(model(**inputs))
        # converting changed the numbers: the comparison below cannot pass by loading the original model
        assert not torch.allclose(expected["sdpa"], original_out, atol=1e-3)
        torch.save(expected, folder / "expected.pt")
    return next(a for a, c in auto_classes_for(case.model_type).items() if c == type(case.make()).__name__)


@pytest.fixture(scope="module")
def saved_rows(tmp_path_factory):
    """Every row's folders, saved once for the module: {row name: auto class name, or the traceback of its failure}."""
    root = tmp_path_factory.mktemp("remote")
    rows = {}
    for case in TINY:
        try:
            rows[case.name] = _save(case, root)
        except Exception:  # that row's tests fail with it; the other rows go on
            rows[case.name] = "FAILED\n" + traceback.format_exc()
    return root, rows


@pytest.fixture(params=TINY, ids=[t.name for t in TINY])
def saved(request, saved_rows):
    """One row: (case, the folder holding its variants' folders, the Auto class of its model)."""
    case, (root, rows) = request.param, saved_rows
    if rows[case.name].startswith("FAILED\n"):
        pytest.fail(f"saving {case.name} failed:\n{rows[case.name]}")
    return case, root, rows[case.name]


CHILD_COMPARE = """
import json, os, sys, traceback, torch, transformers
def main_output(out):
    return next(getattr(out, n) for n in ("logits", "prediction_logits", "start_logits", "last_hidden_state")
                if getattr(out, n, None) is not None)
results = {name: {"refusals": {}, "reports": {}} for name in ROWS}
# first, before any remote code is loaded in this process: without trust_remote_code, the Auto class and the
# original class must refuse every row's checkpoint
for name, row in ROWS.items():
    for loader in (row["auto"], row["base"]):
        try:
            getattr(transformers, loader).from_pretrained(row["folders"][0])
            results[name]["refusals"][loader] = "LOADED"
        except Exception as error:
            results[name]["refusals"][loader] = type(error).__name__ + ": " + str(error)
for name, row in ROWS.items():
    for folder in row["folders"]:
        report = results[name]["reports"][os.path.basename(folder)] = {}
        try:  # a failure is this variant's report: it hides no other row
            expected = torch.load(os.path.join(folder, "expected.pt"))
            model = getattr(transformers, row["auto"]).from_pretrained(folder, trust_remote_code=True).eval()
            report.update({"class": type(model).__name__, "module": type(model).__module__,
                           "config_module": type(model.config).__module__, "attn": model.config._attn_implementation})
            with torch.no_grad():
                report["sdpa"] = (main_output(model(**expected["inputs"])) - expected["sdpa"]).abs().max().item()
                out = main_output(model(**expected["long_inputs"]))
            report["long"] = (out - expected["long"]).abs().max().item()
            report["paths"] = sorted({m.last_path for m in model.modules() if type(m).__name__ == "AlibiBias"})
            report["expected_paths"] = expected["paths"]
            if "generated" in expected:
                prompt = {"input_ids": expected["inputs"]["input_ids"][:1, :6]}
                generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
                report["generated_equal"] = torch.equal(generated, expected["generated"])
            model.set_attn_implementation("eager")
            report["attn_eager"] = model.config._attn_implementation
            with torch.no_grad():
                report["eager"] = (main_output(model(**expected["inputs"])) - expected["eager"]).abs().max().item()
        except Exception:
            report["error"] = traceback.format_exc()
print(json.dumps({"hf_alibi_loaded": "hf_alibi" in sys.modules, "rows": results}))
"""


@pytest.fixture(scope="module")
def child_output(saved_rows, tmp_path_factory):
    """One fresh process that cannot import hf_alibi loads every row's folders (see CHILD_COMPARE)."""
    root, rows = saved_rows
    spec = {}
    for case in TINY:
        if not rows[case.name].startswith("FAILED\n"):
            auto_name = rows[case.name]
            spec[case.name] = {"auto": auto_name, "base": auto_classes_for(case.model_type)[auto_name],
                               "folders": [str(root / _folder_name(case, v)) for v in case.variants]}  # fmt: skip
    prelude = f"ROWS = {spec!r}\n"
    # the rows run one after another in the child: allow each one what a child of its own had
    result = run_child(prelude + CHILD_COMPARE, root, tmp_path_factory.mktemp("hf"), block_hf_alibi=True,
                       timeout=300 * len(spec))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return last_json_line(result.stdout)


def test_remote_code_without_hf_alibi_gives_hf_alibis_outputs(saved, child_output):
    case, root, auto_name = saved
    assert child_output["hf_alibi_loaded"] is False
    reports = child_output["rows"][case.name]["reports"]
    assert sorted(reports) == sorted(_folder_name(case, v) for v in case.variants)
    for folder, report in reports.items():
        assert "error" not in report, f"{folder}:\n{report['error']}"
        # the class comes from this folder's own copy of the code (transformers_modules.<folder>.<hash>.)
        assert report["module"].startswith(f"transformers_modules.{folder}.") and report["module"].endswith(
            ".modeling_alibi"
        ), report
        assert report["config_module"] == report["module"], report
        assert report["class"] == "Alibi" + auto_classes_for(case.model_type)[auto_name]
        assert report["attn"] == "alibi_remote_" + default_backend(case.model_type)
        assert report["attn_eager"] == "alibi_remote_eager"
        assert report["sdpa"] <= 1e-5, (folder, sorted(report.items()))
        assert report["long"] <= 1e-5, (folder, sorted(report.items()))  # past the original maximum
        assert report["paths"] == report["expected_paths"], (folder, report)  # the same attention path
        assert report["eager"] <= 1e-5, (folder, report)
        if "generated_equal" in report:
            assert report["generated_equal"], (folder, report)


def test_without_trust_remote_code_loading_fails_clearly(saved, child_output):
    case, root, auto_name = saved
    refusals = child_output["rows"][case.name]["refusals"]
    # the Auto class sees the remote code and asks for trust_remote_code
    assert "trust_remote_code=True" in refusals[auto_name], refusals
    # the original class is refused by the marker in place of the removed position-table size
    assert "removed by hf_alibi" in refusals[auto_classes_for(case.model_type)[auto_name]], refusals


def test_remote_code_never_replaces_hf_alibis_functions(saved):
    case, root, auto_name = saved
    model_type, folder = case.model_type, root / _folder_name(case, case.variants[0])
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
    assert model.config._attn_implementation == "alibi_" + default_backend(model_type)


def test_saved_config_points_auto_map_at_the_remote_code(saved):
    case, root, auto_name = saved
    model_type, folder = case.model_type, root / _folder_name(case, case.variants[-1])
    config = json.loads((folder / "config.json").read_text())
    assert (folder / "modeling_alibi.py").read_text() == REMOTE_CODE_FILE.read_text()
    auto_map = config["auto_map"]
    assert auto_map["AutoConfig"].startswith("modeling_alibi.Alibi") and auto_map["AutoConfig"].endswith("Config")
    for name, class_name in auto_classes_for(model_type).items():
        assert auto_map[name] == f"modeling_alibi.Alibi{class_name}"
        assert getattr(modeling_alibi, "Alibi" + class_name).__name__ == "Alibi" + class_name


USER_ROW = """
import json, torch, transformers, hf_alibi
assert "helium" not in hf_alibi.supported_model_types()  # a row of the user's, not a built-in one
hf_alibi.register_architecture(hf_alibi.Architecture("helium", "rotary"))
torch.manual_seed(0)
config = transformers.HeliumConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=16, pad_token_id=0, bos_token_id=0, eos_token_id=0)
model = hf_alibi.patch_model(transformers.HeliumForCausalLM(config).eval())
ids = torch.randint(1, 97, (2, 48), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    torch.save({"ids": ids, "logits": model(ids).logits}, "expected.pt")
model.save_pretrained(".")
print(json.dumps({"auto_map": json.load(open("config.json"))["auto_map"]["AutoModelForCausalLM"]}))
"""
LOAD_USER_ROW = """
import json, sys, torch, transformers
expected = torch.load("expected.pt")
model = transformers.AutoModelForCausalLM.from_pretrained(".", trust_remote_code=True).eval()
with torch.no_grad():
    diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()
paths = sorted({m.last_path for m in model.modules() if type(m).__name__ == "AlibiBias"})
print(json.dumps({"diff": diff, "class": type(model).__name__, "paths": paths, "hf_alibi": "hf_alibi" in sys.modules}))
"""


def test_a_users_row_saves_a_checkpoint_that_loads_without_hf_alibi(tmp_path):
    made = run_child(USER_ROW, tmp_path, tmp_path / "hf", block_hf_alibi=False)
    assert made.returncode == 0, made.stderr[-3000:]
    assert last_json_line(made.stdout)["auto_map"] == "modeling_alibi.AlibiHeliumForCausalLM"
    loaded = run_child(LOAD_USER_ROW, tmp_path, tmp_path / "hf", block_hf_alibi=True)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    report = last_json_line(loaded.stdout)
    assert report["hf_alibi"] is False and report["class"] == "AlibiHeliumForCausalLM"
    assert report["diff"] <= 1e-5 and report["paths"] == ["folded"], report
