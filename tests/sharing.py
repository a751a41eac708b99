"""Helpers of the sharing tests (CLI, remote code, Hub): tiny models per architecture, a local tokenizer,
child processes that cannot import hf_alibi, folder hashes; a free port and torch's thread count for any test."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import tiny
import torch
from tiny import VOCAB

import hf_alibi

REPO_ROOT = Path(__file__).resolve().parent.parent

try:  # the registry's parametrized cases (tests/arch_cases.py), when present
    from arch_cases import FULL_CASES as CASES  # the reduced cases skip persistence and remote code
except ImportError:
    CASES = None


@dataclass(frozen=True)
class Tiny:
    """One tiny configuration to test sharing on: ``make()`` builds the unpatched model."""

    name: str
    model_type: str
    make: Callable[[], torch.nn.Module]
    variants: tuple[str | None, ...]  # encoder variants to test (None: decoder-only)


if CASES is None:
    TINY = [Tiny("gpt2", "gpt2", lambda: tiny.tiny_gpt2(n_positions=32), (None,))]
else:
    TINY = [Tiny(case.name, case.model_type, case.make, case.variants) for case in CASES]
# One configuration per model type, for the CLI (default settings).
TINY_BY_TYPE = {}
for _tiny in TINY:
    TINY_BY_TYPE.setdefault(_tiny.model_type, _tiny)


def example_inputs(model_type: str, model) -> dict:
    """Inputs with padding (left for causal models, right for encoders) so the mask merge is exercised."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 12), generator=generator)  # within the originals' 16 positions
    mask = torch.ones_like(ids)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        mask[1, 9:] = 0
        inputs["decoder_input_ids"] = torch.randint(1, VOCAB, (2, 10), generator=generator)
    elif getattr(model.config, "is_decoder", False) or not hf_alibi.get_architecture(model_type).bidirectional:
        mask[1, :4] = 0
    else:
        mask[1, 9:] = 0
    return inputs


def output_tensor(output) -> torch.Tensor:
    """The main output of any head: logits when present, else the last hidden state."""
    for name in ("logits", "prediction_logits", "start_logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    raise AssertionError(f"no tensor output in {type(output).__name__}")


def make_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of VOCAB tokens (built locally: nothing can be downloaded), saved in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>")
    tokenizer.save_pretrained(folder)


def folder_hash(folder: Path) -> str:
    """sha256 over every file's relative path, bytes and mode: any change to ``folder`` changes it."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
            digest.update(str(path.stat().st_mode).encode())
    return digest.hexdigest()


# Run before the child's code: hf_alibi cannot be imported, whatever installs it (the editable install's
# meta-path finder, PYTHONPATH, the cwd).
BLOCK_HF_ALIBI = """
import importlib.abc, sys
class _NoHfAlibi(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_alibi" or name.startswith("hf_alibi."):
            raise ImportError("hf_alibi is blocked in this process")
sys.meta_path.insert(0, _NoHfAlibi())
try:
    import hf_alibi
    raise SystemExit("hf_alibi could be imported: the test would prove nothing")
except ImportError:
    pass
"""


def run_child(
    code: str, cwd: Path, hf_home: Path, block_hf_alibi: bool, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python; with ``block_hf_alibi`` the child cannot import hf_alibi."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "HF_HUB_OFFLINE")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if not block_hf_alibi:
        env["PYTHONPATH"] = str(REPO_ROOT)
    code = (BLOCK_HF_ALIBI if block_hf_alibi else "") + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,  # transformers asks on stdin whether to trust remote code
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_json_line(stdout: str) -> dict:
    line = stdout.strip().splitlines()[-1]
    return json.loads(line[line.index("{") :])  # transformers' trust prompt may precede it on the line


def run_cli(*argv, capsys) -> tuple[int, str, str]:
    """``hf-alibi ARGV`` in this process: (exit code, stdout, stderr), progress bars before it dropped."""
    from hf_alibi import cli

    capsys.readouterr()
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def check_cli_convert(src, out, flags: tuple, info_line: str, expected, ids: torch.Tensor, capsys) -> None:
    """``hf-alibi convert SRC OUT FLAGS`` succeeds, ``hf-alibi info OUT`` prints ``info_line``, and the masked LM
    loaded from OUT gives ``expected``'s logits on ``ids`` (``expected``: the same conversion in Python)."""
    import transformers

    code, _, err = run_cli("convert", src, out, *flags, capsys=capsys)
    assert code == 0, err
    code, stdout, _ = run_cli("info", out, capsys=capsys)
    assert info_line in stdout, stdout
    with torch.no_grad():
        converted = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
        torch.testing.assert_close(converted(ids).logits, expected(ids).logits, rtol=0, atol=1e-5)


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    """``python -c CODE`` (dedented) in ``cwd``, with this checkout's hf_alibi importable, no stdin."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,  # transformers asks on stdin whether to trust the checkpoint's remote code
    )  # fmt: skip


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a launcher's --master_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block, and given back after it (a skip or failure too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


MASKED_PATHS = (("eager", "auto"), ("sdpa", "folded"), ("sdpa", "bias"))  # every CPU path a padded batch can take


def assert_every_path_matches(model, ids, mask, expected, tolerance: float = 2e-5, after=None) -> None:
    """``model``'s logits on ``ids`` with ``mask`` equal ``expected`` at the real tokens on each of ``MASKED_PATHS``
    (the backend set, the ALiBi path forced); ``after(backend, path)``, where given, checks more after each."""
    import hf_alibi

    real = mask.bool()
    for backend, path in MASKED_PATHS:
        model.set_attn_implementation(backend)
        hf_alibi.set_attention_path(model, path)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert (logits[real] - expected[real]).abs().max() < tolerance, (backend, path)
        if after is not None:
            after(backend, path)
