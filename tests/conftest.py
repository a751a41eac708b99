import os
import sys
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
# Child processes (fresh-process reload tests) import this checkout's hf_alibi, not another install.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

# Tiny models on the shared 2-core machine: a second intra-op thread only waits on the first (under load the
# Trainer-step tests ran about 9x slower with two). One thread here and, through the environment, in every
# child process (run_child, run_python, the scripts), unless OMP_NUM_THREADS says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests assert the warnings a user sees at transformers' default verbosity (the notice that a resumed checkpoint
# continues as ALiBi, the one warning docs/sharing.md quotes): a user's TRANSFORMERS_VERBOSITY=error would hide them
# here and in every child process, so the suite runs at the default, whatever the shell sets.
os.environ.pop("TRANSFORMERS_VERBOSITY", None)
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def gpt2_src(tmp_path):
    """An unpatched tiny GPT-2 checkpoint with a tokenizer, as a user would have it on disk (the CLI tests)."""
    from sharing import TINY_BY_TYPE, make_tokenizer

    src = tmp_path / "src"
    TINY_BY_TYPE["gpt2"].make().save_pretrained(src)
    make_tokenizer(src)
    return src


@pytest.fixture
def attention_forwards(monkeypatch):
    """``attention_forwards()``: the AlibiForward of each forward run since, in order, as the attention calls of
    the mask-taking backends (eager, sdpa) read it, whether it came through their keyword arguments or, where a
    caller dropped those (StableLM, Nemotron), from the running forward."""
    from hf_alibi.core import dispatch
    from hf_alibi.core.forward import forward_of

    seen = {}

    def recording(alibi, kwargs):
        forward = forward_of(alibi, kwargs)
        if forward is not None:
            seen.setdefault(id(forward), forward)
        return forward

    monkeypatch.setattr(dispatch, "forward_of", recording)
    return lambda: list(seen.values())
