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


ENCODERS = [
    md("""
# Encoders: BERT and T5 with ALiBi

In a bidirectional encoder a query attends to keys on both sides, so the causal shortcut does not
apply. hf_alibi offers three encoder variants (`encoder_variant=`):

* `symmetric` (default): `-m_h * |i - j|`;
* `nonsymmetric`: the same penalty, but the first half of the heads sees only keys to the left
  (`j <= i`), the second half only keys to the right;
* `learned`: no mask, separate left and right slopes per head, trained with the model
  (`slope = -sigmoid(p)`, `p` initialised from `normal(-2, 1)`).

T5 gets the encoder variant in its encoder's self-attention, the causal bias in its decoder's
self-attention, and no position bias in cross-attention; its learned relative position bias is removed.
"""),
    code(SIZE_CELL),
    code("""
import copy

import matplotlib.pyplot as plt
import torch
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

import hf_alibi

torch.manual_seed(0)
bert_config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                         intermediate_size=128, max_position_embeddings=32)
bert = BertForMaskedLM(bert_config).eval()
variants = {v: hf_alibi.patch_model(copy.deepcopy(bert), encoder_variant=v) for v in ("symmetric", "nonsymmetric", "learned")}
for name, model in variants.items():
    print(f"{name:13s}", model.bert.encoder.layer[0].attention.self.alibi, "| position table:", model.bert.embeddings.position_embeddings)
"""),
    md("""
## The bias matrices of each variant

Rows are queries, columns keys; masked entries are white. Heads 0 and 3 are in the first half
(left-looking under `nonsymmetric`), heads 4 and 7 in the second half (right-looking).
"""),
    code("""
length, heads = 12, [0, 3, 4, 7]
fig, axes = plt.subplots(3, len(heads), figsize=(2.8 * len(heads), 8))
for row, (name, model) in enumerate(variants.items()):
    bias = model.bert.encoder.layer[0].attention.self.alibi(length, length, torch.device("cpu"), float("-inf"))[0]
    for col, h in enumerate(heads):
        ax = axes[row, col]
        ax.imshow(bias[h].detach().numpy(), cmap="viridis")
        ax.set_title(f"{name}, head {h}", fontsize=9)
        ax.set_xticks([]); ax.set_yticks([])
fig.tight_layout()
plt.show()

# symmetric: exactly -m_h |i - j| with the paper's slopes
slopes = torch.tensor(hf_alibi.get_slopes_list(8))
i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
symmetric = variants["symmetric"].bert.encoder.layer[0].attention.self.alibi(length, length, torch.device("cpu"), float("-inf"))[0]
assert torch.equal(symmetric, -slopes[:, None, None] * (i - j).abs())
"""),
    md("""
## The learned variant trains its slopes

Its slopes are parameters of the model (`alibi.slopes_left` / `alibi.slopes_right` per layer): an
optimiser updates them, and `save_pretrained` stores them with the weights.
"""),
    code("""
learned = variants["learned"].train()
print([name for name, _ in learned.named_parameters() if "slopes" in name])
attention = learned.bert.encoder.layer[0].attention.self.alibi
before = (-torch.sigmoid(attention.slopes_left)).detach().clone()
optimizer = torch.optim.AdamW(learned.parameters(), lr=1e-2)
ids = torch.randint(1, 100, (4, 24))
for step in range(5 if SIZE == "full" else 2):
    loss = learned(input_ids=ids, labels=ids).loss
    loss.backward(); optimizer.step(); optimizer.zero_grad()
after = (-torch.sigmoid(attention.slopes_left)).detach()
print("left slopes before:", [round(x, 4) for x in before.tolist()])
print("left slopes after: ", [round(x, 4) for x in after.tolist()])
assert not torch.equal(before, after)
learned.eval();
"""),
    md("""
## Longer than `max_position_embeddings`

The original BERT has 32 positions; the converted ones run on any length.
"""),
    code("""
long_ids = torch.randint(1, 100, (1, 4 * bert_config.max_position_embeddings))
try:
    bert(long_ids)
except (IndexError, RuntimeError) as error:
    print("original BERT:", type(error).__name__, str(error)[:70])
with torch.no_grad():
    for name, model in variants.items():
        logits = model(long_ids).logits
        print(f"{name:13s} {tuple(logits.shape)} finite={bool(torch.isfinite(logits).all())}")
"""),
    md("""
## T5

The encoder's self-attention gets the encoder variant, the decoder's self-attention the causal
bias, and cross-attention nothing (T5 itself had no position bias there either).
"""),
    code("""
torch.manual_seed(0)
t5_config = T5Config(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
                     pad_token_id=0, eos_token_id=1)
t5 = hf_alibi.patch_model(T5ForConditionalGeneration(t5_config).eval(), encoder_variant="symmetric")
block = t5.encoder.block[0]
print("encoder self-attention:", block.layer[0].SelfAttention.alibi)
print("decoder self-attention:", t5.decoder.block[0].layer[0].SelfAttention.alibi)
print("decoder cross-attention has a bias:", hasattr(t5.decoder.block[0].layer[1].EncDecAttention, "alibi"))
print("relative_attention_bias left:", [n for n, _ in t5.named_parameters() if "relative_attention_bias" in n])

fig, axes = plt.subplots(1, 2, figsize=(7, 3.2))
for ax, (title, module) in zip(axes, [("encoder, head 0", block.layer[0].SelfAttention),
                                      ("decoder, head 0", t5.decoder.block[0].layer[0].SelfAttention)]):
    ax.imshow(module.alibi(10, 10, torch.device("cpu"), float("-inf"))[0, 0].numpy(), cmap="viridis")
    ax.set_title(title)
fig.tight_layout()
plt.show()

source = torch.randint(2, 100, (1, 96))  # far past relative_attention_max_distance
generated = t5.generate(source, max_new_tokens=12 if SIZE == "full" else 6, do_sample=False)
print("generated:", generated[0].tolist())
"""),
    md("""
## Save and reload

The settings (`encoder_variant`, heads) and the learned slopes travel with the checkpoint.
"""),
    code("""
import tempfile
from transformers import AutoModelForMaskedLM

folder = tempfile.mkdtemp()
learned.save_pretrained(folder)
reloaded = AutoModelForMaskedLM.from_pretrained(folder).eval()
print(reloaded.config.alibi)
with torch.no_grad():
    assert torch.equal(reloaded(long_ids).logits, learned(long_ids).logits)
print("same logits after reload, learned slopes included")
"""),
]


