"""The command line answers before the library loads: ``hf-alibi --help``, ``JOB --help``, ``--version``
and every error about arguments or paths that needs no model run without importing torch or transformers.

What is asserted is the cause of the wait, not a time: one fresh interpreter runs the entry point of the ``hf-alibi``
script (``hf_alibi.cli.main``) on each command line and reports, after each, its exit status, what it printed and
whether torch or transformers were imported. ``benchmarks/import_time.py`` prints the times.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import contextlib, io, json, sys
import hf_alibi.cli
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = hf_alibi.cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("startup")
    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_head": 4}))
    for name, config in {"bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"]},
                         "wide": {"model_type": "gpt2", "vocab_size": 300},
                         "narrow": {"model_type": "gpt2", "vocab_size": 256}}.items():  # fmt: skip
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    full = root / "full"
    full.mkdir()
    (full / "keep.txt").write_text("a user's file")
    text = root / "text.txt"
    text.write_text("some text")
    return {"src": str(src), "full": str(full), "text": str(text), "root": str(root), "bert": str(root / "bert"),
            "wide": str(root / "wide"), "narrow": str(root / "narrow")}  # fmt: skip


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
    argvs += [["info", "--help"], ["compare", "--help"]]
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
    assert "--max-tokens" in results[6]["out"] and "--passkey-lengths" in results[6]["out"]


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
        (["compare", folders["src"], str(tmp_path / "missing")], "MODEL '" + str(tmp_path / "missing") + "' is not a"),
        (["compare", folders["src"], "--text", "nofile.txt"], "--text 'nofile.txt' is not a file"),
        (["compare", folders["src"], "--text", folders["text"], "--dataset", "x"], "--text and --dataset both"),
        (["compare", folders["src"], folders["bert"]], "is not a causal LM (config.json: BertForMaskedLM)"),
        (["compare", folders["narrow"], folders["wide"]], "vocabularies differ (vocab_size: "),
        (["compare", folders["src"], "--lengths", "0"], "argument --lengths: invalid positive integer value"),
    ]
    _assert_one_line_errors(cases)
    assert (Path(folders["full"]) / "keep.txt").read_text() == "a user's file"
    assert not (tmp_path / "a").exists()


def _assert_one_line_errors(cases: list) -> None:
    # each command line answers exit 2 and one line in the parser's form holding its message, torch not imported
    results = _run([argv for argv, _ in cases])
    for (argv, message), result in zip(cases, results):
        assert result["code"] == 2, (argv, result)
        lines = result["err"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hf-alibi: error:") and message in lines[0], (argv, result)
        assert result["heavy"] == [], (argv, result["heavy"])


def test_value_errors_come_before_the_library(folders, tmp_path):
    """The conversion options' values, checked as the library checks them (from SRC's config.json and its row),
    and serve's port, cap and engine: in the parser's form, exit 2, torch not imported."""
    out = str(tmp_path / "a")
    convert = ["convert", folders["src"], out]
    cases = [
        ([*convert, "--sinks", "-1"], "sinks must be an integer >= 0"),
        ([*convert, "--heads", "3"], "--heads 3 does not match SRC's 4 attention heads"),
        ([*convert, "--slopes", "1,2"], "slopes must list one slope per head: 4 numbers, got 2"),
        ([*convert, "--slopes", "0.5,0.25,0.1,-1"], "slopes must be finite numbers > 0"),
        ([*convert, "--slope-scale", "0.5", "--slopes", "1,1,1,1"], "either slopes or slope_scale"),
        ([*convert, "--rotary-max-wavelength", "100"], "rotary_max_wavelength applies to rotary models only"),
        ([*convert, "--table-max-wavelength", "1"], "table_max_wavelength must be a number >= 2"),
        ([*convert, "--encoder-variant", "symmetric"], "applies to bidirectional attention only"),
        (["serve", folders["src"], "--port", "abc"], "argument --port: invalid port 'abc'"),
        (["serve", folders["src"], "--port=70000"], "argument --port: invalid port '70000'"),
        (["serve", folders["src"], "--max-new-tokens-cap", "0"], "--max-new-tokens-cap takes a positive number"),
        (["serve", folders["src"], "--engine", "sglang"], "argument --engine: invalid choice 'sglang'"),
        (
            ["serve", folders["src"], "--engine", "vllm", "--max-prompt-tokens", "9"],
            "--max-prompt-tokens is transformers' server's: with --engine vllm a prompt is bounded by vLLM's "
            "--max-model-len.",
        ),
        (
            ["serve", folders["src"], "--max-concurrent-requests", "0"],
            "--max-concurrent-requests takes a positive number of requests (got '0')",
        ),
    ]
    _assert_one_line_errors(cases)
    assert not (tmp_path / "a").exists()


def test_python_m_hf_alibi_answers_before_torch(folders, tmp_path):
    """``python -m hf_alibi`` imports the package before its __main__: help and errors still come first."""
    for argv, code, text in [
        (["--help"], 0, "usage: hf-alibi"),
        (["convert", folders["src"], str(tmp_path / "a"), "--sinks", "-1"], 2, "hf-alibi: error: sinks must be"),
        (["convert", "no-such-folder/x/y", str(tmp_path / "a")], 2, "hf-alibi: error: SRC 'no-such-folder/x/y'"),
    ]:
        child = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "hf_alibi", *argv],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
        )  # fmt: skip
        assert child.returncode == code, (argv, child.stderr[-2000:])
        answer = child.stdout if code == 0 else child.stderr
        assert text in answer, (argv, answer[-2000:])
        # -X importtime writes "import time: self | cumulative | module" for each module imported
        imported = {line.rsplit("|", 1)[-1].strip() for line in child.stderr.splitlines() if "import time:" in line}
        assert not imported & {"torch", "transformers"}, argv
        assert "hf_alibi.cli.parser" in imported  # the command line ran (a sanity check of the reading above)
