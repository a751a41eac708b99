"""lm-evaluation-harness on a converted folder, as docs/pretrained.md runs it (``--model hf --model_args
pretrained=FOLDER,trust_remote_code=True``): a real lm-eval task (a last-word task from a local task file, as lambada
is written) on a tiny GPT-2 and on its conversion, each against the task's figures computed here from the model's own
logits. Slow tier: it needs ``pip install lm-eval`` (not in ``.[dev]``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_compare import byte_tokenizer, tiny_gpt2

import hf_alibi

pytestmark = pytest.mark.slow

SENTENCES = [
    "The fox jumps over the lazy dog",
    "A cat sleeps on the warm mat",
    "Rain falls on the old town",
    "She reads a book by the fire",
    "The sun rises over the hills",
    "We walk along the quiet river",
]

TASK = """task: hf_alibi_last_word
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _by_hand(model) -> dict[str, float]:
    """The task's figures from the model's logits: the last word's log-likelihood after the rest of its sentence
    (one token per byte), its perplexity over the sentences, and whether greedy decoding gives it (acc)."""
    logliks, greedy = [], []
    for sentence in SENTENCES:
        context, _, last = sentence.rpartition(" ")
        ids = torch.tensor(list(f"{context} {last}".encode()))
        start = len(context.encode())
        with torch.no_grad():
            logits = model(input_ids=ids[None, :-1]).logits[0, start - 1 :].double()
        targets = ids[start:]
        logliks.append(logits.log_softmax(-1).gather(1, targets[:, None]).sum().item())
        greedy.append(bool((logits.argmax(-1) == targets).all()))
    return {"perplexity": math.exp(-sum(logliks) / len(logliks)), "acc": sum(greedy) / len(greedy)}


def test_lm_eval_runs_a_converted_folder_as_transformers_runs_it(tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    model, tokenizer = tiny_gpt2(), byte_tokenizer()
    tokenizer.eos_token = "\n"
    original, converted = tmp_path / "original", tmp_path / "converted"
    model.save_pretrained(original)
    tokenizer.save_pretrained(original)
    expected = {"original": _by_hand(model)}
    hf_alibi.patch_model(model, preset="pretrained")
    model.save_pretrained(converted)
    tokenizer.save_pretrained(converted)
    expected["converted"] = _by_hand(model)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "last_word.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    (tasks / "last_word.yaml").write_text(TASK.format(data=data))
    manager = TaskManager(include_path=str(tasks))
    got = {}
    for name, folder in (("original", original), ("converted", converted)):
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32",
            tasks=["hf_alibi_last_word"],
            task_manager=manager,
            device="cpu",
            batch_size=1,
        )
        figures = results["results"]["hf_alibi_last_word"]
        got[name] = {"perplexity": figures["perplexity,none"], "acc": figures["acc,none"]}
        assert got[name]["perplexity"] == pytest.approx(expected[name]["perplexity"], rel=1e-4), name
        assert got[name]["acc"] == expected[name]["acc"], name
    # the conversion is a different model (its figures moved) that keeps close to its original: the mean
    # log-likelihood of a last word (a random tiny model's: about -28 nats, several bytes) within 2%
    assert got["converted"]["perplexity"] != got["original"]["perplexity"]
    assert math.log(got["converted"]["perplexity"]) == pytest.approx(math.log(got["original"]["perplexity"]), rel=0.02)
