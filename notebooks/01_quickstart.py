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
# # Quickstart: ALiBi on a GPT-2
#
# [ALiBi](https://arxiv.org/abs/2108.12409) (Press, Smith and Lewis, *Train Short, Test Long*) removes
# the position embeddings of a transformer and adds a fixed, head-specific penalty `-m_h * (i - j)` to
# each attention score instead. `hf_alibi.patch_model` does that to a transformers model in place.
#
# This notebook builds a small GPT-2 from a config (nothing is downloaded), converts it, looks at the
# bias of a few heads, runs it past its original `n_positions`, generates, and saves and reloads it.

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
import matplotlib.pyplot as plt
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import hf_alibi

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_head=8, n_embd=64, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0)
original = GPT2LMHeadModel(config).eval()
print("position table:", original.transformer.wpe)

# %% [markdown]
# ## Convert
#
# `patch_model` changes only this instance: `wpe` is replaced by a module that adds nothing, and each
# self-attention layer gets an `AlibiBias` that transformers' attention interface adds to the scores.

# %%
import copy

model = hf_alibi.patch_model(copy.deepcopy(original))
print(type(model).__name__, "| model_type:", model.config.model_type)
print("settings:", model.config.alibi)
print("slopes m_h:", [round(s, 5) for s in hf_alibi.get_slopes_list(8)])
print(model.transformer.h[0].attn.alibi)

# %% [markdown]
# ## The bias matrices
#
# Each head `h` adds `-m_h * (i - j)` to the score of query `i` and key `j <= i`; keys after the query
# are masked (white). Steep heads look only at the last few tokens, shallow heads far back.
# `hf_alibi.alibi_bias` builds the bias the converted layers add (`"causal"` here; the encoders' forms in
# the encoders notebook) from the slopes `hf_alibi.get_slopes` gives.

# %%
settings = hf_alibi.get_settings(model.config)  # what config.json stores
bias = hf_alibi.alibi_bias("causal", 16, 16, hf_alibi.get_slopes(settings.heads), masked_value=float("-inf"))
bias = bias[0]  # (heads, q, kv)
heads = [0, 2, 5, 7]
fig, axes = plt.subplots(1, len(heads), figsize=(3.2 * len(heads), 3))
for ax, h in zip(axes, heads):
    image = ax.imshow(bias[h].numpy(), cmap="viridis")
    ax.set_title(f"head {h}: m = {hf_alibi.get_slopes_list(8)[h]:.4g}")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    fig.colorbar(image, ax=ax, fraction=0.046)
fig.tight_layout()
plt.show()

# The same numbers from the paper's formula, written out
slopes = torch.tensor(hf_alibi.get_slopes_list(8))
i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
expected = torch.where(j <= i, -slopes[:, None, None] * (i - j), float("-inf"))
assert torch.equal(bias, expected)

# %% [markdown]
# ## Past `n_positions`
#
# The original model has a table of 64 positions and fails beyond it; the converted one has no table.

# %%
length = 4 * config.n_positions if SIZE == "full" else 2 * config.n_positions
ids = torch.randint(1, config.vocab_size, (1, length))
try:
    original(ids)
except (IndexError, RuntimeError) as error:
    print("original GPT-2 at", length, "tokens:", type(error).__name__, str(error)[:80])
with torch.no_grad():
    logits = model(ids).logits
print("ALiBi GPT-2 at", length, "tokens:", tuple(logits.shape), "finite:", bool(torch.isfinite(logits).all()))

# %% [markdown]
# ## Generate
#
# With the KV cache each new query sits at the end of the keys, and the bias follows it: greedy
# generation with and without the cache gives the same tokens. (The model is untrained, so the tokens
# themselves mean nothing; see the "train short, test long" notebook for a trained one.)

# %%
prompt = torch.tensor([[5, 17, 42, 8]])
n_new = 80 if SIZE == "full" else 20
cached = model.generate(prompt, max_new_tokens=n_new, do_sample=False)
uncached = model.generate(prompt, max_new_tokens=n_new, do_sample=False, use_cache=False)
print(cached[0].tolist())
assert torch.equal(cached, uncached)

# %% [markdown]
# ## Save and reload
#
# `save_pretrained` writes `model_type: "alibi_gpt2"` and the settings in config.json, plus the code
# and `auto_map` that let people without hf_alibi load it with `trust_remote_code=True`, and a model card.
# After `import hf_alibi`, the Auto classes rebuild the same model.

# %%
import json
import os
import tempfile

folder = tempfile.mkdtemp()
model.save_pretrained(folder)
print(sorted(os.listdir(folder)))
saved = json.load(open(os.path.join(folder, "config.json")))
print({key: saved[key] for key in ("model_type", "alibi", "n_positions")})

reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
with torch.no_grad():
    assert torch.equal(reloaded(ids).logits, logits)
print("reloaded:", type(reloaded).__name__, "- same logits at", length, "tokens")
