"""recover(): bounded default lengths, the conversion preset, LoRA merged at the end, resume from a checkpoint."""

import copy
import json

import pytest
import torch
from sharing import make_tokenizer, run_cli
from tiny import random_ids, tiny_bert, tiny_gpt2

import hf_alibi
from hf_alibi.recover import recover, recovery_card_section
from hf_alibi.recover.lengths import resolve_lengths
from hf_alibi.recover.settings import check_settings


def test_default_lengths_are_bounded_and_say_so():
    smol = resolve_lengths(8192)  # SmolLM2: train at 512, agreement at 512, 1024, 2048
    assert (smol.length, smol.factors) == (512, (1, 2, 4))
    assert any("capped at 512" in n for n in smol.notes) and any("4096 capped" in n for n in smol.notes)
    assert any("no agreement past the original length 8192" in n for n in smol.notes)
    minilm = resolve_lengths(512)  # 512 inside, 1024 and 2048 past the original
    assert (minilm.length, minilm.factors) == (512, (1, 2, 4)) and not any("past" in n for n in minilm.notes)
    tiny = resolve_lengths(16)
    assert (tiny.length, tiny.factors, tiny.notes) == (16, (1, 2, 4, 8), ())
    assert resolve_lengths(8192, length=256, max_eval_length=None).factors == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="pass length"):
        resolve_lengths(None)


def test_check_settings_refuses_a_length_past_the_teacher():
    with pytest.raises(ValueError, match="length 64 is longer than the original model's 32 positions"):
        check_settings(32, length=64)
    check_settings(32, length=32, learning_rate=1e-3, lora_rank=0, preset="paper")  # all fine: no error


def run(teacher, stream, **kw):
    settings = dict(length=16, max_steps=6, batch_size=4, learning_rate=3e-3, progress=False, log=None)
    settings.update(kw)
    return recover(teacher, stream, **settings)


def test_preset_pretrained_is_the_default_and_paper_the_old_behaviour():
    teacher, stream = tiny_gpt2(), random_ids(1, 800, seed=4).reshape(-1)
    default = run(teacher, stream, max_steps=1)
    settings = hf_alibi.get_settings(default.student.config)
    assert settings.sinks == 1 and default.info["preset"] == "pretrained"
    # the slopes: fitted by the teacher on the first training tokens (its 16 positions), per layer and head
    assert settings.slopes == hf_alibi.fit_slopes(teacher, stream[:16], sinks=1) and settings.slope_scale == 1.0
    assert default.info["slopes"].startswith("fitted per layer and head")
    uniform = hf_alibi.get_settings(run(teacher, stream, max_steps=1, fit_slopes=False).student.config)
    assert (uniform.sinks, uniform.slope_scale, uniform.slopes) == (1, 0.01, None)
    paper = hf_alibi.get_settings(run(teacher, stream, max_steps=1, preset="paper").student.config)
    assert (paper.sinks, paper.slope_scale) == (0, 1.0)
    assert hf_alibi.get_settings(run(teacher, stream, max_steps=1, preset=None).student.config).sinks == 0


@pytest.mark.parametrize(
    "make, options, rate",
    [
        (tiny_gpt2, {}, 1e-5),  # the preset keeps a causal LM close: a small step
        (tiny_gpt2, {"lora_rank": 2}, 2e-4),  # LoRA: 20 x
        (tiny_gpt2, {"preset": "paper"}, 2e-4),  # the paper's conversion starts far
        (tiny_bert, {}, 1e-4),  # an encoder loses more in the conversion
    ],
)
def test_the_default_learning_rate_follows_the_start(make, options, rate):
    """With no learning_rate: the rates docs/recovery.md measured, reaching the Trainer and the card."""
    result = run(make(), random_ids(1, 800, seed=4).reshape(-1), max_steps=1, learning_rate=None, **options)
    assert result.info["learning_rate"] == rate
    assert f"| learning rate | {rate} |" in recovery_card_section(result)


def test_lora_trains_only_the_projections_and_merges_into_a_plain_converted_model():
    # the paper's conversion: the preset's starts too close to the tiny teacher (cosine 0.999) to show training
    teacher, stream = tiny_bert(), random_ids(1, 4000, seed=4).reshape(-1)
    result = run(
        teacher, stream, lora_rank=4, learning_rate=1e-2, max_steps=8, batch_size=8, eval_every=0, preset="paper"
    )
    student = result.student
    plain = hf_alibi.patch_model(copy.deepcopy(teacher))
    assert type(student) is type(plain) and set(student.state_dict()) == set(plain.state_dict())
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, plain.state_dict()[k])}
    # BERT's six projections per layer: query, key, value, attention output, intermediate, output
    names = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "intermediate.dense", "output.dense")  # fmt: skip
    assert changed == {f"bert.encoder.layer.{i}.{m}.weight" for i in range(2) for m in names}
    assert result.history[0]["cosine"] < 0.99 < result.final["cosine"]
    assert result.info["lora_rank"] == 4
    card = recovery_card_section(result)
    assert "| trained weights | LoRA rank 4, merged |" in card and "| conversion preset | paper |" in card


def test_resume_from_a_checkpoint_ends_where_the_uninterrupted_run_does(tmp_path):
    teacher, stream = tiny_gpt2(), random_ids(1, 800, seed=4).reshape(-1)
    whole = run(teacher, stream, output_dir=str(tmp_path / "a"), save_steps=3)
    assert (tmp_path / "a" / "checkpoint-3" / "trainer_state.json").is_file()
    resumed = run(
        teacher, stream, output_dir=str(tmp_path / "b"), resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3")
    )
    half = run(teacher, stream, max_steps=3)
    reference, again, short = whole.student.state_dict(), resumed.student.state_dict(), half.student.state_dict()
    assert all(torch.allclose(again[k], reference[k], atol=1e-6) for k in reference)
    assert not all(torch.allclose(short[k], reference[k], atol=1e-6) for k in reference), "3 steps must differ from 6"
    assert resumed.final["kl"] == pytest.approx(whole.final["kl"], rel=1e-5)


def test_cli_lora_with_checkpoints_writes_a_plain_checkpoint_and_keeps_the_trainer_checkpoints(tmp_path, capsys):
    src, text, out = tmp_path / "src", tmp_path / "notes.txt", tmp_path / "out"
    tiny_gpt2().save_pretrained(src)
    make_tokenizer(src)
    words = random_ids(1, 1200, seed=0).reshape(-1).tolist()
    text.write_text("\n".join(" ".join(f"w{i}" for i in words[j : j + 12]) for j in range(0, 1200, 12)))
    argv = ("--train_file", text, "--max_steps", "2", "--batch_size", "2", "--lora_rank", "2", "--save_steps", "1")
    code, stdout, err = run_cli("recover", src, out, *argv, capsys=capsys)
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and not any("adapter" in n for n in names)
    assert json.loads((out / "config.json").read_text())["model_type"] == "alibi_gpt2"
    assert json.loads((out / "recovery.json").read_text())["info"]["lora_rank"] == 2
    assert {p.name for p in (tmp_path / "out.checkpoints").iterdir()} == {"checkpoint-1", "checkpoint-2"}
