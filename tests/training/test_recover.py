"""Recovery by self-distillation (hf_alibi.recover) and ``hf-alibi recover``: losses against hand-computed
references, the teacher frozen, the loss falling, the CLI end to end and its refusals."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from sharing import folder_hash, free_port, last_json_line, make_tokenizer, run_child, run_cli
from tiny import VOCAB, random_ids, tiny_bert, tiny_gpt2
from transformers import TrainingArguments

import hf_alibi
from hf_alibi import cli
from hf_alibi.recover import (
    DistillationTrainer,
    agreement,
    hidden_state_mse,
    kl_next_token,
    model_kind,
    original_length,
    read_texts,
    recover,
)


def hand_kl(student_logits, teacher_logits) -> float:
    """KL(teacher || student) per token, mean: written out with math, one token at a time."""
    total, count = 0.0, 0
    for s_row, t_row in zip(student_logits.reshape(-1, student_logits.shape[-1]).tolist(),
                            teacher_logits.reshape(-1, teacher_logits.shape[-1]).tolist()):  # fmt: skip
        s_norm = math.log(sum(math.exp(x) for x in s_row))
        t_norm = math.log(sum(math.exp(x) for x in t_row))
        total += sum(math.exp(t - t_norm) * ((t - t_norm) - (s - s_norm)) for s, t in zip(s_row, t_row))
        count += 1
    return total / count


def args(tmp_path, steps=8, lr=1e-3):
    return TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=4, learning_rate=lr,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        logging_steps=1, seed=0,
    )  # fmt: skip


def blocks(n=32, length=16):
    return [{"input_ids": row, "labels": row} for row in random_ids(n, length, seed=5)]


# ------------------------------------------------------------------------------------------------ losses


def test_kl_equals_a_hand_computed_reference():
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 3, 7, generator=generator), torch.randn(2, 3, 7, generator=generator)
    assert kl_next_token(student, teacher).item() == pytest.approx(hand_kl(student, teacher), rel=1e-5)
    # temperature T: both softened by T, scaled by T^2
    assert kl_next_token(student, teacher, temperature=2.0).item() == pytest.approx(
        4 * hand_kl(student / 2, teacher / 2), rel=1e-5
    )
    # the mask keeps tokens out of the mean
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    kept = hand_kl(torch.stack([student[0, 0], student[0, 1], student[1, 0]]),
                   torch.stack([teacher[0, 0], teacher[0, 1], teacher[1, 0]]))  # fmt: skip
    assert kl_next_token(student, teacher, mask).item() == pytest.approx(kept, rel=1e-5)


def test_hidden_state_mse_equals_a_hand_computed_reference():
    generator = torch.Generator().manual_seed(1)
    a, b, c, d = (torch.randn(2, 3, 4, generator=generator) for _ in range(4))
    by_hand = sum((x - y) ** 2 for x, y in zip(a.flatten().tolist(), b.flatten().tolist())) / a.numel()
    assert hidden_state_mse([a], [b]).item() == pytest.approx(by_hand, rel=1e-5)
    both = (by_hand + ((c - d) ** 2).mean().item()) / 2
    assert hidden_state_mse([a, c], [b, d]).item() == pytest.approx(both, rel=1e-5)
    with pytest.raises(ValueError, match="as many student as teacher layers"):
        hidden_state_mse([a], [b, d])


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_bert], ids=["gpt2", "bert"])
@pytest.mark.parametrize("hidden_layers", ["last", "all"])
def test_loss_is_zero_when_the_student_is_the_teacher(make, hidden_layers, tmp_path):
    teacher = make()
    student = copy.deepcopy(teacher)  # not converted: same function
    trainer = DistillationTrainer(
        model=student, args=args(tmp_path), train_dataset=blocks(), teacher=teacher, hidden_layers=hidden_layers
    )
    batch = {"input_ids": random_ids(4, 16, seed=2)}
    student.eval()  # no dropout: exactly the teacher's function
    assert trainer.compute_loss(student, batch).item() == pytest.approx(0.0, abs=1e-6)


def tiny_llama(seed: int = 0):
    """A rotary row with grouped-query attention (4 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
        max_position_embeddings=16, vocab_size=VOCAB,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_converted_student_loss_is_the_hand_kl(make):
    teacher = make()
    student = hf_alibi.patch_model(copy.deepcopy(teacher))
    ids = random_ids(2, 16, seed=3)
    trainer = DistillationTrainer.__new__(DistillationTrainer)  # compute_loss only: no Trainer set-up
    trainer.teacher, trainer.kind, trainer.lm_weight, trainer.temperature = teacher, "causal", 0.0, 1.0
    trainer.hidden_layers = "last"
    loss = trainer.compute_loss(student, {"input_ids": ids}).item()
    with torch.no_grad():
        expected = hand_kl(student(input_ids=ids).logits, teacher(input_ids=ids).logits)
    # not 0 = 0: the conversion shows; abs: fp32 log-probabilities of about -5 cancel in a KL this small
    assert expected > 1e-5 and loss == pytest.approx(expected, rel=1e-4, abs=2e-7)


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_bert], ids=["gpt2", "bert"])
def test_training_lowers_the_loss_and_never_touches_the_teacher(make, tmp_path):
    teacher = make()
    with torch.no_grad():  # a position table that matters, as in a pretrained model
        teacher.base_model.get_submodule("wpe" if make is tiny_gpt2 else "embeddings.position_embeddings").weight *= 30
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = hf_alibi.patch_model(copy.deepcopy(teacher))
    probe = {"input_ids": random_ids(8, 16, seed=9)}
    trainer = DistillationTrainer(
        model=student, args=args(tmp_path, steps=12, lr=3e-3), train_dataset=blocks(), teacher=teacher
    )
    student.eval()
    with torch.no_grad():
        start = trainer.compute_loss(student, probe).item()
    trainer.train()
    student.eval()
    with torch.no_grad():
        end = trainer.compute_loss(student, probe).item()
    assert end < 0.9 * start, (start, end)
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert not teacher.training and not hf_alibi.is_alibi(teacher)


