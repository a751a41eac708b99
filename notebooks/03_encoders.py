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
# # Encoders: BERT and T5 with ALiBi
#
# In a bidirectional encoder a query attends to keys on both sides, so the causal shortcut does not
# apply. hf_alibi offers three encoder variants (`encoder_variant=`):
#
# * `symmetric` (default): `-m_h * |i - j|`;
# * `nonsymmetric`: the same penalty, but the first half of the heads sees only keys to the left
#   (`j <= i`), the second half only keys to the right;
# * `learned`: no mask, separate left and right slopes per head, trained with the model
#   (`slope = -sigmoid(p)`, `p` initialised from `normal(-2, 1)`).
#
# T5 gets the encoder variant in its encoder's self-attention, the causal bias in its decoder's
# self-attention, and no position bias in cross-attention; its learned relative position bias is removed.

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
import copy

import matplotlib.pyplot as plt
import torch
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

import hf_alibi

torch.manual_seed(0)
bert_config = BertConfig(
    vocab_size=100,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    intermediate_size=128,
    max_position_embeddings=32,
)
bert = BertForMaskedLM(bert_config).eval()
variants = {
    v: hf_alibi.patch_model(copy.deepcopy(bert), encoder_variant=v) for v in ("symmetric", "nonsymmetric", "learned")
}
for name, model in variants.items():
    print(
        f"{name:13s}",
        model.bert.encoder.layer[0].attention.self.alibi,
        "| position table:",
        model.bert.embeddings.position_embeddings,
    )

# %% [markdown]
# ## The bias matrices of each variant
#
# Rows are queries, columns keys; masked entries are white. Heads 0 and 3 are in the first half
# (left-looking under `nonsymmetric`), heads 4 and 7 in the second half (right-looking).
# `hf_alibi.alibi_bias(variant, ...)` builds each form: from the paper's slopes (`hf_alibi.get_slopes`), or
# for `learned` from the layer's own slopes, `-sigmoid` of its parameters.


# %%
def bias_of(model, length: int) -> torch.Tensor:
    """The bias of the first layer of a converted BERT, (heads, q, kv)."""
    settings = hf_alibi.get_settings(model.config)
    if settings.encoder_variant == "learned":
        alibi = model.bert.encoder.layer[0].attention.self.alibi
        left, right = -torch.sigmoid(alibi.slopes_left), -torch.sigmoid(alibi.slopes_right)
        return hf_alibi.alibi_bias("learned", length, length, left, slopes_right=right)[0]
    slopes = hf_alibi.get_slopes(settings.heads)
    return hf_alibi.alibi_bias(settings.encoder_variant, length, length, slopes, masked_value=float("-inf"))[0]


length, heads = 12, [0, 3, 4, 7]
fig, axes = plt.subplots(3, len(heads), figsize=(2.8 * len(heads), 8))
for row, (name, model) in enumerate(variants.items()):
    bias = bias_of(model, length)
    for col, h in enumerate(heads):
        ax = axes[row, col]
        ax.imshow(bias[h].detach().numpy(), cmap="viridis")
        ax.set_title(f"{name}, head {h}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
fig.tight_layout()
plt.show()

# symmetric: exactly -m_h |i - j| with the paper's slopes
slopes = torch.tensor(hf_alibi.get_slopes_list(8))
i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
assert torch.equal(bias_of(variants["symmetric"], length), -slopes[:, None, None] * (i - j).abs())

# %% [markdown]
# ## The learned variant trains its slopes
#
# Its slopes are parameters of the model (`alibi.slopes_left` / `alibi.slopes_right` per layer): an
# optimiser updates them, and `save_pretrained` stores them with the weights.

# %%
learned = variants["learned"].train()
print([name for name, _ in learned.named_parameters() if "slopes" in name])
attention = learned.bert.encoder.layer[0].attention.self.alibi
before = (-torch.sigmoid(attention.slopes_left)).detach().clone()
optimizer = torch.optim.AdamW(learned.parameters(), lr=1e-2)
ids = torch.randint(1, 100, (4, 24))
for _ in range(5 if SIZE == "full" else 2):
    loss = learned(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
after = (-torch.sigmoid(attention.slopes_left)).detach()
print("left slopes before:", [round(x, 4) for x in before.tolist()])
print("left slopes after: ", [round(x, 4) for x in after.tolist()])
assert not torch.equal(before, after)
learned.eval()

# %% [markdown]
# ## Longer than `max_position_embeddings`
#
# The original BERT has 32 positions; the converted ones run on any length.

# %%
long_ids = torch.randint(1, 100, (1, 4 * bert_config.max_position_embeddings))
try:
    bert(long_ids)
except (IndexError, RuntimeError) as error:
    print("original BERT:", type(error).__name__, str(error)[:70])
with torch.no_grad():
    for name, model in variants.items():
        logits = model(long_ids).logits
        print(f"{name:13s} {tuple(logits.shape)} finite={bool(torch.isfinite(logits).all())}")

# %% [markdown]
# ## T5
#
# The encoder's self-attention gets the encoder variant, the decoder's self-attention the causal
# bias, and cross-attention nothing (T5 itself had no position bias there either).

# %%
torch.manual_seed(0)
t5_config = T5Config(
    vocab_size=100,
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)
t5 = hf_alibi.patch_model(T5ForConditionalGeneration(t5_config).eval(), encoder_variant="symmetric")
block = t5.encoder.block[0]
print("encoder self-attention:", block.layer[0].SelfAttention.alibi)
print("decoder self-attention:", t5.decoder.block[0].layer[0].SelfAttention.alibi)
print("decoder cross-attention has a bias:", hasattr(t5.decoder.block[0].layer[1].EncDecAttention, "alibi"))
print("relative_attention_bias left:", [n for n, _ in t5.named_parameters() if "relative_attention_bias" in n])

fig, axes = plt.subplots(1, 2, figsize=(7, 3.2))
t5_slopes = hf_alibi.get_slopes(t5_config.num_heads)
for ax, kind in zip(axes, ["symmetric", "causal"]):
    bias = hf_alibi.alibi_bias(kind, 10, 10, t5_slopes, masked_value=float("-inf"))[0, 0]
    ax.imshow(bias.numpy(), cmap="viridis")
    ax.set_title(f"{'encoder' if kind == 'symmetric' else 'decoder'} ({kind}), head 0")
fig.tight_layout()
plt.show()

source = torch.randint(2, 100, (1, 96))  # far past relative_attention_max_distance
generated = t5.generate(source, max_new_tokens=12 if SIZE == "full" else 6, do_sample=False)
print("generated:", generated[0].tolist())

# %% [markdown]
# ## Save and reload
#
# The settings (`encoder_variant`, heads) and the learned slopes travel with the checkpoint.

# %%
import tempfile

from transformers import AutoModelForMaskedLM

folder = tempfile.mkdtemp()
learned.save_pretrained(folder)
reloaded = AutoModelForMaskedLM.from_pretrained(folder).eval()
print(reloaded.config.alibi)
with torch.no_grad():
    assert torch.equal(reloaded(long_ids).logits, learned(long_ids).logits)
print("same logits after reload, learned slopes included")
