"""Every walkthrough notebook runs top to bottom (small size), and the committed ones are executed.

The notebooks assert their own numbers (bias matrices against the formula, reloads and remote-code
loads against hf_alibi's logits, ...), so a run that completes is a run whose checks held.
"""

import importlib
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import hf_alibi

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
build = importlib.import_module("build")
NAMES = sorted(build.NOTEBOOKS)


def missing_requirements(name: str) -> list[str]:
    """Architectures / modules a notebook needs that this checkout does not have yet."""
    needs = build.REQUIRES.get(name, {})
    missing = [t for t in needs.get("model_types", ()) if t not in hf_alibi.supported_model_types()]
    for module in needs.get("modules", ()):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def test_every_notebook_file_is_built_by_build_py():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_executed_and_matches_its_source(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    sources = [cell.source for cell in notebook.cells]
    assert sources == [cell.source for cell in build.NOTEBOOKS[name]], "edit notebooks/build.py, then rebuild"
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code_cells), "commit the notebook executed (build.py --execute)"
    assert not [o for cell in code_cells for o in cell.outputs if o.output_type == "error"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    missing = missing_requirements(name)
    if missing:
        pytest.skip(f"{name} needs {missing}, not in this checkout yet")
    monkeypatch.setenv("HF_ALIBI_NOTEBOOK_SIZE", "ci")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    resources = {"metadata": {"path": str(tmp_path)}}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources)
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