def test_lm_weight_mixes_in_the_models_own_loss(tmp_path):
    teacher = tiny_gpt2()
    student = copy.deepcopy(teacher).eval()
    trainer = DistillationTrainer(
        model=student, args=args(tmp_path), train_dataset=blocks(), teacher=teacher, lm_weight=0.25
    )
    ids = random_ids(4, 16, seed=2)
    with torch.no_grad():
        lm = student(input_ids=ids, labels=ids).loss.item()
    # the student is the teacher: the distillation part is 0, the rest is 0.25 x the LM loss
    assert trainer.compute_loss(student, {"input_ids": ids, "labels": ids}).item() == pytest.approx(
        0.25 * lm, rel=1e-5
    )
    with pytest.raises(ValueError, match="lm_weight must be between 0 and 1"):
        DistillationTrainer(model=student, args=args(tmp_path), train_dataset=blocks(), teacher=teacher, lm_weight=2)


# ------------------------------------------------------------------------------------------------ recover()


def test_recover_returns_a_converted_student_closer_to_the_teacher():
    teacher = tiny_bert()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    stream = random_ids(1, 4000, seed=4).reshape(-1)
    result = recover(  # the paper's conversion: the preset's starts at cosine 0.999 to this tiny teacher
        teacher, stream, length=16, max_steps=12, batch_size=8, learning_rate=2e-3, preset="paper", progress=False,
        log=None,
    )  # fmt: skip
    assert hf_alibi.is_alibi(result.student) and not hf_alibi.is_alibi(teacher)
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert all(p.requires_grad for p in teacher.parameters()), "recover must give the teacher back as it was"
    assert [h["step"] for h in result.history] == [0, 3, 6, 9, 12]
    again = recover(teacher, stream, length=16, max_steps=2, batch_size=8, progress=False, log=None)
    assert again.history[-1]["cosine"] != again.history[0]["cosine"], "a second recovery must train too"
    assert result.history[-1]["cosine"] > result.history[0]["cosine"]
    assert {"cosine_2x", "cosine_4x", "cosine_8x"} <= set(result.final)
    assert result.info["tokens"] == 12 * 8 * 16 and result.info["length"] == 16
    # the agreement figure is an independent cosine of mean-pooled last hidden states
    held_out = stream[-200:][:192].view(12, 16)
    with torch.no_grad():
        s = result.student(input_ids=held_out, output_hidden_states=True).hidden_states[-1].mean(1)
        t = teacher(input_ids=held_out, output_hidden_states=True).hidden_states[-1].mean(1)
    expected = torch.nn.functional.cosine_similarity(s, t).mean().item()
    assert agreement(result.student, teacher, held_out.reshape(-1), 16, factors=(1,))["cosine"] == pytest.approx(
        expected, abs=1e-5
    )


