"""The command line answers before the library loads (issue 35): ``hf-alibi --help``, ``JOB --help``, ``--version``
and every error about arguments or paths that needs no model run without importing torch or transformers.

What is asserted is the cause of the wait, not a time: one fresh interpreter runs the entry point of the ``hf-alibi``
script (``hf_alibi_cli.main``) on each command line and reports, after each, its exit status, what it printed and
whether torch or transformers were imported. ``benchmarks/import_time.py`` prints the times.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import contextlib, io, json, sys
import hf_alibi_cli
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = hf_alibi_cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(m for m in ("torch", "transformers", "hf_alibi") if m in sys.modules)
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("startup")
    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    full = root / "full"
    full.mkdir()
    (full / "keep.txt").write_text("a user's file")
    text = root / "text.txt"
    text.write_text("some text")
    return {"src": str(src), "full": str(full), "text": str(text), "root": str(root)}


def _run(argvs: list[list[str]]) -> list[dict]:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(argvs)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.splitlines()[-1])


def _version() -> str:  # read from the file, not through the code under test
    return re.search(r'__version__ = "([^"]+)"', (REPO_ROOT / "hf_alibi/core/version.py").read_text()).group(1)


def test_help_and_version_load_neither_torch_nor_transformers():
    argvs = [["--help"], ["--version"], ["convert", "--help"], ["recover", "--help"], ["export-gguf", "--help"]]
    argvs.append(["info", "--help"])
    results = _run(argvs)
    for argv, result in zip(argvs, results):
        assert result["code"] == 0, (argv, result)
        assert result["heavy"] == [], (argv, result["heavy"])
    assert results[0]["out"].startswith("usage: hf-alibi")
    assert results[1]["out"].strip() == f"hf-alibi {_version()}"
    flags = ("--slope-scale", "--sinks", "--rotary-max-wavelength", "--position-mean", "--fit-slopes", "--fit-text")
    for flag in flags:
        assert flag in results[2]["out"]  # the conversion options' flags, from their declaration
    assert "--train-file" in results[3]["out"] and "q8_0" in results[4]["out"]


def test_errors_that_need_no_model_come_before_the_library(folders, tmp_path):
    cases = [
        (["convert", "no-such-folder/x/y", str(tmp_path / "a")], "SRC 'no-such-folder/x/y' is not a folder"),
        (["convert", "bad name/v1", str(tmp_path / "a")], "neither a folder nor a valid Hub id"),
        (["convert", folders["src"], folders["full"]], "exists and is not empty. Pass --overwrite"),
        (["convert", folders["src"], folders["src"] + "/out"], "overlaps SRC"),
        (["convert", folders["src"], str(tmp_path / "a"), "--fit-slopes", "--fit-text", "x"], "--fit-text 'x'"),
        (["convert", folders["src"], str(tmp_path / "a"), "--private"], "apply to the upload only"),
        (["convert", folders["src"], str(tmp_path / "a"), "--sinks", "x"], "argument --sinks: invalid int value"),
        (["convert", folders["src"]], "the following arguments are required: OUT"),
        (["recover", folders["src"], str(tmp_path / "a"), "--train_file", "nofile.txt"], "--train-file 'nofile.txt'"),
        (["recover", folders["src"], str(tmp_path / "a")], "the following arguments are required: --train-file"),
        (["export-gguf", folders["src"], folders["root"]], "is a folder: give the path of the .gguf file"),
        (
            ["export-gguf", folders["src"], folders["text"]],
            "exists: pass overwrite=True (hf-alibi export-gguf --overwrite)",
        ),
        (["export-gguf", "--outtype", "q4", folders["src"], "x.gguf"], "argument --outtype: invalid choice"),
        (["info", str(tmp_path / "missing")], "is not a folder"),
        (["info", folders["root"]], "has no config.json"),
        (["serve"], "serve needs MODEL first"),
        (["serve", str(tmp_path / "missing")], "MODEL"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ]
    results = _run([argv for argv, _ in cases])
    for (argv, message), result in zip(cases, results):
        assert result["code"] == 2, (argv, result)
        lines = result["err"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hf-alibi: error:") and message in lines[0], (argv, result)
        assert result["heavy"] == [], (argv, result["heavy"])
    assert (Path(folders["full"]) / "keep.txt").read_text() == "a user's file"
    assert not (tmp_path / "a").exists()
