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
# # A converted model among the usual tools
#
# A converted model is an ordinary transformers model of class `Alibi<Class>`, so the tools built on
# transformers take it as it is. This notebook pretrains a tiny GPT-2 here (learned positions, 32 of them),
# converts it with the `"pretrained"` preset, recovers it by distillation from the original, and then
# runs the result through `pipeline`, `AutoModel` with hidden states, a PEFT LoRA fine-tune (merged),
# and `torch.compile`; last, a converted BERT inside a sentence-transformers model.
# Everything is built from configs and local text: nothing is downloaded.

# %%
import os
import warnings

# "full" (default): about a minute of CPU time (inductor's first build included). "ci": the tests' quick run.
SIZE = os.environ.get("HF_ALIBI_NOTEBOOK_SIZE", "full")
assert SIZE in ("full", "ci"), SIZE
FULL = SIZE == "full"
warnings.filterwarnings("ignore", message="IProgress not found")
import transformers

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

# %% [markdown]
# ## A small pretrained GPT-2
#
# Python's standard library is the text (`hf_alibi.train.data` builds the corpus locally), with a small BPE.

# %%
import copy
import tempfile
from pathlib import Path

import datasets
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_alibi
from hf_alibi.recover import next_token_kl, recover, token_stream
from hf_alibi.train.data import embedded_corpus, train_tokenizer