def test_agreement_kl_and_perplexity_for_a_causal_lm():
    teacher = tiny_gpt2()
    student = hf_alibi.patch_model(copy.deepcopy(teacher))
    stream = random_ids(1, 16 * 8 + 1, seed=6).reshape(-1)
    figures = agreement(student, teacher, stream, 16, factors=(1, 8))
    windows = stream[:128].view(8, 16)
    with torch.no_grad():
        expected = hand_kl(student(input_ids=windows).logits, teacher(input_ids=windows).logits)
        logits = teacher(input_ids=stream[:-1].view(8, 16)).logits
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), stream[1:]).item()
    assert figures["kl"] == pytest.approx(expected, rel=1e-4)
    assert figures["teacher_ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert set(figures) == {"kl", "teacher_ppl", "ppl", "ppl_8x"}


def test_kinds_and_lengths():
    assert model_kind(tiny_gpt2()) == "causal" and model_kind(tiny_bert()) == "encoder"
    assert original_length(tiny_gpt2()) == 16 and original_length(tiny_bert()) == 16


def test_recover_refuses_bad_input():
    teacher = tiny_gpt2()
    with pytest.raises(ValueError, match="already ALiBi"):
        recover(hf_alibi.patch_model(copy.deepcopy(teacher)), random_ids(1, 100).reshape(-1), progress=False)
    with pytest.raises(ValueError, match="too short"):
        recover(teacher, random_ids(1, 20).reshape(-1), progress=False, log=None)
    with pytest.raises(ValueError, match="holds no text"):
        recover(teacher, torch.tensor([], dtype=torch.long), progress=False, log=None)
    with pytest.raises(ValueError, match="pass the tokenizer"):
        recover(teacher, ["some text"], progress=False, log=None)


def test_warm_start_needs_a_position_table():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                           vocab_size=VOCAB, max_position_embeddings=16)  # fmt: skip
    with pytest.raises(ValueError, match="warm_start_steps needs a learned position table"):
        recover(
            GPTNeoXForCausalLM(config), random_ids(1, 400).reshape(-1), warm_start_steps=2, progress=False, log=None
        )


def test_warm_start_refuses_a_student_that_keeps_the_table():
    from hf_alibi.recover import PositionWarmStart

    teacher = transformers.BertForMaskedLM(
        transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                vocab_size=VOCAB, max_position_embeddings=16)
    )  # fmt: skip
    student = hf_alibi.patch_model(copy.deepcopy(teacher), preset="pretrained")  # keeps the table's wavelengths
    with pytest.raises(ValueError, match="warm_start_steps would add the position table a second time"):
        PositionWarmStart(student, teacher, steps=4)
    plain = hf_alibi.patch_model(copy.deepcopy(teacher), preset="pretrained", table_max_wavelength=0)
    PositionWarmStart(plain, teacher, steps=4).remove()  # the table removed: the lever applies


def test_warm_start_fades_the_original_table_to_zero():
    from hf_alibi.recover import PositionWarmStart

    teacher = tiny_gpt2()
    student = hf_alibi.patch_model(copy.deepcopy(teacher))
    ids = random_ids(2, 16, seed=7)
    with torch.no_grad():
        plain = student.transformer.wte(ids)
        warm = PositionWarmStart(student, teacher, steps=4)
        assert torch.allclose(student.transformer.wte(ids), plain + teacher.transformer.wpe.weight[:16])
        warm.set_step(2)
        assert torch.allclose(student.transformer.wte(ids), plain + 0.5 * teacher.transformer.wpe.weight[:16])
        warm.set_step(4)
        assert torch.equal(student.transformer.wte(ids), plain)
        warm.remove()
        assert torch.equal(student.transformer.wte(ids), plain)


