"""The ``hf-alibi`` command's entry point: hf_alibi/cli.py, run without hf_alibi/__init__.py first.

``import hf_alibi`` registers its model types and attention functions with transformers, which imports torch and
transformers: seconds before anything is printed. Parsing a command line needs neither. So this loads the folder of
the installed ``hf_alibi`` package under a private name whose ``__init__`` is never run, and calls ``cli.main`` from
there: ``cli.py`` imports only the standard library and hf_alibi's modules that import neither at module level, answers
``--help``, ``--version`` and every error about arguments or paths at once, and imports ``hf_alibi`` itself when a
job runs (``hf_alibi.cli.run``). ``python -m hf_alibi`` is the same command, after the package's import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

FRONT = "_hf_alibi_front"  # hf_alibi's folder as a package whose __init__ is not run (parsing only)


def _front_cli() -> types.ModuleType:
    cli = sys.modules.get(f"{FRONT}.cli")
    if cli is not None:
        return cli
    spec = importlib.util.find_spec("hf_alibi")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("hf-alibi: the hf_alibi package is not installed (pip install -e . in its checkout)")
    package = types.ModuleType(FRONT, "hf_alibi's folder, for the command line's parser (no __init__ run)")
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = FRONT
    sys.modules[FRONT] = package
    return importlib.import_module(f"{FRONT}.cli")


def main(argv: list[str] | None = None) -> int:
    """``hf-alibi``: see :mod:`hf_alibi.cli`."""
    return _front_cli().main(argv)
