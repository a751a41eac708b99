# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Convert and share a checkpoint
#
# `hf-alibi convert SRC OUT` converts a checkpoint (a folder, or a Hub id) and writes a folder that
# anyone can load: with hf_alibi installed, or without it through the code stored in the checkpoint
# (`trust_remote_code=True`). `hf-alibi info` tells what a checkpoint is. `--push-to-hub REPO_ID` uploads
# the result (not run here: this notebook stays offline).
#
# The source here is a small GPT-2 with a word-level tokenizer, built and saved locally.

# %%
import os
import warnings

# "full" (default): a few minutes at most on a laptop CPU. "ci": the tests' quick run.
SIZE = os.environ.get("HF_ALIBI_NOTEBOOK_SIZE", "full")
assert SIZE in ("full", "ci"), SIZE
warnings.filterwarnings("ignore", message="IProgress not found")
import transformers

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

# %%
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

work = Path(tempfile.mkdtemp())
src, out = work / "tiny-gpt2", work / "tiny-gpt2-alibi"

torch.manual_seed(0)
layers = 4 if SIZE == "full" else 2
config = GPT2Config(
    n_layer=layers, n_head=4, n_embd=64, n_positions=32, vocab_size=100, bos_token_id=0, eos_token_id=0
)
GPT2LMHeadModel(config).save_pretrained(src)
vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 100)}}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(src)
print(sorted(os.listdir(src)))


def hf_alibi_cli(*args):
    # `hf-alibi ...` in a shell; `python -m hf_alibi` is the same command. Everything it prints is shown,
    # stdout then stderr, and the exit status.
    result = subprocess.run([sys.executable, "-m", "hf_alibi", *map(str, args)], capture_output=True, text=True)
    print(f"$ hf-alibi {' '.join(map(str, args))}")
    print(result.stdout + result.stderr, end="")
    print(f"(exit status {result.returncode})\n")
    return result.returncode


# %% [markdown]
# ## `hf-alibi convert`

# %%
assert hf_alibi_cli("convert", src, out) == 0

# %%
assert hf_alibi_cli("info", out) == 0
assert hf_alibi_cli("info", src) == 0

# %% [markdown]
# Bad input is an error that says what to do, and nothing is written: an existing `OUT` needs
# `--overwrite`, an encoder variant makes no sense for GPT-2, an unknown folder is not a checkpoint.

# %%
assert hf_alibi_cli("convert", src, out) == 2
assert hf_alibi_cli("convert", src, work / "other", "--encoder-variant", "learned") == 2
assert hf_alibi_cli("convert", work / "missing", work / "other") == 2
assert not (work / "other").exists()

# %% [markdown]
# ## The model card
#
# `README.md` carries the Hub's metadata header (tags `alibi`, `hf_alibi`, the base architecture; the
# base model when the source is a Hub id), how to load the checkpoint, and the conversion settings.

# %%
from huggingface_hub import ModelCard

card = ModelCard.load(out / "README.md")
print(card.data.to_yaml())
print("...")
print(card.text[card.text.index("## Conversion settings") :])
assert "alibi" in card.data.tags

# %% [markdown]
# ## Loading it without hf_alibi
#
# The folder holds `modeling_alibi.py`, a short entry module, and the modules it imports: hf_alibi's own
# `core` package, byte for byte (torch and transformers only; read it before trusting it), with `auto_map`
# entries pointing there. A fresh Python process that *cannot* import hf_alibi loads it with
# `trust_remote_code=True` and gives the same logits as hf_alibi; without the flag, transformers refuses.

# %%
import json

print(json.dumps(json.load(open(out / "config.json"))["auto_map"], indent=1))
import hf_alibi

core = Path(hf_alibi.__file__).parent / "core"
code = sorted(path.name for path in out.glob("*.py"))
print(len(code), "code files:", ", ".join(code))
assert all((out / name).read_bytes() == (core / name).read_bytes() for name in code)  # the library's own files
print(sum(1 for _ in open(out / "modeling_alibi.py")), "lines in the entry module modeling_alibi.py")

from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(out)
ids = tokenizer(" ".join(f"w{i % 99 + 1}" for i in range(96)), return_tensors="pt")["input_ids"]  # 3x n_positions
with torch.no_grad():
    expected = AutoModelForCausalLM.from_pretrained(out)(ids).logits
torch.save({"ids": ids, "logits": expected}, work / "expected.pt")

child = f"""
import importlib.abc, sys
class NoHfAlibi(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hf_alibi":
            raise ImportError("hf_alibi is not installed here")
sys.meta_path.insert(0, NoHfAlibi())
import torch, transformers
try:
    import hf_alibi
except ImportError as error:
    print("> import hf_alibi:", error)
try:
    transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})
except ValueError as error:
    print("> without trust_remote_code:", str(error).splitlines()[-1])
model = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
print("> with trust_remote_code:", type(model).__name__, "from", type(model).__module__)
expected = torch.load({str(work / "expected.pt")!r})
with torch.no_grad():
    diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()
print("> max |logits - hf_alibi's| =", diff)
assert diff <= 1e-5
"""
env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
result = subprocess.run(
    [sys.executable, "-c", child], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL
)
print("\n".join(line[line.index("> ") + 2 :] for line in result.stdout.splitlines() if "> " in line))
assert result.returncode == 0, result.stderr[-2000:]

# %% [markdown]
# ## What the conversion kept: `hf-alibi compare`
#
# `hf-alibi compare ORIGINAL CONVERTED ...` measures the models on the same tokens: perplexity at each length,
# perplexity by position along one stream (through the KV cache), passkey retrieval. It prints one table (each figure
# and its ratio to the first model's), and writes `compare.json` (every figure) and `compare.png`. The original
# GPT-2 cannot run past its 32 learned positions: its row says why instead of a number. (Passkey retrieval needs
# digits, which this word-level tokenizer lacks: `--passkey-lengths` with no length leaves it out.)

# %%
import random

rng = random.Random(0)
text = work / "text.txt"
text.write_text(" ".join(f"w{rng.randint(1, 99)}" for _ in range(2000)))
report = work / "compare"
compare_args = ["--text", text, "--lengths", 16, 32, 64, 128, "--max-tokens", 512, "--passkey-lengths"]
assert hf_alibi_cli("compare", src, out, *compare_args, "--out", report) == 0
results = json.loads((report / "compare.json").read_text())
print({m["label"]: m["perplexity"]["nonoverlapping"]["128"] for m in results["models"]})

# %% [markdown]
# The plot: perplexity against length (left) and by position along the stream (right), each model's native length
# dotted. From Python, `hf_alibi.evaluate.compare([...])` returns the same figures.

# %%
from IPython.display import Image

Image(filename=str(report / "compare.png"))

# %% [markdown]
# ## Pushing to the Hub
#
# ```bash
# hf auth login   # or export HF_TOKEN=...
# hf-alibi convert openai-community/gpt2 gpt2-alibi --push-to-hub me/gpt2-alibi --private
# ```
#
# From Python, `model.push_to_hub("me/gpt2-alibi")` on a converted model uploads the same folder
# (weights, config with the settings and `auto_map`, `modeling_alibi.py`, model card). Offline, the
# push fails with an error that says nothing was uploaded and where the converted checkpoint is.