# ------------------------------------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("src")
    tiny_gpt2().save_pretrained(folder)
    make_tokenizer(folder)
    text = tmp_path_factory.mktemp("text") / "notes.txt"
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(1, VOCAB, (1200,), generator=generator).tolist()
    text.write_text("\n".join(" ".join(f"w{i}" for i in words[j : j + 12]) for j in range(0, 1200, 12)))
    return folder, text


@pytest.fixture(scope="module")
def recovered(source, tmp_path_factory):
    from hf_alibi.cli.jobs import recover_checkpoint

    src, text = source
    out = tmp_path_factory.mktemp("out") / "recovered"
    before = folder_hash(src)
    out, result = recover_checkpoint(str(src), out, text, max_steps=4, batch_size=4, learning_rate=1e-3)
    assert folder_hash(src) == before, "recover modified SRC"
    return src, out, result


def test_cli_recover_end_to_end(source, tmp_path, capsys):
    src, text = source
    out = tmp_path / "out"
    code, stdout, err = run_cli("recover", src, out, "--train_file", text, "--max_steps", "4", "--batch_size", "4",
                                capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert "Wrote the recovered ALiBi checkpoint" in stdout and "kl " in stdout
    assert "[recover] step 0/4" in stdout + err and "[recover] step 4/4" in stdout + err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "alibi_gpt2" and config["alibi"]["base_model_type"] == "gpt2"
    assert {"modeling_alibi.py", "README.md", "recovery.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "staging folder left behind"


def test_recovered_checkpoint_reloads_as_the_trained_student(recovered):
    src, out, result = recovered
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_alibi.is_alibi(reloaded)
    ids = random_ids(2, 64, seed=8)  # 4x the original 16 positions
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, result.student(input_ids=ids).logits, atol=1e-6)
        original = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        assert not torch.allclose(original(input_ids=ids[:, :16]).logits, reloaded(input_ids=ids[:, :16]).logits)


def test_recovered_card_and_info(recovered, capsys):
    _, out, result = recovered
    card = (out / "README.md").read_text()
    assert card.startswith("---") and "## Recovery (self-distillation from the original)" in card
    assert "| steps x batch x length | 4 x 4 x 16 |" in card and "must be fine-tuned" not in card
    assert f"| kl | {result.history[0]['kl']:.4g} | {result.final['kl']:.4g} |" in card
    assert "||" not in card.split("## Recovery")[1], "a '|' in a cell breaks the card's tables"
    saved = json.loads((out / "recovery.json").read_text())
    assert saved["history"][-1]["step"] == 4 and saved["info"]["tokens"] == 4 * 4 * 16
    code, stdout, _ = run_cli("info", out, "--json", capsys=capsys)
    info = json.loads(stdout)
    assert code == 0 and info["is_alibi"] and info["base_model_type"] == "gpt2" and info["remote_code_file"]


def test_recovered_checkpoint_loads_without_hf_alibi(recovered, tmp_path):
    _, out, result = recovered
    ids = random_ids(2, 40, seed=8)
    with torch.no_grad():
        torch.save({"ids": ids, "out": result.student(input_ids=ids).logits}, tmp_path / "expected.pt")
    code = f"""
    import json, torch, transformers
    expected = torch.load({str(tmp_path / "expected.pt")!r})
    model = transformers.AutoModelForCausalLM.from_pretrained(".", trust_remote_code=True).eval()
    with torch.no_grad():
        out = model(input_ids=expected["ids"]).logits
    print(json.dumps({{"module": type(model).__module__, "diff": (out - expected["out"]).abs().max().item()}}))
    """
    child = run_child(code, out, tmp_path / "hf", block_hf_alibi=True)
    assert child.returncode == 0, child.stderr[-4000:]
    report = last_json_line(child.stdout)
    assert report["module"].endswith("modeling_alibi") and report["diff"] <= 1e-5, report


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "holds no text"),
        ("short", "too short"),
        ("missing", "is not a file"),
        ("alibi_src", "already an ALiBi checkpoint"),
        ("out_exists", "exists and is not empty"),
    ],
)
def test_bad_inputs_are_clear_errors_and_write_nothing(source, tmp_path, capsys, case, message):
    src, text = source
    out = tmp_path / "out"
    train = tmp_path / "train.txt"
    train.write_text(text.read_text())
    if case == "empty":
        train.write_text("  \n\n")
    elif case == "short":
        train.write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10")
    elif case == "missing":
        train = tmp_path / "nope.txt"
    elif case == "alibi_src":
        assert cli.main(["convert", str(src), str(tmp_path / "converted")]) == 0
        src = tmp_path / "converted"
    elif case == "out_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, err = run_cli("recover", src, out, "--train_file", train, "--max_steps", "2", capsys=capsys)
    assert code == 2 and message in err and err.startswith("hf-alibi: error: ") and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "something was written"
    if case == "out_exists":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_read_texts_jsonl(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "a b"}\n{"other": 1}\n{"text": "c"}\n')
    assert read_texts(path) == ["a b", "c"]
    assert read_texts(Path(str(path)).with_suffix(".jsonl")) == ["a b", "c"]


