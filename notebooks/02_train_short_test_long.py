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
# # Train short, test long
#
# The paper's claim: a model with ALiBi trained on sequences of length `L` keeps (or improves) its
# perplexity on much longer inputs, while a model with learned position embeddings falls apart past `L`.
#
# Here two small GPT-2s, identical but for the position path, are trained the same way on short
# sequences of Python standard-library source code (a corpus built locally by `hf_alibi.train.data`), then
# evaluated at `L`, `2L`, `4L` and `8L` with `hf_alibi.evaluate` (non-overlapping windows, the paper's
# main protocol). The baseline's position table is made long enough for every evaluation length, but
# only its first `L` rows are ever trained.

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
import tempfile

import matplotlib.pyplot as plt
import torch
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import hf_alibi
from hf_alibi.evaluate import evaluate_lengths
from hf_alibi.train.data import embedded_corpus, train_tokenizer

FULL = SIZE == "full"
L = 64 if FULL else 32  # training length
LENGTHS = [L, 2 * L, 4 * L, 8 * L]  # evaluation lengths
STEPS = 200 if FULL else 30
_ = torch.manual_seed(0)

# %% [markdown]
# ## Data: Python's standard library, tokenized with a small BPE

# %%
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
print(
    f"{len(train_texts)} files, {len(train_ids):,} training tokens in {len(blocks)} blocks of {L}; "
    f"{len(valid_ids):,} validation tokens"
)


# %% [markdown]
# ## Two models, trained the same way at length `L`


# %%
def make_model(alibi: bool):
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=128,
        n_positions=max(LENGTHS),
        vocab_size=len(tokenizer),
        bos_token_id=eos,
        eos_token_id=eos,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    return hf_alibi.patch_model(model) if alibi else model


def train(model):
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=STEPS,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        warmup_steps=STEPS // 10,
        lr_scheduler_type="cosine",
        logging_steps=max(1, STEPS // 4),
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=collator)
    trainer.remove_callback(PrinterCallback)  # the losses are printed below
    trainer.train()
    return [round(entry["loss"], 3) for entry in trainer.state.log_history if "loss" in entry]


models = {"learned positions": make_model(alibi=False), "ALiBi": make_model(alibi=True)}
for name, model in models.items():
    print(f"{name}: training losses", train(model))

# %% [markdown]
# ## Perplexity against evaluation length

# %%
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
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("evaluation length (tokens)")
ax.set_ylabel("validation perplexity")
ax.set_title("Train short, test long")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# With learned positions, the rows of the table past `L` were never trained, and perplexity climbs as
# soon as the inputs reach them. With ALiBi there is no table: the same fixed penalty applies at every
# distance, and the longer context is usable. (The "full" run above takes a few minutes on a CPU. Larger
# runs, against rotary positions too: [docs/benchmarks.md](../docs/benchmarks.md#train-short-test-long);
# training your own with `scripts/run_clm.py`: [docs/training.md](../docs/training.md).)

# %%
alibi, learned = results["ALiBi"], results["learned positions"]
if FULL:  # the claim, at this notebook's scale; the "ci" run is too short to train either model
    assert alibi[-1] / alibi[0] < learned[-1] / learned[0]
    assert alibi[-1] < learned[-1]
