"""A few Trainer steps on a converted GPT-2."""

import torch
from tiny import VOCAB, random_ids, tiny_gpt2
from transformers import Trainer, TrainingArguments

import hf_alibi
from hf_alibi.core.strategies import NoPositionEmbedding


class FixedTokens(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def test_every_parameter_gets_a_gradient():
    model = hf_alibi.patch_model(tiny_gpt2()).train()
    ids = random_ids(2, 24)
    model(ids, labels=ids).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert missing == []


def test_trainer_steps_reduce_the_loss_and_keep_wpe_gone(tmp_path):
    model = hf_alibi.patch_model(tiny_gpt2())
    # counting sequences (start, start + 1, ...): learnable in a few steps, only from context
    starts = random_ids(16, 1, seed=7)
    data = FixedTokens((starts + torch.arange(32)) % VOCAB)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=20, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 40
    assert losses[-1] < 0.5 * losses[0]
    assert losses[0] > 0.5 * torch.log(torch.tensor(float(VOCAB))).item()  # started from ~uniform
    assert isinstance(model.transformer.wpe, NoPositionEmbedding)
    assert hf_alibi.is_alibi_model(model)
    assert not any("wpe" in name for name in model.state_dict())
