"""A few Trainer steps on every architecture: the loss falls and learned slopes train."""

import math

import pytest
import torch
from arch_cases import FULL_CASE_IDS as CASE_IDS  # the reduced cases skip training
from arch_cases import FULL_CASES as CASES
from tiny import VOCAB, random_ids
from transformers import Trainer, TrainingArguments

import hf_alibi

LENGTH = 32
RUN = 8
MASK = 1  # not BERT's pad token 0, whose embedding is fixed at zero


class Examples(torch.utils.data.Dataset):
    def __init__(self, examples: list[dict]):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def counting_examples(kind: str, n: int = 16) -> list[dict]:
    """Sequences start, start + 1, ... (mod VOCAB): learnable in a few steps, only from context."""
    ids = (random_ids(n, 1, seed=7) + torch.arange(LENGTH)) % VOCAB
    if kind == "decoder":
        return [{"input_ids": row, "labels": row} for row in ids]
    if kind == "seq2seq":  # the target is the source shifted by one
        return [{"input_ids": row, "labels": (row + 1) % VOCAB} for row in ids]
    # masked LM: rows of runs of RUN equal tokens, every 4th token hidden behind MASK (a different
    # phase per row): a hidden token is a copy of its nearest neighbours, mostly. (Tiny BERTs learn
    # the counting task above slowly without absolute positions, with or without ALiBi.)
    ids = random_ids(n, LENGTH // RUN, seed=7).repeat_interleave(RUN, dim=1)
    examples = []
    for index, row in enumerate(ids):
        hidden = torch.zeros(LENGTH, dtype=torch.bool)
        hidden[index % 4 :: 4] = True
        examples.append({"input_ids": row.masked_fill(hidden, MASK), "labels": row.masked_fill(~hidden, -100)})
    return examples


def learned_slopes(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if name.endswith(("slopes_left", "slopes_right"))}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_trainer_steps_reduce_the_loss_and_train_learned_slopes(case, tmp_path):
    variant = "learned" if case.bidirectional else None
    backend = "sdpa" if "sdpa" in case.backends else "eager"  # a CPU backend with a backward (not flex)
    model = hf_alibi.patch_model(case.make(attn_implementation=backend), encoder_variant=variant).train()
    data = counting_examples(case.kind)

    batch = {key: torch.stack([example[key] for example in data[:4]]) for key in data[0]}
    model(**batch).loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert no_grad == []  # learned slopes included
    model.zero_grad()
    slopes = learned_slopes(model)
    assert bool(slopes) == (variant == "learned")
    before = {name: p.detach().clone() for name, p in slopes.items()}

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=15, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Examples(data))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 30
    assert losses[0] > 0.5 * math.log(VOCAB)  # started from about uniform
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses  # BERT, slowest here: 4.6 to about 3.3
    assert hf_alibi.is_alibi(model)
    removed = ("wpe", "position_embeddings", "embed_positions", "relative_attention")
    assert not any(word in name for name in model.state_dict() for word in removed)  # still gone
    for name, p in learned_slopes(model).items():
        assert not torch.equal(p.detach(), before[name]), f"{name} did not change"