datasets.disable_progress_bars()
L = 32  # the original's positions
work = Path(tempfile.mkdtemp())
corpus = embedded_corpus()
texts = corpus["train"]["text"][: 40 if FULL else 15]
tokenizer = train_tokenizer(texts, vocab_size=384)
train_ids = token_stream(texts, tokenizer)  # (tokens,)
held_out = token_stream(corpus["validation"]["text"][:10], tokenizer)[: 1024 + 1]
blocks = train_ids[: len(train_ids) // L * L].view(-1, L)  # (blocks, L)

torch.manual_seed(0)
config = GPT2Config(
    n_layer=2, n_head=4, n_embd=64, n_positions=L, vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=0
)
original = GPT2LMHeadModel(config)
steps = 150 if FULL else 30
optimizer = torch.optim.AdamW(original.parameters(), lr=3e-3)
schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
order = torch.Generator().manual_seed(0)
for _ in range(steps):
    batch = blocks[torch.randint(len(blocks), (16,), generator=order)]
    loss = original(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
original.eval()
print(f"pretrained {steps} steps x 16 x {L} tokens; last loss {loss.item():.3f}")

# %% [markdown]
# ## Converting a pretrained checkpoint: `preset="pretrained"`
#
# `patch_model(model)` is the paper's method, for training from scratch. On a checkpoint that was
# pretrained with positions, `preset="pretrained"` keeps more of what it knew: the first token is an
# attention sink (no distance penalty), the slopes are a hundredth of the paper's, on rotary models every
# rotary frequency stays, the long ones slowed past the trained length (GPT-2 has none), and a learned
# table's mean (its first 128 rows) stays in the token embeddings. Both convert a copy here; the KL
# of their next-token distributions to the original's, on held-out text at the original length, says how
# far each moved.

# %%
paper = hf_alibi.patch_model(copy.deepcopy(original)).eval()
preset = hf_alibi.patch_model(copy.deepcopy(original), preset="pretrained").eval()
settings = hf_alibi.get_settings(preset.config)
names = ("sinks", "slope_scale", "rotary_max_wavelength", "position_mean")
print("preset settings:", {k: getattr(settings, k) for k in names})
kl = {"paper": next_token_kl(paper, original, held_out, L), "preset": next_token_kl(preset, original, held_out, L)}
print("KL(original || converted) per token:", {name: round(value, 4) for name, value in kl.items()})

# The preset's bias in head 0 (paper slope 1/4 for 4 heads): x 0.01, and key 0 free of any penalty
assert settings.sinks == 1 and settings.slope_scale == 0.01
scaled = 0.01 * hf_alibi.get_slopes(4)
bias = hf_alibi.alibi_bias("causal", 8, 8, scaled, masked_value=float("-inf"), sinks=1)[0, 0]
print(bias)
i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
expected = torch.where(j <= i, torch.where(j < 1, 0.0, -0.01 * 2.0**-2 * (i - j)), float("-inf"))
assert torch.allclose(bias, expected)

# %% [markdown]
# ## Recovering it: `hf_alibi.recover.recover`
#
# Distillation from the original on the same kind of text, at the original length: a converted copy
# (the student) learns to give the original's next-token distributions. The agreement is printed before,
# during and after: the KL to the original, perplexities at `L` and the student's at 2, 4 and 8 x `L`
# (which the original cannot run). With a preset, `recover` first fits the slopes per layer and head:
# the original's heads are run once on the training text, and each gets `0.1 / its mean attention distance`
# (`hf_alibi.fit_slopes`). A few steps here; see [docs/recovery.md](../docs/recovery.md) for real runs and
# the command line (`hf-alibi recover`).

# %%
result = recover(
    original,
    train_ids,
    max_steps=40 if FULL else 8,
    batch_size=8,
    learning_rate=1e-4,
    eval_texts=held_out,
    max_eval_tokens=1024,
    progress=False,
)
before, after = result.history[0], result.final
print("slopes:", result.info["slopes"])
fitted = hf_alibi.get_settings(result.student.config).slopes
assert len(fitted) == original.config.n_layer and len(fitted[0]) == original.config.n_head
if FULL:  # the "ci" run is too short to move it
    assert after["kl"] < before["kl"]
recovered = work / "gpt2-alibi-recovered"
result.student.save_pretrained(recovered)
tokenizer.save_pretrained(recovered)
print(type(result.student).__name__, "saved:", sorted(p.name for p in recovered.iterdir())[:6], "...")

# %% [markdown]
# ## `pipeline("text-generation")`
#
# The saved folder loads through the Auto classes (after `import hf_alibi`), so `pipeline` takes its
# path. The prompt and the new tokens together run past the original's 32 positions. The text is what a
# tiny model trained for seconds writes; what matters is that it is the model's own greedy output.

# %%
from transformers import AutoModelForCausalLM, pipeline

generator = pipeline("text-generation", model=str(recovered), tokenizer=str(recovered))
prompt = "def read_file(path):\n    with open(path) as f:\n"
out = generator(prompt, max_new_tokens=48, do_sample=False, return_full_text=False)[0]["generated_text"]
print(repr(prompt + out))  # repr: the spaces and newlines it writes show

model = AutoModelForCausalLM.from_pretrained(recovered).eval()
prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
greedy = model.generate(prompt_ids, max_new_tokens=48, do_sample=False)
assert prompt_ids.shape[1] + 48 > L
assert tokenizer.decode(greedy[0, prompt_ids.shape[1] :]) == out

# %% [markdown]
# ## A base model with its hidden states
#
# `AutoModel` gives the converted base model (`AlibiGPT2Model`, no LM head), here at 4 x `L`.
# GPT-2 ties its output layer to the input embeddings, so the last hidden state times the embedding
# matrix must be the LM's logits.

# %%
from transformers import AutoModel

base = AutoModel.from_pretrained(recovered).eval()
ids = held_out[None, : 4 * L]  # (1, 4L)
with torch.no_grad():
    hidden = base(ids, output_hidden_states=True)
    logits = model(ids).logits
print(
    type(base).__name__,
    "|",
    len(hidden.hidden_states),
    "hidden states of shape",
    tuple(hidden.last_hidden_state.shape),
)
assert len(hidden.hidden_states) == config.n_layer + 1
torch.testing.assert_close(hidden.last_hidden_state @ base.wte.weight.T, logits, rtol=0, atol=1e-4)

# %% [markdown]
# ## PEFT: LoRA on a converted model, merged
#
# LoRA adapters on the attention projection (`c_attn`), trained a few steps at 2 x `L`, a length the
# original never saw, then merged into the weights: the merged model is the same ALiBi model class
# with the adapters' effect, and saves like any converted checkpoint.

# %%
from peft import LoraConfig, get_peft_model

lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
peft_model = get_peft_model(copy.deepcopy(model), lora)
peft_model.print_trainable_parameters()
long_blocks = train_ids[: len(train_ids) // (2 * L) * 2 * L].view(-1, 2 * L)  # (blocks, 2L)
optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
peft_model.train()
for step in range(10 if FULL else 3):
    batch = long_blocks[step * 8 : (step + 1) * 8]
    peft_model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
peft_model.eval()
with torch.no_grad():
    adapted = peft_model(ids).logits
merged = peft_model.merge_and_unload()
with torch.no_grad():
    merged_logits = merged(ids).logits
print(type(merged).__name__, "| ALiBi:", hf_alibi.is_alibi(merged))
print("max |merged - adapter| =", (merged_logits - adapted).abs().max().item())
print("max |merged - before LoRA| =", (merged_logits - logits).abs().max().item())
assert hf_alibi.is_alibi(merged) and not torch.equal(merged_logits, logits)
torch.testing.assert_close(merged_logits, adapted, rtol=0, atol=1e-4)
merged.save_pretrained(work / "merged")
with torch.no_grad():
    assert torch.equal(AutoModelForCausalLM.from_pretrained(work / "merged").eval()(ids).logits, merged_logits)

# %% [markdown]
# ## `torch.compile`
#
# A converted model compiles like the original (one graph, no break). The compiled model's logits equal
# the eager ones. The default backend, inductor, builds C++ kernels on a CPU (tens of seconds the first
# time); the quick "ci" run takes the `aot_eager` backend, which traces the same graph without that build.

# %%
compiled = torch.compile(model) if FULL else torch.compile(model, backend="aot_eager")
with torch.no_grad():
    compiled_logits = compiled(ids).logits
print("max |compiled - eager| =", (compiled_logits - logits).abs().max().item())
torch.testing.assert_close(compiled_logits, logits, rtol=0, atol=1e-4)

# %% [markdown]
# ## sentence-transformers on a converted BERT
#
# A BERT converted to ALiBi (symmetric bias) and saved with a tokenizer made here is an ordinary
# `Transformer` module for sentence-transformers; with mean pooling it is a sentence encoder for texts
# longer than the original's 16 positions. (This BERT is untrained: the point is the plumbing, checked
# against mean pooling written out below.)

# %%
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from transformers import BertConfig, BertModel, BertTokenizerFast

words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"the a cat dog sat on mat ran far and slept in sun".split()]
(work / "vocab.txt").write_text("\n".join(words) + "\n")
bert_tokenizer = BertTokenizerFast(str(work / "vocab.txt"))
torch.manual_seed(0)
bert_config = BertConfig(
    vocab_size=len(words),
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=16,
)
bert = hf_alibi.patch_model(BertModel(bert_config)).eval()
bert.save_pretrained(work / "bert-alibi")
bert_tokenizer.save_pretrained(work / "bert-alibi")

transformer = Transformer(str(work / "bert-alibi"), max_seq_length=256)
encoder = SentenceTransformer(modules=[transformer, Pooling(bert_config.hidden_size, "mean")], device="cpu")
sentences = ["the cat sat on the mat", " ".join(["the dog ran far and slept in the sun"] * 6)]
embeddings = encoder.encode(sentences, convert_to_tensor=True)
batch = bert_tokenizer(sentences, padding=True, return_tensors="pt")
print(
    encoder[0].model.__class__.__name__,
    "| tokens:",
    batch["attention_mask"].sum(1).tolist(),
    "| embeddings:",
    tuple(embeddings.shape),
)

with torch.no_grad():
    states = bert(**batch).last_hidden_state  # (B, T, hidden)
mask = batch["attention_mask"][..., None].float()  # (B, T, 1)
assert batch["input_ids"].shape[1] > bert_config.max_position_embeddings
torch.testing.assert_close(embeddings, (states * mask).sum(1) / mask.sum(1), rtol=0, atol=1e-5)
