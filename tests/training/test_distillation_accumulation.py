"""DistillationTrainer under gradient accumulation: its loss is a per-batch mean, so the Trainer must divide
it by the accumulation steps (recover/trainer.py's loss_is_per_batch_mean, for every transformers 5.x)."""

import copy

import pytest
import torch
from tiny import random_ids, tiny_gpt2
from transformers import TrainerCallback, TrainingArguments

import hf_alibi
from hf_alibi.recover import DistillationTrainer, distillation_loss


class GradientAtStep(TrainerCallback):
    """The accumulated gradient of every parameter just before the optimizer step."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def first_step_gradient(teacher, student, data, tmp_path, batch, accumulation, lm_weight):
    args = TrainingArguments(
        output_dir=str(tmp_path / f"t{batch}x{accumulation}"), max_steps=1, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, max_grad_norm=0.0, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, remove_unused_columns=False, seed=0,
    )  # fmt: skip
    hook = GradientAtStep(student)
    trainer = DistillationTrainer(
        model=student, teacher=teacher, args=args, train_dataset=data, lm_weight=lm_weight, callbacks=[hook]
    )
    trainer.train()
    return hook.grads


@pytest.mark.parametrize("lm_weight", [0.0, 0.5])
def test_two_accumulated_halves_give_the_full_batch_gradient(tmp_path, lm_weight):
    torch.set_num_threads(1)
    teacher = tiny_gpt2()
    student = hf_alibi.patch_model(copy.deepcopy(teacher)).requires_grad_(True)
    ids = random_ids(4, 16, seed=5)
    data = [{"input_ids": row, "labels": row} for row in ids]

    # the reference, by hand: the loss of the whole batch of 4, backward once
    reference = copy.deepcopy(student).train()
    with torch.no_grad():
        target = teacher.eval()(input_ids=ids)
    out = reference(input_ids=ids, labels=ids)
    loss = distillation_loss(out, target, "causal")
    loss = (1 - lm_weight) * loss + lm_weight * out.loss if lm_weight else loss
    loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    full = first_step_gradient(teacher, copy.deepcopy(student), data, tmp_path, 4, 1, lm_weight)
    halves = first_step_gradient(teacher, copy.deepcopy(student), data, tmp_path, 2, 2, lm_weight)
    assert full.keys() == halves.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().item()
        assert torch.allclose(full[name], expected[name], atol=1e-6 * max(scale, 1.0)), name
        # without the division the accumulated gradient would be twice the reference
        assert torch.allclose(halves[name], expected[name], atol=1e-5 * max(scale, 1.0)), name
