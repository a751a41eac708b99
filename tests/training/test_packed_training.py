"""Padding-free training of converted models: transformers' ``DataCollatorWithFlattening`` through the Trainer,
and TRL's ``SFTTrainer`` with packing and padding-free batches, give the loss of the documents run alone.

The reference loss is written here: each document run alone through the converted model (no packing
involved), its next-token cross-entropy summed over documents and divided by the number of predicted tokens
(the collator masks the first token of every document, so no prediction crosses a boundary).
"""

from pathlib import Path

import datasets
import pytest
import torch
from arch_cases import CASES, VOCAB
from sharing import make_tokenizer
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

import hf_alibi

LENGTHS = (9, 23, 5, 31, 14, 40)  # documents; 122 tokens when packed (7.6x the tiny configs' 16)
DECODERS = [case for case in CASES if case.name in ("gpt2", "opt", "llama", "gpt_neox", "mistral")]


def documents(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in LENGTHS]


def loss_alone(model, docs) -> torch.Tensor:
    """Mean next-token cross-entropy over all documents, each run alone."""
    total, count = torch.zeros(()), 0
    for ids in docs:
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
        total = total + torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
        count += len(ids) - 1
    return total / count


def converted(case, conversion: dict):
    return hf_alibi.patch_model(case.make(attn_implementation="sdpa"), **conversion)


@pytest.mark.parametrize("conversion", [{}, {"sinks": 2}], ids=["paper", "sinks"])
@pytest.mark.parametrize("case", DECODERS, ids=[c.name for c in DECODERS])
def test_flattening_collator_loss_and_gradients_equal_documents_alone(case, conversion):
    model = converted(case, conversion).train()  # the tiny configs have no dropout
    docs = documents()
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    assert "attention_mask" not in batch and batch["position_ids"].shape == (1, sum(LENGTHS))
    packed = model(**batch, use_cache=False).loss
    packed.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = loss_alone(model, docs)
    reference.backward()
    torch.testing.assert_close(packed, reference, rtol=0, atol=1e-6)
    for mine, theirs in zip(packed_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_trainer_with_flattening_collator_evaluates_the_documents_alone(tmp_path):
    case = next(c for c in DECODERS if c.name == "llama")
    model = converted(case, {"sinks": 1})
    docs = documents(1)
    dataset = datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]})
    args = TrainingArguments(
        tmp_path / "out", per_device_eval_batch_size=len(docs), report_to=[], use_cpu=True, bf16=False
    )
    trainer = Trainer(model=model, args=args, eval_dataset=dataset, data_collator=DataCollatorWithFlattening())
    with torch.no_grad():
        reference = loss_alone(model, docs).item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(reference, abs=1e-6)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = Path(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = "w1"  # SFT appends it to every document
    return tokenizer


@pytest.mark.parametrize("case", [c for c in DECODERS if c.name in ("gpt2", "llama")], ids=["gpt2", "llama"])
def test_sft_trainer_packing_gives_the_unpacked_loss(case, word_tokenizer, tmp_path):
    trl = pytest.importorskip("trl")
    generator = torch.Generator().manual_seed(2)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=generator)) for n in LENGTHS]
    dataset = datasets.Dataset.from_dict({"text": texts})
    losses = {}
    for mode in ("padded", "packing", "padding_free"):
        model = converted(case, {"sinks": 1})  # the same seed: the same weights each time
        args = trl.SFTConfig(
            output_dir=str(tmp_path / mode), per_device_eval_batch_size=len(texts),
            max_length=None if mode == "padding_free" else 256,  # TRL: padding-free without packing does not cut
            packing=mode == "packing", eval_packing=mode == "packing", padding_free=mode == "padding_free",
            report_to=[], use_cpu=True, bf16=False, dataset_text_field="text",
        )  # fmt: skip
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=dataset, eval_dataset=dataset, processing_class=word_tokenizer
        )
        batch = next(iter(trainer.get_eval_dataloader()))
        assert ("attention_mask" in batch) == (mode == "padded")  # packed rows: position ids, no mask
        losses[mode] = trainer.evaluate()["eval_loss"]
    assert losses["packing"] == pytest.approx(losses["padded"], abs=1e-6)
    assert losses["padding_free"] == pytest.approx(losses["padded"], abs=1e-6)
