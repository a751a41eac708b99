"""Every walkthrough notebook runs top to bottom (small size), and the committed ones are its executed source.

Each notebook's source is a percent-format script, ``notebooks/NN_name.py`` (jupytext; linted by ruff with
the rest of the tree); ``notebooks/NN_name.ipynb`` is that source executed, with its outputs. The notebooks
assert their own numbers (bias matrices against the formula, reloads and remote-code loads against
hf_alibi's logits, ...), so a run that completes is a run whose checks held.
"""

from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SOURCES = sorted(path.name for path in NOTEBOOKS.glob("[0-9][0-9]_*.py"))


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


@pytest.mark.parametrize("source", SOURCES)
def test_notebook_runs(source, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ALIBI_NOTEBOOK_SIZE", "ci")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = jupytext.read(NOTEBOOKS / source)
    resources = {"metadata": {"path": str(tmp_path)}}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources)
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
