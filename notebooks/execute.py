"""Execute each notebook's source (``NN_name.py``, percent format) and write ``NN_name.ipynb`` with outputs.

    python notebooks/execute.py                      # every notebook
    python notebooks/execute.py 04_convert_and_share # one

The committed .ipynb files are these executed sources (tests/notebooks/test_notebooks.py checks it).
"""

import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    names = sys.argv[1:] or sorted(path.stem for path in HERE.glob("[0-9][0-9]_*.py"))
    for name in names:
        notebook = jupytext.read(HERE / f"{Path(name).stem}.py")
        NotebookClient(
            notebook, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
        ).execute()
        nbformat.write(notebook, HERE / f"{Path(name).stem}.ipynb")
        print("wrote", HERE / f"{Path(name).stem}.ipynb")