TRAIN_SHORT_TEST_LONG = [
    md("""
# Train short, test long

The paper's claim: a model with ALiBi trained on sequences of length `L` keeps (or improves) its
perplexity on much longer inputs, while a model with learned position embeddings falls apart past `L`.

Here two small GPT-2s, identical but for the position path, are trained the same way on short
sequences of Python standard-library source code (a corpus built locally by `hf_alibi.data`), then
evaluated at `L`, `2L`, `4L` and `8L` with `hf_alibi.evaluation` (non-overlapping windows, the paper's
main protocol). The baseline's position table is made long enough for every evaluation length, but
only its first `L` rows are ever trained.
"""),
    code(SIZE_CELL),
    code("""
import math, tempfile

import matplotlib.pyplot as plt
import torch
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import hf_alibi
from hf_alibi.data import embedded_corpus, train_tokenizer
from hf_alibi.evaluation import evaluate_lengths

FULL = SIZE == "full"
L = 64 if FULL else 32              # training length
LENGTHS = [L, 2 * L, 4 * L, 8 * L]  # evaluation lengths
STEPS = 200 if FULL else 30
_ = torch.manual_seed(0)
"""),
    md("## Data: Python's standard library, tokenized with a small BPE"),
    code("""
import datasets
datasets.disable_progress_bars()
corpus = embedded_corpus()
train_texts = corpus["train"]["text"][: 400 if FULL else 60]
valid_texts = corpus["validation"]["text"][: 60 if FULL else 15]
tokenizer = train_tokenizer(train_texts, vocab_size=2048 if FULL else 512)
eos = tokenizer.eos_token_id

def stream(texts):
    ids = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [eos]
    return torch.tensor(ids)

train_ids, valid_ids = stream(train_texts), stream(valid_texts)[: (16 * 8 * L if FULL else 6 * 8 * L)]
blocks = train_ids[: len(train_ids) // L * L].view(-1, L)
train_dataset = [{"input_ids": block} for block in blocks]
print(f"{len(train_texts)} files, {len(train_ids):,} training tokens in {len(blocks)} blocks of {L}; "
      f"{len(valid_ids):,} validation tokens")
"""),
    md("## Two models, trained the same way at length `L`"),
    code("""
def make_model(alibi: bool):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, n_positions=max(LENGTHS),
                        vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    return hf_alibi.patch_model(model) if alibi else model


def train(model):
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=16,
                             learning_rate=1e-3, warmup_steps=STEPS // 10, lr_scheduler_type="cosine",
                             logging_steps=max(1, STEPS // 4), report_to=[], save_strategy="no", seed=0,
                             disable_tqdm=True, dataloader_pin_memory=False)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=collator)
    trainer.remove_callback(PrinterCallback)  # the losses are printed below
    trainer.train()
    return [round(entry["loss"], 3) for entry in trainer.state.log_history if "loss" in entry]


models = {"learned positions": make_model(alibi=False), "ALiBi": make_model(alibi=True)}
for name, model in models.items():
    print(f"{name}: training losses", train(model))
"""),
    md("## Perplexity against evaluation length"),
    code("""
results = {}
for name, model in models.items():
    out = evaluate_lengths(model, {"validation": valid_ids}, LENGTHS, protocols=("nonoverlapping",), batch_size=8)
    results[name] = [out["splits"]["validation"]["nonoverlapping"][str(n)]["perplexity"] for n in LENGTHS]

print(f"{'length':>8s}" + "".join(f"{name:>20s}" for name in results))
for k, n in enumerate(LENGTHS):
    print(f"{n:8d}" + "".join(f"{values[k]:20.2f}" for values in results.values()))
print("ppl(8L) / ppl(L):", {name: round(values[-1] / values[0], 3) for name, values in results.items()})

fig, ax = plt.subplots(figsize=(6, 4))
for name, values in results.items():
    ax.plot(LENGTHS, values, marker="o", label=name)
ax.axvline(L, color="grey", linestyle=":", label=f"training length {L}")
ax.set_xscale("log", base=2); ax.set_yscale("log")
ax.set_xlabel("evaluation length (tokens)"); ax.set_ylabel("validation perplexity")
ax.set_title("Train short, test long"); ax.legend()
fig.tight_layout()
plt.show()
"""),
    md("""
With learned positions, the rows of the table past `L` were never trained, and perplexity climbs as
soon as the inputs reach them. With ALiBi there is no table: the same fixed penalty applies at every
distance, and the longer context is usable. (The "full" run above takes a few minutes on a CPU; at the
paper's scale the same shape shows: see `ALIBI_NOTES.md`, and `scripts/run_clm.py` for real runs.)
"""),
    code("""
alibi, learned = results["ALiBi"], results["learned positions"]
if FULL:  # the claim, at this notebook's scale; the "ci" run is too short to train either model
    assert alibi[-1] / alibi[0] < learned[-1] / learned[0]
    assert alibi[-1] < learned[-1]
"""),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_train_short_test_long.ipynb": TRAIN_SHORT_TEST_LONG,
    "03_encoders.ipynb": ENCODERS,
    "04_convert_and_share.ipynb": CONVERT_AND_SHARE,
}
# What a notebook needs beyond the foundation (tests/test_notebooks.py skips it until present).
REQUIRES: dict[str, dict[str, tuple[str, ...]]] = {
    "02_train_short_test_long.ipynb": {"modules": ("hf_alibi.data", "hf_alibi.evaluation")},
    "03_encoders.ipynb": {"model_types": ("bert", "t5")},
}


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
