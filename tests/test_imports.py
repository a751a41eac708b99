"""hf_alibi's import graph: no cycle, counting the imports inside functions; what ``import hf_alibi`` loads."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hf_alibi
from hf_alibi.core.kernels import KERNELS

PACKAGE = Path(__file__).resolve().parents[1] / "hf_alibi"


def _modules() -> dict[str, Path]:
    """Every module of hf_alibi by dotted name (a package by its own name)."""
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }


MODULES = _modules()


def _reexports(package: str) -> dict[str, str]:
    """name -> the submodule a package's ``__init__`` takes it from (``from .x import name``, ``TYPE_CHECKING``
    blocks included: they name the homes of a lazy ``__getattr__``)."""
    found = {}
    for node in ast.walk(ast.parse(MODULES[package].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                found[alias.asname or alias.name] = f"{package}.{node.module}"
    return found


def _home(base: str, name: str) -> str | None:
    """The module ``from base import name`` depends on: the submodule ``base.name``, the submodule a package
    re-exports ``name`` from, else ``base`` itself."""
    if f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    if base in MODULES and MODULES[base].name == "__init__.py":
        home = _reexports(base).get(name)
        if home is not None:
            return _home(*home.rsplit(".", 1)) if home not in MODULES else home
    return base if base in MODULES else None


def imports_of(name: str) -> set[str]:
    """The hf_alibi modules ``name`` imports anywhere: at module level, inside functions, in ``TYPE_CHECKING``
    blocks (an import that runs later still closes a circle), and the packages that enclose them. Not in an ``if
    False:`` block, which never runs (kernels.py's lines for transformers' remote-code copier); dispatch.py imports
    each kernel row's module by name (importlib), counted here from the table."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    never_run = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and isinstance(block.test, ast.Constant) and block.test.value is False
        for statement in block.body
        for n in ast.walk(statement)
    }
    if name == "hf_alibi.core.dispatch":
        found |= {f"hf_alibi.core.{row.module}" for row in KERNELS if row.runs}
    for node in ast.walk(tree):
        if id(node) in never_run:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "hf_alibi":
                found.update(_home(base, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "hf_alibi")
    found.discard(None)
    # importing a.b.c runs the package a.b first: an edge to every enclosing package but the importer's own
    found |= {m.rsplit(".", k)[0] for m in found for k in range(1, m.count(".") + 1)}
    found = {m for m in found if m in MODULES and not name.startswith(m + ".")}
    found.discard(name)
    return found


def test_no_module_imports_an_enclosing_package_whole():
    """``import hf_alibi`` inside hf_alibi hides which module it needs; import that module instead."""
    for name in MODULES:
        path = MODULES[name]
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        enclosing = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                enclosing |= {a.name for a in node.names if name.startswith(a.name + ".")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                enclosing |= {base for a in node.names if name.startswith(base + ".") and _home(base, a.name) == base}
        assert not enclosing, f"{name} imports its enclosing package {sorted(enclosing)}: import the module needed"


def test_no_import_cycle_counting_imports_inside_functions():
    graph = {name: imports_of(name) for name in MODULES}
    visiting, done = set(), set()

    def visit(name, trail):
        assert name not in visiting, f"import cycle: {' -> '.join(trail + [name])}"
        if name in done:
            return
        visiting.add(name)
        for target in sorted(graph[name]):
            visit(target, trail + [name])
        visiting.discard(name)
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not any(m.startswith("hf_alibi.hub") for m in graph["hf_alibi.convert.registry"])  # the mixin is given
    # nothing outside the command line imports it (``python -m hf_alibi`` runs it; hf_alibi.jobs is a deprecated alias)
    cli = {m for m in MODULES if m == "hf_alibi.cli" or m.startswith("hf_alibi.cli.")}
    outside = {name: graph[name] & cli for name in MODULES if name not in cli | {"hf_alibi.__main__", "hf_alibi.jobs"}}
    assert not {name: found for name, found in outside.items() if found}


def test_the_core_imports_only_itself():
    """hf_alibi/core is copied into checkpoints as remote code: nothing of the outer layer."""
    for name in MODULES:
        if name.startswith("hf_alibi.core."):
            outer = {m for m in imports_of(name) if not m.startswith("hf_alibi.core")}
            assert not outer, f"{name} imports {sorted(outer)}"


@pytest.mark.slow  # one interpreter per module: about 35 s each on a busy 2-core machine
@pytest.mark.parametrize(
    "name", ["hf_alibi.hub.checkpoints", "hf_alibi.cli", "hf_alibi.hub.card", "hf_alibi.cli.jobs"]
)
def test_a_module_imports_first_in_a_fresh_interpreter(name):
    """The leaves that reach across the outer layer, each imported before anything else of hf_alibi."""
    code = "import importlib, sys; importlib.import_module(sys.argv[1])"
    child = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True)
    assert child.returncode == 0, f"{name}: {child.stderr[-2000:]}"


def test_importing_hf_alibi_loads_only_the_saving_part_of_hub():
    code = "import sys, transformers, hf_alibi; print(sorted(m for m in sys.modules if m.startswith('hf_alibi.hub')))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[-2] == "['hf_alibi.hub', 'hf_alibi.hub.saving']"


def test_the_renamed_core_modeling_module_warns_and_still_resolves():
    """hf_alibi.core.modeling is hf_alibi.core.conversion now (CONTRIBUTING's deprecated names): the old name warns
    once imported and gives the same objects (what code and pickles made before the rename name)."""
    import importlib
    import sys

    from hf_alibi.core import conversion

    sys.modules.pop("hf_alibi.core.modeling", None)
    with pytest.warns(FutureWarning, match="hf_alibi.core.conversion"):
        old = importlib.import_module("hf_alibi.core.modeling")
    assert old.ForwardSetup is conversion.ForwardSetup and old.convert is conversion.convert


@pytest.mark.parametrize("old", ["is_alibi_config", "is_alibi_model"])
def test_the_three_alibi_predicates_are_one_and_the_old_names_warn(old):
    """hf_alibi.is_alibi answers for a model, a config and config.json as a dict (one rule, core/names.py); the old
    names warn and give it (CONTRIBUTING's deprecated names)."""
    from tiny import tiny_gpt2

    model = hf_alibi.patch_model(tiny_gpt2())
    saved = model.config.to_dict()
    assert hf_alibi.is_alibi(model) and hf_alibi.is_alibi(model.config) and hf_alibi.is_alibi(saved)
    plain = tiny_gpt2()
    assert not any(map(hf_alibi.is_alibi, (plain, plain.config, plain.config.to_dict(), {"model_type": "alibi_x"})))
    with pytest.warns(FutureWarning, match="hf_alibi.is_alibi"):
        assert getattr(hf_alibi, old) is hf_alibi.is_alibi


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("hf_alibi.jobs", "hf_alibi.cli.jobs", "recover_checkpoint"),  # the command line: one package (hf_alibi/cli/)
        ("hf_alibi.evaluation", "hf_alibi.evaluate.lengths", "evaluate_lengths"),  # evaluation is one wing
        # the loose top-level modules, each in its wing
        ("hf_alibi.patch", "hf_alibi.convert.patch", "patch_model"),
        ("hf_alibi.planning", "hf_alibi.convert.planning", "resolve_options"),
        ("hf_alibi.registry", "hf_alibi.convert.registry", "get_architecture"),
        ("hf_alibi.positions", "hf_alibi.convert.positions", "original_length"),
        ("hf_alibi.fit", "hf_alibi.convert.fit", "fit_slopes"),
        ("hf_alibi.gguf", "hf_alibi.export.gguf", "export_gguf"),
        ("hf_alibi.checkpoints", "hf_alibi.hub.checkpoints", "open_source"),
        ("hf_alibi.distributed", "hf_alibi.train.distributed", "unsharded_copy"),
        ("hf_alibi.training", "hf_alibi.train.length_scaling", "LengthScalingTrainer"),
        ("hf_alibi.data", "hf_alibi.train.data", "embedded_corpus"),  # the notebooks now import hf_alibi.train.data
    ],
    ids=lambda value: value.rsplit(".", 1)[-1] if value.startswith("hf_alibi.") else None,
)
def test_a_moved_modules_old_name_warns_and_is_the_same_module(old, new, name):
    """A module moved into its wing keeps its old name as an alias for one release (CONTRIBUTING: deprecated names):
    importing it warns with FutureWarning once and gives the same module object, its names included."""
    code = (
        f"import warnings, {new} as new\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    import {old} as old\n"
        f"    from {old} import {name}\n"
        f"assert old is new and {name} is new.{name}\n"
        "assert [w.category for w in caught] == [FutureWarning], caught\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]


@pytest.mark.parametrize(("old", "new"), [("hf_alibi.models", "hf_alibi.convert.models")])
def test_the_kept_old_names_are_the_same_module_without_a_warning(old, new):
    """hf_alibi.models is the module the Alibi<Class> classes name (pickles and user code import it): it stays, the
    same module object, silently."""
    code = (
        f"import warnings, {new} as new\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    import {old} as old\n"
        "assert old is new and not caught, caught\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]


REGISTERED = """
import sys
{first}
from transformers import CONFIG_MAPPING
print("alibi_gpt2" in CONFIG_MAPPING, "alibi_sdpa" in __import__("transformers").AttentionInterface._global_mapping)
"""


@pytest.mark.parametrize(
    "first",
    [
        "import hf_alibi",  # hf_alibi before transformers: registered once transformers is imported
        "import transformers; import hf_alibi",  # transformers first: registered by the import of hf_alibi
        "from hf_alibi.convert.registry import get_architecture",  # a module of hf_alibi first (imports transformers)
        "from hf_alibi.evaluate import lengths",  # a wing whose import loads transformers
        "import hf_alibi.models",  # what a pickle of an Alibi<Class> imports
    ],
)
def test_importing_hf_alibi_registers_whichever_comes_first(first):
    """``import hf_alibi`` is light, and what it promises holds: hf_alibi's model types and attention functions are
    registered with transformers (``AutoModel.from_pretrained(converted folder)`` after ``import hf_alibi``)."""
    child = subprocess.run([sys.executable, "-c", REGISTERED.format(first=first)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[-2] == "True True", (first, child.stdout)


def test_import_hf_alibi_is_light_and_no_module_runs_twice():
    """``import hf_alibi`` loads neither torch nor transformers (the command line's answers come first); after the
    command line and a job's library are imported, every file of hf_alibi is one module object (no copy under another
    name: a moved module's old name is the same object)."""
    code = (
        "import sys, hf_alibi; light = not {'torch', 'transformers'} & set(sys.modules); "
        "import hf_alibi.cli, hf_alibi.cli.jobs, hf_alibi.jobs; "
        "mods = [m for m in list(sys.modules.values()) if 'hf_alibi' in (getattr(m, '__file__', None) or '')]; "
        "files = {m.__file__: set() for m in mods}; [files[m.__file__].add(id(m)) for m in mods]; "
        "print(light, sorted(f for f, ids in files.items() if len(ids) > 1))"
    )
    child = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[-2] == "True []"


def test_the_planner_runs_without_torch():
    """hf_alibi.convert.planning is torch-free in every function, not only at module level: a preset's option that is
    a multiple of the original length asks original_length, which reads the row without torch."""
    code = (
        "import sys; from hf_alibi.convert import planning\n"
        "config = {'model_type': 'roberta', 'max_position_embeddings': 66, 'pad_token_id': 1}\n"
        "row = planning.builtin_rows()[0]['roberta']\n"
        "values = planning.resolve_options(planning.config_fields(config), row, 'pretrained')\n"
        "print(planning.original_length(config), sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[-2] == "64 []"
