"""Write the walkthrough notebooks (sources only) and optionally execute them in place.

    python notebooks/build.py            # write the .ipynb files from the cell sources below
    python notebooks/build.py --execute  # ... then run each top to bottom, keeping outputs

The committed notebooks are the executed ones. Edit the sources here, not in the .ipynb, so that
the notebooks stay reviewable as code. ``HF_ALIBI_NOTEBOOK_SIZE=ci`` makes every notebook small
(tests/test_notebooks.py runs them that way).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).parent

SIZE_CELL = """import os, warnings
# "full" (default): a few minutes at most on a laptop CPU. "ci": the tests' quick run.
SIZE = os.environ.get("HF_ALIBI_NOTEBOOK_SIZE", "full")
assert SIZE in ("full", "ci"), SIZE
warnings.filterwarnings("ignore", message="IProgress not found")
import transformers
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()"""


def md(text: str):
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text: str):
    return nbformat.v4.new_code_cell(text.strip())


QUICKSTART = [
    md("""
# Quickstart: ALiBi on a GPT-2

[ALiBi](https://arxiv.org/abs/2108.12409) (Press, Smith and Lewis, *Train Short, Test Long*) removes
the position embeddings of a transformer and adds a fixed, head-specific penalty `-m_h * (i - j)` to
each attention score instead. `hf_alibi.patch_model` does that to a transformers model in place.

This notebook builds a small GPT-2 from a config (nothing is downloaded), converts it, looks at the
bias of a few heads, runs it past its original `n_positions`, generates, and saves and reloads it.
"""),
    code(SIZE_CELL),
    code("""
import torch
import matplotlib.pyplot as plt
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import hf_alibi

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_head=8, n_embd=64, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0)
original = GPT2LMHeadModel(config).eval()
print("position table:", original.transformer.wpe)
"""),
    md("""
## Convert

`patch_model` changes only this instance: `wpe` is replaced by a module that adds nothing, and each
self-attention layer gets an `AlibiBias` that transformers' attention interface adds to the scores.
"""),
    code("""
import copy

model = hf_alibi.patch_model(copy.deepcopy(original))
print(type(model).__name__, "| model_type:", model.config.model_type, "| attention:", model.config._attn_implementation)
print("settings:", model.config.alibi)
print("slopes m_h:", [round(s, 5) for s in hf_alibi.get_slopes_list(8)])
print(model.transformer.h[0].attn.alibi)
"""),
    md("""
## The bias matrices

Each head `h` adds `-m_h * (i - j)` to the score of query `i` and key `j <= i`; keys after the query
are masked (white). Steep heads look only at the last few tokens, shallow heads far back.
"""),
    code("""
bias = model.transformer.h[0].attn.alibi(16, 16, torch.device("cpu"), float("-inf"))[0]  # (heads, q, kv)
heads = [0, 2, 5, 7]
fig, axes = plt.subplots(1, len(heads), figsize=(3.2 * len(heads), 3))
for ax, h in zip(axes, heads):
    image = ax.imshow(bias[h].numpy(), cmap="viridis")
    ax.set_title(f"head {h}: m = {hf_alibi.get_slopes_list(8)[h]:.4g}")
    ax.set_xlabel("key j"); ax.set_ylabel("query i")
    fig.colorbar(image, ax=ax, fraction=0.046)
fig.tight_layout()
plt.show()

# The same numbers from the paper's formula, written out
slopes = torch.tensor(hf_alibi.get_slopes_list(8))
i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
expected = torch.where(j <= i, -slopes[:, None, None] * (i - j), float("-inf"))
assert torch.equal(bias, expected)
"""),
    md("""
## Past `n_positions`

The original model has a table of 64 positions and fails beyond it; the converted one has no table.
"""),
    code("""
length = 4 * config.n_positions if SIZE == "full" else 2 * config.n_positions
ids = torch.randint(1, config.vocab_size, (1, length))
try:
    original(ids)
except (IndexError, RuntimeError) as error:
    print("original GPT-2 at", length, "tokens:", type(error).__name__, str(error)[:80])
with torch.no_grad():
    logits = model(ids).logits
print("ALiBi GPT-2 at", length, "tokens:", tuple(logits.shape), "finite:", bool(torch.isfinite(logits).all()))
"""),
    md("""
## Generate

With the KV cache each new query sits at the end of the keys, and the bias follows it: greedy
generation with and without the cache gives the same tokens. (The model is untrained, so the tokens
themselves mean nothing; see the "train short, test long" notebook for a trained one.)
"""),
    code("""
prompt = torch.tensor([[5, 17, 42, 8]])
n_new = 80 if SIZE == "full" else 20
cached = model.generate(prompt, max_new_tokens=n_new, do_sample=False)
uncached = model.generate(prompt, max_new_tokens=n_new, do_sample=False, use_cache=False)
print(cached[0].tolist())
assert torch.equal(cached, uncached)
"""),
    md("""
## Save and reload

`save_pretrained` writes `model_type: "alibi_gpt2"` and the settings in config.json, plus the code
and `auto_map` that let people without hf_alibi load it with `trust_remote_code=True`, and a model card.
After `import hf_alibi`, the Auto classes rebuild the same model.
"""),
    code("""
import json, os, tempfile

folder = tempfile.mkdtemp()
model.save_pretrained(folder)
print(sorted(os.listdir(folder)))
saved = json.load(open(os.path.join(folder, "config.json")))
print({key: saved[key] for key in ("model_type", "alibi", "n_positions")})

reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
with torch.no_grad():
    assert torch.equal(reloaded(ids).logits, logits)
print("reloaded:", type(reloaded).__name__, "- same logits at", length, "tokens")
"""),
]


CONVERT_AND_SHARE = [
    md("""
# Convert and share a checkpoint

`hf-alibi convert SRC OUT` converts a checkpoint (a folder, or a Hub id) and writes a folder that
anyone can load: with hf_alibi installed, or without it through the code stored in the checkpoint
(`trust_remote_code=True`). `hf-alibi info` tells what a checkpoint is. `--push-to-hub REPO_ID` uploads
the result (not run here: this notebook stays offline).

The source here is a small GPT-2 with a word-level tokenizer, built and saved locally.
"""),
    code(SIZE_CELL),
    code("""
import os, subprocess, sys, tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

work = Path(tempfile.mkdtemp())
src, out = work / "tiny-gpt2", work / "tiny-gpt2-alibi"

torch.manual_seed(0)
layers = 4 if SIZE == "full" else 2
config = GPT2Config(n_layer=layers, n_head=4, n_embd=64, n_positions=32, vocab_size=100, bos_token_id=0, eos_token_id=0)
GPT2LMHeadModel(config).save_pretrained(src)
vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 100)}}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(src)
print(sorted(os.listdir(src)))


def hf_alibi_cli(*args):
    # `hf-alibi ...` in a shell; `python -m hf_alibi` is the same command
    result = subprocess.run([sys.executable, "-m", "hf_alibi", *map(str, args)], capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if line.startswith("hf-alibi:")]  # not progress bars
    print("\\n".join([f"$ hf-alibi {' '.join(map(str, args))}", result.stdout.strip(), *errors]).strip(), "\\n")
    return result.returncode
"""),
    md("## `hf-alibi convert`"),
    code("""
assert hf_alibi_cli("convert", src, out) == 0
"""),
    code("""
assert hf_alibi_cli("info", out) == 0
assert hf_alibi_cli("info", src) == 0
"""),
    md("""
Bad input is an error that says what to do, and nothing is written: an existing `OUT` needs
`--overwrite`, an encoder variant makes no sense for GPT-2, an unknown folder is not a checkpoint.
"""),
    code("""
assert hf_alibi_cli("convert", src, out) == 2
assert hf_alibi_cli("convert", src, work / "other", "--encoder-variant", "learned") == 2
assert hf_alibi_cli("convert", work / "missing", work / "other") == 2
assert not (work / "other").exists()
"""),
    md("""
## The model card

`README.md` carries the Hub's metadata header (tags `alibi`, `hf_alibi`, the base architecture; the
base model when the source is a Hub id), how to load the checkpoint, and the conversion settings.
"""),
    code("""
from huggingface_hub import ModelCard

card = ModelCard.load(out / "README.md")
print(card.data.to_yaml())
print("...")
print(card.text[card.text.index("## Conversion settings"):])
assert "alibi" in card.data.tags
"""),
    md("""
## Loading it without hf_alibi

The folder holds `modeling_alibi.py` (torch and transformers only; read it before trusting it) and
`auto_map` entries pointing there. A fresh Python process that *cannot* import hf_alibi loads it with
`trust_remote_code=True` and gives the same logits as hf_alibi; without the flag, transformers refuses.
"""),
    code("""
import json

print(json.dumps(json.load(open(out / "config.json"))["auto_map"], indent=1))
print(sum(1 for _ in open(out / "modeling_alibi.py")), "lines in modeling_alibi.py")

import hf_alibi  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(out)
ids = tokenizer(" ".join(f"w{i % 99 + 1}" for i in range(96)), return_tensors="pt")["input_ids"]  # 3x n_positions
with torch.no_grad():
    expected = AutoModelForCausalLM.from_pretrained(out)(ids).logits
torch.save({"ids": ids, "logits": expected}, work / "expected.pt")

child = f'''
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
'''
env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
print("\\n".join(line[line.index("> ") + 2 :] for line in result.stdout.splitlines() if "> " in line))
assert result.returncode == 0, result.stderr[-2000:]
"""),
    md("""
## Pushing to the Hub

```bash
hf auth login   # or export HF_TOKEN=...
hf-alibi convert openai-community/gpt2 gpt2-alibi --push-to-hub me/gpt2-alibi --private
```

From Python, `model.push_to_hub("me/gpt2-alibi")` on a converted model uploads the same folder
(weights, config with the settings and `auto_map`, `modeling_alibi.py`, model card). Offline, the
push fails with an error that says nothing was uploaded and where the converted checkpoint is.
"""),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "04_convert_and_share.ipynb": CONVERT_AND_SHARE,
}
# What a notebook needs beyond the foundation (tests/test_notebooks.py skips it until present).
REQUIRES: dict[str, dict[str, tuple[str, ...]]] = {}


def build(names=None) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        if names and name not in names:
            continue
        notebook = nbformat.v4.new_notebook(cells=cells)
        notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        notebook.metadata["language_info"] = {"name": "python"}
        path = HERE / name
        nbformat.write(notebook, path)
        paths.append(path)
    return paths


def execute(path: Path, timeout: int = 600) -> None:
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(notebook, path)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--execute"]
    for path in build(args):
        if "--execute" in sys.argv:
            execute(path)
        print("wrote", path)
