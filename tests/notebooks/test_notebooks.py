"""Every walkthrough notebook runs top to bottom (small size), and the committed ones are its executed source.

Each notebook's source is a percent-format script, ``notebooks/NN_name.py`` (jupytext; linted by ruff with
the rest of the tree); ``notebooks/NN_name.ipynb`` is that source executed, with its outputs. The notebooks
assert their own numbers (bias matrices against the formula, reloads and remote-code loads against
hf_alibi's logits, ...), so a run that completes is a run whose checks held.

Notebooks teach the public API: they reach hf_alibi only through its documented modules and their
``__all__``, touch no ``_private`` attribute, and every relative link in their text resolves.
"""

import ast
import importlib
import json
import os
import re
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SOURCES = sorted(path.name for path in NOTEBOOKS.glob("[0-9][0-9]_*.py"))


# The modules of hf_alibi a notebook may import (the package and the documented public modules); the rest
# (core/, the patch and registry internals) is reached through these.
PUBLIC_MODULES = {"hf_alibi", "hf_alibi.evaluate", "hf_alibi.recover", "hf_alibi.train", "hf_alibi.train.data"}


def cells(notebook) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def test_every_notebook_has_its_source_and_the_reverse():
    assert len(SOURCES) >= 4
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(Path(name).stem for name in SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_committed_notebook_is_its_source_executed(source):
    notebook = nbformat.read(NOTEBOOKS / source.replace(".py", ".ipynb"), as_version=4)
    expected = jupytext.read(NOTEBOOKS / source)
    assert cells(notebook) == cells(expected), (
        f"notebooks/{source} changed: rebuild with `python notebooks/execute.py {source[:-3]}`"
    )
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code_cells), "run python notebooks/execute.py"
    assert not [o for cell in code_cells for o in cell.outputs if o.output_type == "error"]


def committed_output_lines() -> list[tuple[str, str]]:
    """(notebook, line) for every line a committed notebook's code cells printed."""
    lines = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
                text = output.get("text") or output.get("data", {}).get("text/plain", "")
                lines += [(path.name, line) for line in text.splitlines()]
    return lines


@pytest.fixture(scope="module")
def saved_today(tmp_path_factory) -> tuple[list[str], dict]:
    """What a converted model's save writes today (its files, sorted, and its config.json): the facts that drift."""
    from tiny import tiny_gpt2

    import hf_alibi

    folder = tmp_path_factory.mktemp("saved")
    hf_alibi.patch_model(tiny_gpt2()).save_pretrained(folder)
    return sorted(os.listdir(folder)), json.loads((folder / "config.json").read_text())


def printed_literals(prefix: str) -> list[tuple[str, object]]:
    """The committed outputs' lines that are a Python literal starting with ``prefix``, evaluated."""
    found = []
    for name, line in committed_output_lines():
        if line.startswith(prefix):
            try:
                found.append((name, ast.literal_eval(line)))
            except (SyntaxError, ValueError):  # a line that only starts like one ("[recover] step ...")
                pass
    return found


def test_committed_outputs_list_the_files_a_save_writes_today(saved_today):
    """Without running a notebook: every converted folder's listing they print is today's, so is the code files'
    count, and every settings dict they print has config.alibi's keys today, the marker its text today. A stale
    committed output fails here; `python notebooks/execute.py NN_name` rebuilds it."""
    files, config = saved_today
    code = [name for name in files if name.endswith(".py")]
    listings = [(name, listed) for name, listed in printed_literals("[") if "modeling_alibi.py" in listed]
    assert listings, "no notebook prints a converted folder's files any more: update this test"
    for name, listed in listings:  # 01: model.save_pretrained's folder
        assert listed == files, f"{name} shows a stale save: rebuild it"
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    wrote = [(name, line.split(": ", 1)[1]) for name, line in committed_output_lines() if line.startswith("Wrote the")]
    counted = [(name, re.fullmatch(r"(\d+) code files: (.+)", line)) for name, line in committed_output_lines()]
    counted = [(name, match) for name, match in counted if match]
    assert wrote and counted, "notebook 04 no longer shows what convert wrote: update this test"
    for name, listed in wrote:  # 04: hf-alibi convert's report, SRC's tokenizer files kept
        assert sorted(set(listed.split(", ")) - tokenizer_files) == files, f"{name} shows a stale convert: rebuild it"
    for name, match in counted:
        assert (int(match.group(1)), match.group(2).split(", ")) == (len(code), code), f"{name}: stale code files"
    dicts = [(name, d.get("alibi", d)) for name, d in printed_literals("{") if isinstance(d, dict)]
    settings = [(name, d) for name, d in dicts if isinstance(d, dict) and "base_model_type" in d]
    assert {name for name, _ in settings} >= {"01_quickstart.ipynb", "03_encoders.ipynb"}
    for name, printed in settings:  # 01 and 03 print config.alibi
        assert sorted(printed) == sorted(config["alibi"]), f"{name} shows stale ALiBi settings: rebuild it"
    dict_lines = [d for _, d in printed_literals("{") if isinstance(d, dict)]
    markers = [d["n_positions"] for d in dict_lines if str(d.get("n_positions")).startswith("removed")]
    assert markers and all(marker == config["n_positions"] for marker in markers), "a stale marker: rebuild 01"


