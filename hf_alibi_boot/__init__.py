"""What runs before hf_alibi/__init__.py. This module: the ``hf-alibi`` command's boot, which runs the command line
(hf_alibi/cli/) without torch. Its subpackage :mod:`hf_alibi_boot.vllm`: vLLM's entrance (the plugin's entry point and
the vLLM server's processes), which hides what cannot load before transformers is imported.

``import hf_alibi`` registers its model types and attention functions with transformers, which imports torch and
transformers: seconds before anything is printed. Parsing a command line needs neither. So this loads the folder of
the installed ``hf_alibi`` package under a private name (``_hf_alibi_front``) whose ``__init__`` is never run, and
calls ``hf_alibi/cli/``'s ``answer`` from there: that package imports only the standard library and hf_alibi's
modules that import neither at module level, answers ``--help``, ``--version`` and every error that needs no model at
once, and imports ``hf_alibi`` itself when a job runs (``hf_alibi.cli.run_job``: the real ``hf_alibi.cli.jobs``).
It is the ``hf-alibi`` script's entry point (pyproject.toml's ``[project.scripts]``). ``python -m hf_alibi`` is the
same command: Python imports the package before its ``__main__``, so ``hf_alibi/__init__.py`` first hands the
command line to :func:`answer_module_run`, which answers the same way before torch loads.

It lives outside hf_alibi because any module inside runs hf_alibi/__init__.py first, and importing hf_alibi must
keep registering what it registers (tests/test_cli_startup.py checks that neither torch, transformers nor hf_alibi
is imported for these answers).
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


_ANSWERED: list[tuple] = []  # `python -m hf_alibi`: the command line answer_module_run checked, for main


def main(argv: list[str] | None = None) -> int:
    """``hf-alibi``: see :mod:`hf_alibi.cli`.

    >>> main(["--version"])  # doctest: +SKIP
    hf-alibi 0.x
    """
    cli = _front_cli()
    parser, parsed = _ANSWERED.pop() if _ANSWERED and argv is None else cli.answer(argv)
    return cli.run_job(parser, parsed)


def answer_module_run(package: str) -> None:
    """When Python runs ``python -m <package>`` (and is importing the package first): the command line's answers
    that need no model (the help, the version, its errors: each exits), before the package imports torch. A
    command line that runs a job is kept for :func:`main`, which ``<package>/__main__.py`` calls next."""
    if sys.argv[:1] != ["-m"]:  # Python sets argv[0] to "-m" while it imports what -m names
        return
    arguments = getattr(sys, "orig_argv", [])  # the interpreter's own: python [options] -m MODULE [arguments]
    first = next((i for i, a in enumerate(arguments) if i and a.startswith("-m")), None)
    if first is None:
        return
    module = arguments[first][2:] or (arguments[first + 1] if first + 1 < len(arguments) else "")
    if module == package:
        _ANSWERED.append(_front_cli().answer(sys.argv[1:]))
