"""hf-alibi serve on a transformers older than the server its request checks were made for: one line, before MODEL
loads (CI's default tier on transformers 5.19 runs this; on 5.24 and later it is skipped)."""

import subprocess
import sys

import pytest
import transformers
from packaging import version
from sharing import make_tokenizer
from test_vllm import tiny_llama

from hf_alibi.serve.server import SERVER_CHECKED

pytestmark = pytest.mark.skipif(
    version.parse(transformers.__version__) >= version.parse(SERVER_CHECKED),
    reason=f"transformers {transformers.__version__}: hf-alibi serve runs (tests/serve/test_serve*.py)",
)


def test_serve_on_an_older_transformers_is_one_line(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "m")
    make_tokenizer(tmp_path / "m")
    code = "import sys, hf_alibi.cli; sys.exit(hf_alibi.cli.main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", code, "serve", str(tmp_path / "m"), "--port", "8000"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith("hf-alibi: error: hf-alibi serve checks and bounds requests for transformers 5.24")
    assert "--engine vllm" in lines[0]