# slow tier: the five notebooks run end to end take about 90 s of the default tier's budget (10 minutes on 2 cores);
# the committed notebook's outputs, its API and its links are checked in the default tier (the tests around this)
@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_notebook_runs(source, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ALIBI_NOTEBOOK_SIZE", "ci")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # tiny models: on a shared 2-core machine, a second thread per kernel made a training step 8x slower
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = jupytext.read(NOTEBOOKS / source)
    resources = {"metadata": {"path": str(tmp_path)}}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources)
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def exported(module: str) -> set[str]:
    """What ``module`` offers: its ``__all__`` (without one, its names not starting with ``_``) and the public
    modules one level below it."""
    below = {name.rsplit(".", 1)[1] for name in PUBLIC_MODULES if name.rsplit(".", 1)[0] == module and "." in name}
    loaded = importlib.import_module(module)
    return set(getattr(loaded, "__all__", [name for name in vars(loaded) if not name.startswith("_")])) | below


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def private_uses(source: str) -> list[str]:
    """Each use of hf_alibi outside its public API in ``source``, and every ``_private`` attribute access,
    in source order."""
    found = []
    aliases = {}  # local name -> the hf_alibi module it is bound to
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_alibi":
                    if alias.name not in PUBLIC_MODULES:
                        found.append((node.lineno, node.col_offset, f"import {alias.name}"))
                    aliases[alias.asname or "hf_alibi"] = alias.name if alias.asname else "hf_alibi"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_alibi":
            if node.module not in PUBLIC_MODULES:
                found.append((node.lineno, node.col_offset, f"from {node.module} import ..."))
                continue
            for alias in node.names:
                if alias.name not in exported(node.module):
                    found.append((node.lineno, node.col_offset, f"from {node.module} import {alias.name}"))
                elif f"{node.module}.{alias.name}" in PUBLIC_MODULES:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        where = (node.lineno, node.col_offset)
        if is_private(node.attr):
            found.append((*where, f".{node.attr}"))
            continue
        owner = dotted(node.value)
        if owner is None or owner.split(".")[0] not in aliases or node.attr.startswith("__"):
            continue
        module = ".".join([aliases[owner.split(".")[0]], *owner.split(".")[1:]])
        if module in PUBLIC_MODULES and node.attr not in exported(module):
            found.append((*where, f"{module}.{node.attr}"))
    return [text for *_, text in sorted(found)]


def test_the_public_api_check_finds_what_it_must():
    source = """
import hf_alibi
import hf_alibi.core.bias
from hf_alibi.core.slopes import alibi_bias
from hf_alibi import patch_model, get_slopes, registry
from hf_alibi.recover import recover, api
import hf_alibi.recover as rec
hf_alibi.patch_model(model)._private
hf_alibi.resolve_options
hf_alibi.recover.recover, hf_alibi.recover.trainer
rec.recover, rec.Blocks, hf_alibi.__file__, hf_alibi.__version__
model.config._attn_implementation
"""
    assert private_uses(source) == [
        "import hf_alibi.core.bias",
        "from hf_alibi.core.slopes import ...",
        "from hf_alibi import registry",
        "from hf_alibi.recover import api",
        "._private",
        "hf_alibi.resolve_options",
        "hf_alibi.recover.trainer",
        "hf_alibi.recover.Blocks",
        "._attn_implementation",
    ]


@pytest.mark.parametrize("source", SOURCES)
def test_notebook_uses_only_the_public_api(source):
    assert private_uses((NOTEBOOKS / source).read_text()) == []


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(markdown: str, base: Path) -> list[str]:
    """The relative links in ``markdown`` whose file (from ``base``) or ``#anchor`` (a heading there) is missing."""
    broken = []
    for target in LINK.findall(markdown):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        file = base / path
        if not file.exists():
            broken.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.MULTILINE)
            if anchor not in {slug(heading) for heading in headings}:
                broken.append(target)
    return broken


def test_the_link_check_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Train short, test long\n")
    markdown = (
        "[a](docs/page.md) [b](docs/page.md#train-short-test-long) [c](https://example.org/x.md) [d](#here) "
        "[e](ALIBI_NOTES.md) [f](docs/page.md#nowhere)"
    )
    assert broken_links(markdown, tmp_path) == ["ALIBI_NOTES.md", "docs/page.md#nowhere"]


@pytest.mark.parametrize("source", SOURCES)
def test_every_relative_link_resolves(source):
    notebook = jupytext.read(NOTEBOOKS / source)
    markdown = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    assert broken_links(markdown, NOTEBOOKS) == []