# ------------------------------------------------------------------------------------------------ run_clm.py


def load_run_clm():
    """scripts/run_clm.py as a module (registered first: its dataclasses look their module up)."""
    import importlib.util
    import sys

    if "hf_alibi_run_clm" not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "scripts" / "run_clm.py"
        spec = importlib.util.spec_from_file_location("hf_alibi_run_clm", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["hf_alibi_run_clm"] = module
        spec.loader.exec_module(module)
    return sys.modules["hf_alibi_run_clm"]


def test_run_clm_distill_from_original(source, tmp_path, monkeypatch, capsys):
    src, text = source
    run_clm = load_run_clm()
    out = tmp_path / "out"
    argv = ["run_clm.py", "--model_name_or_path", src, "--alibi", "--distill_from_original", "--train_file", text,
            "--block_size", "16", "--per_device_train_batch_size", "4", "--max_steps", "3", "--do_train",
            "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--output_dir", out,
            "--cache_dir", tmp_path / "cache", "--disable_tqdm", "true", "--learning_rate", "1e-3"]  # fmt: skip
    monkeypatch.setattr("sys.argv", [str(a) for a in argv])
    teacher = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    run_clm.main()
    printed = capsys.readouterr().out
    assert "Agreement with the original (validation, length 16): kl " in printed
    figures = json.loads((out / "distill_agreement.json").read_text())
    student = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_alibi.is_alibi(student) and figures["steps"] == 3 and figures["length"] == 16
    # the saved student and the original give the KL the script reported, on the same held-out tokens
    from datasets import load_dataset

    raw = load_dataset(
        "text", data_files={"train": str(text)}, cache_dir=str(tmp_path / "cache2"), keep_linebreaks=True
    )
    split = raw["train"].train_test_split(test_size=0.05, shuffle=False)["test"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    ids = torch.tensor([i for t in split["text"] for i in tokenizer(t)["input_ids"]])
    windows = ids[: (ids.numel() // 16) * 16].view(-1, 16)
    with torch.no_grad():
        expected = hand_kl(student(input_ids=windows).logits, teacher(input_ids=windows).logits)
    assert figures["kl"] == pytest.approx(expected, rel=1e-3)


def test_run_clm_distill_needs_the_original_and_alibi():
    run_clm = load_run_clm()
    with pytest.raises(ValueError, match="needs --model_name_or_path"):
        run_clm.ModelArguments(model_type="gpt2", alibi=True, distill_from_original=True)
    with pytest.raises(ValueError, match="needs --model_name_or_path"):
        run_clm.ModelArguments(model_name_or_path="x", distill_from_original=True)


@pytest.mark.parametrize(
    "launch", ["ddp", "fsdp", "fsdp-teacher", "zero3.json", pytest.param("zero2.json", marks=pytest.mark.slow)]
)
def test_recover_in_two_processes_equals_one_process(source, recovered, tmp_path, launch):
    """``torchrun --nproc_per_node 2 -m hf_alibi recover`` with DDP, ``--fsdp`` (FSDP2 over gloo) or ``--deepspeed``
    (ZeRO-3: the student partitioned, the teacher whole on each rank), 2 blocks a step on each rank, against the
    fixture's one process of 4 (the same 4 blocks a step: accelerate gives rank r the r-th batch of each pair; no
    dropout): the same agreement history and weights, within what the ranks' reduced sums change; rank 0 alone wrote
    OUT."""
    if launch.endswith(".json"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    (src, text), (_, expected_out, expected) = source, recovered
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "hf_alibi", "recover", str(src), str(out), "--train_file", str(text),
               "--max_steps", "4", "--batch_size", "2", "--learning_rate", "1e-3"]  # fmt: skip
    if launch.endswith(".json"):
        command += ["--deepspeed", str(Path(__file__).resolve().parents[2] / "configs" / "deepspeed" / launch)]
    elif launch == "fsdp":  # checkpoints too: the Trainer's FSDP save (whole weights and optimizer state)
        command += ["--fsdp", "--checkpoint-dir", str(tmp_path / "checkpoints"), "--save_steps", "2"]
    elif launch == "fsdp-teacher":  # the teacher sharded too (FSDP2, forwards only)
        command += ["--fsdp", "--shard-teacher"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.count("Wrote the recovered ALiBi checkpoint") == 1  # rank 0's line
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["checkpoints", "ddp"] if launch == "fsdp" else ["ddp"])  # no staging folder of any rank left
    if launch == "fsdp":  # sharded, not DDP: FSDP's checkpoint files
        assert (tmp_path / "checkpoints" / "checkpoint-2" / "pytorch_model_fsdp.bin").is_file()
    recovery = json.loads((out / "recovery.json").read_text())
    assert recovery["info"]["processes"] == 2 and recovery["info"]["tokens"] == expected.info["tokens"]
    assert recovery["info"]["teacher_sharded"] is (launch == "fsdp-teacher")
    assert [h["step"] for h in recovery["history"]] == [h["step"] for h in expected.history]
    for got, want in zip(recovery["history"], expected.history):  # KL and perplexity at every length
        assert got.keys() == want.keys() and "kl" in want
        for key in set(want) - {"step", "tokens"}:
            assert got[key] == pytest.approx(want[key], rel=1e-4), (got["step"], key)
    assert expected.history[-1]["kl"] < expected.history[0]["kl"]  # it trained
    saved = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(expected_out).state_dict()
    assert saved.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(saved[key], want[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_recover_launched_to_shard_is_refused_before_anything_loads(source, tmp_path, capsys, monkeypatch, variable):
    src, text = source
    monkeypatch.setenv(variable, "true")  # what accelerate launch --use_fsdp / --use_deepspeed sets
    code, _, err = run_cli("recover", src, tmp_path / "out", "--train_file", text, "--max_steps", "2", capsys=capsys)
    assert code == 2 and err.startswith("hf-alibi: error: hf-alibi recover was launched with ")
    assert "DDP (torchrun --nproc_per_node N -m hf_alibi recover" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_deepspeed_setting_that_cannot_run_is_one_line(tmp_path):
    from hf_alibi.recover.settings import RecoverySettings, check_settings

    with pytest.raises(ValueError, match=r"--deepspeed 'nowhere.json' is not a readable JSON DeepSpeed config: "):
        RecoverySettings(deepspeed="nowhere.json")
    (tmp_path / "stage4.json").write_text('{"zero_optimization": {"stage": 4}}')
    with pytest.raises(ValueError, match="zero_optimization.stage is 4; use 0 to 3"):
        RecoverySettings(deepspeed=str(tmp_path / "stage4.json"))
    zero3 = str(Path(__file__).resolve().parents[2] / "configs" / "deepspeed" / "zero3.json")
    with pytest.raises(ValueError, match="lora_rank does not run with deepspeed yet"):
        check_settings(64, deepspeed=zero3, lora_rank=4)
    with pytest.raises(ValueError, match="lora_rank does not run with fsdp yet"):
        check_settings(64, fsdp=True, lora_rank=4)
    with pytest.raises(ValueError, match="deepspeed and fsdp both shard the student: choose one"):
        check_settings(64, deepspeed=zero3, fsdp=True)
    with pytest.raises(ValueError, match="shard_teacher shards the teacher with FSDP2 over the processes of fsdp"):
        check_settings(64, deepspeed=zero3, shard_teacher=True)
