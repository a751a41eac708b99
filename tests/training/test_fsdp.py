"""Sharded training (FSDP2) of ALiBi models: on CPUs with gloo, and through ``accelerate launch`` on GPUs.

accelerate 1.15 never selects FSDP on CPUs (its ``AcceleratorState`` upgrades only GPU-like distributed
types to FSDP); hf_alibi makes the Trainer's accelerator an FSDP2 one there (``train.distributed.fsdp_on_cpu``):

* ``tests/fsdp_worker.py`` runs accelerate's own FSDP2 wrapping (``fsdp2_prepare_model``) and checkpoint
  code (``save_fsdp_model`` / ``load_fsdp_model``) under ``torchrun`` with 2 gloo ranks, against an
  unsharded reference trained in the same process, per architecture;
* ``accelerate launch`` of ``run_clm.py --alibi`` with ``configs/accelerate/fsdp2.yaml`` runs FSDP2: on CPUs with
  ``--use_cpu`` (sharded checkpoints here, whole ones in the slow tier), on GPUs as the ``gpu`` test; without
  ``--use_cpu`` on a CPU-only machine (independent processes) it stops with a clear error.

The losses against one process: ``tests/training/test_deepspeed.py`` (run_clm.py, ``fsdp2`` beside ZeRO) and
``tests/training/test_recover.py`` (``hf-alibi recover --fsdp``).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from sharing import free_port

import hf_alibi

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "fsdp_worker.py")
SCRIPT = str(ROOT / "scripts" / "run_clm.py")
CONFIG = str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")
TINY = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=32,n_head=4,n_positions=16"]
COMMON = ["--per_device_train_batch_size", "4", "--report_to", "none", "--seed", "0", "--tokenizer_vocab_size", "512"]
COMMON += ["--block_size", "32", "--do_train", "--disable_tqdm", "true"]
# (worker case, Auto class to reload with, the learned slopes' count: 2 encoder layers x left/right)
CASES = [
    ("gpt2", "AutoModelForCausalLM", 0),  # accelerate's own auto-wrap: GPT2Block units, tied wte / lm_head
    ("gpt_neox", "AutoModelForCausalLM", 0),  # accelerate's own auto-wrap: GPTNeoXLayer units, untied
    ("bert:learned:own-wrap", "AutoModelForMaskedLM", 4),
    ("t5:learned:own-wrap", "AutoModelForSeq2SeqLM", 4),
]
HEADS = 4  # every tiny config's


def _env(tmp_path: Path) -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_ALIBI_CACHE=str(tmp_path / "cache"),
        HF_DATASETS_CACHE=str(tmp_path / "cache" / "ds"),
    )


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    command = [*_torchrun(), WORKER, str(out), *(case for case, _, _ in CASES)]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(out), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out, json.loads((out / "report.json").read_text())


def test_sharded_training_equals_unsharded_training(fsdp_run):
    _, reports = fsdp_run
    assert [(r["world_size"], r["backend"]) for r in reports] == [(2, "gloo"), (2, "gloo")]
    for report in reports:  # both ranks
        for spec, _, learned_count in CASES:
            case = report["cases"][spec]
            # 3 AdamW steps on the mean loss of both ranks' batches, computed unsharded: same weights
            assert case["diff_vs_reference"] < 1e-4, (spec, case["diff_vs_reference"])
            assert case["moved_from_initial"] > 1e-3  # it trained (AdamW at lr 1e-2 moves weights by ~3e-2)
            for loss, reference_loss in case["losses"]:
                assert 1.0 < loss < 10.0 and 1.0 < reference_loss < 10.0
            # every learned slope tensor (4 heads) is split over the 2 ranks, and it trained
            assert case["learned_local_shapes"] == {name: [HEADS // 2] for name in case["learned_moved"]}
            assert len(case["learned_moved"]) == learned_count
            assert all(moved > 1e-3 for moved in case["learned_moved"].values()), case["learned_moved"]
            # the gathered copy the evaluation runs: same class, same logits as the reference at 40 > 16 tokens
            assert case["unsharded_copy_class"].startswith("Alibi")
            assert case["unsharded_copy_logits_diff"] < 1e-4
    wrapped = {spec: reports[0]["cases"][spec]["wrapped"] for spec in ("gpt2", "gpt_neox")}
    assert {"FSDPGPT2Block", "FSDPAlibiGPT2LMHeadModel"} <= set(wrapped["gpt2"])  # _no_split_modules, root
    assert {"FSDPGPTNeoXLayer", "FSDPAlibiGPTNeoXForCausalLM"} <= set(wrapped["gpt_neox"])


def test_both_checkpoint_formats_load_back_into_a_sharded_model(fsdp_run):
    _, reports = fsdp_run
    for report in reports:
        for spec, _, _ in CASES:
            case = report["cases"][spec]
            assert case["SHARDED_STATE_DICT_files"] == ["pytorch_model_fsdp_0"]  # torch.distributed.checkpoint
            assert case["FULL_STATE_DICT_files"] == ["pytorch_model_fsdp.bin"]
            for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
                assert case[f"{kind}_before_reload_diff"] > 1e-2  # the fresh model started elsewhere
                assert case[f"{kind}_reload_diff"] == 0.0, (spec, kind)


def test_checkpoints_reload_as_the_same_alibi_model(fsdp_run, tmp_path):
    """The gathered model's save_pretrained (what the Trainer does with FULL_STATE_DICT), accelerate's
    full state dict file, and the sharded checkpoint merged with ``accelerate merge-weights`` all load as
    the same ALiBi model, learned slopes included."""
    out, _ = fsdp_run
    merge = "\n".join(
        f"merge_fsdp_weights({str(out / spec.split(':')[0] / 'sharded_state_dict' / 'pytorch_model_fsdp_0')!r}, "
        f"{str(tmp_path / spec.split(':')[0])!r})"
        for spec, _, _ in CASES
    )
    code = f"from accelerate.utils import merge_fsdp_weights\n{merge}\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]

    for spec, auto_name, learned_count in CASES:
        name = spec.split(":")[0]
        auto = getattr(transformers, auto_name)
        pretrained = auto.from_pretrained(out / name / "pretrained").eval()
        assert hf_alibi.is_alibi(pretrained) and type(pretrained).__name__.startswith("Alibi")
        variant = hf_alibi.get_settings(pretrained.config).encoder_variant
        assert variant == ("learned" if learned_count else None)
        expected = torch.load(out / name / "expected.pt")
        with torch.no_grad():
            logits = pretrained(**expected["inputs"]).logits
        torch.testing.assert_close(logits, expected["logits"], rtol=1e-4, atol=1e-4)

        state = pretrained.state_dict()
        full = torch.load(out / name / "full_state_dict" / "pytorch_model_fsdp.bin")
        learned = [key for key in full if key.endswith(("alibi.slopes_left", "alibi.slopes_right"))]
        assert len(learned) == learned_count
        for key, value in full.items():
            assert torch.equal(state[key], value), key

        merged_folder = tmp_path / name
        shutil.copy(out / name / "pretrained" / "config.json", merged_folder / "config.json")
        merged = auto.from_pretrained(merged_folder).eval()
        assert type(merged) is type(pretrained)
        for key, value in merged.state_dict().items():
            assert torch.equal(value, state[key]), key


def _torchrun() -> list[str]:
    """torch's launcher of 2 processes on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]


def _accelerate(*args: str) -> list[str]:
    """accelerate's launcher with configs/accelerate/fsdp2.yaml on a free port, then ``args``."""
    return ["accelerate", "launch", "--config_file", CONFIG, "--main_process_port", str(free_port()), *args]


def _launch(launcher: list[str], script_args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """run_clm.py --alibi on the tiny GPT-2 through ``launcher``, trained on stdlib text (tmp_path/train.txt; and
    tmp_path/validation.txt for ``script_args`` to name)."""
    stdlib = Path(os.__file__).parent
    train = tmp_path / "train.txt"
    if not train.exists():
        train.write_text((stdlib / "argparse.py").read_text() + (stdlib / "typing.py").read_text())
        (tmp_path / "validation.txt").write_text((stdlib / "textwrap.py").read_text())
    command = [*launcher, SCRIPT, *TINY, "--alibi", *COMMON, "--train_file", str(train), *script_args]
    return subprocess.run(command, capture_output=True, text=True, env=_env(tmp_path), timeout=600)


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.slow
def test_accelerate_fsdp_launch_of_independent_processes_on_cpus_is_refused(tmp_path):
    """Without --use_cpu on a machine without GPUs, accelerate starts independent single processes: refused."""
    result = _launch(_accelerate(), ["--max_steps", "2", "--output_dir", str(tmp_path / "out")], tmp_path)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(("ValueError", "[rank0]: ValueError"))]
    assert errors, result.stderr[-3000:]
    message = errors[0]
    assert "accelerate was launched with FSDP, but these 2 processes would train with each process alone" in message
    assert "--use_cpu" in message
    assert not (tmp_path / "out").exists()  # refused before any data or weights were written


GPU = torch.cuda.is_available()


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not installed")
@pytest.mark.parametrize(
    "state_dict_type",
    [
        pytest.param("SHARDED_STATE_DICT", marks=[pytest.mark.gpu] if GPU else []),
        pytest.param("FULL_STATE_DICT", marks=pytest.mark.gpu if GPU else pytest.mark.slow),
    ],
)
def test_accelerate_fsdp_launch_of_run_clm_alibi(tmp_path, state_dict_type):
    """On GPUs as accelerate runs it; on CPUs with --use_cpu, FSDP2 over gloo (train.distributed.fsdp_on_cpu), where
    accelerate alone would train DDP."""
    processes = min(2, torch.cuda.device_count()) if GPU else 2
    out = tmp_path / "out"
    accelerate_args = ["--num_processes", str(processes), "--fsdp_state_dict_type", state_dict_type]
    script_args = [] if GPU else ["--use_cpu"]  # the Trainer's: with accelerate's FSDP config, DDP over gloo before
    script_args += ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(out)]
    script_args += ["--validation_file", str(tmp_path / "validation.txt"), "--eval_lengths", "32,64,128"]
    script_args += ["--max_eval_tokens", "500", "--eval_stride", "16"]
    script_args += ["--export_gguf", "f32"]  # the whole model is gathered on every rank, rank 0 writes the file
    result = _launch(_accelerate(*accelerate_args), script_args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "would train with" not in result.stderr

    results = json.loads((out / "eval_results.json").read_text())
    assert results["alibi"] is True and results["world_size"] == processes
    # the final model: a whole ALiBi checkpoint in both formats (run_clm saves the gathered model itself
    # when the Trainer wrote only shards)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    from hf_alibi.core.strategies import NoPositionEmbedding

    # the position table gone: a placeholder without weights stands where it was, and no checkpoint key holds it
    assert type(model).__name__ == "AlibiGPT2LMHeadModel" and isinstance(model.transformer.wpe, NoPositionEmbedding)
    assert not any("wpe" in key for key in model.state_dict())
    assert (out / "model-f32.gguf").read_bytes()[:4] == b"GGUF"
    checkpoint = out / "checkpoint-2"
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "alibi_gpt2"
    if state_dict_type == "SHARDED_STATE_DICT":
        assert (checkpoint / "pytorch_model_fsdp_0").is_dir()
    # the evaluation equals a single-process evaluation of the saved model
    from itertools import chain

    from transformers import AutoTokenizer

    from hf_alibi.evaluate import evaluate_perplexity

    tokenizer = AutoTokenizer.from_pretrained(out)
    lines = (tmp_path / "validation.txt").read_text().splitlines(keepends=True)
    ids = torch.tensor(list(chain(*tokenizer(lines)["input_ids"])))[:500]
    again = evaluate_perplexity(model, ids, 128, 16)
    got = results["splits"]["validation"]["sliding"]["128"]["perplexity"]
    assert again["perplexity"] == pytest.approx(got, rel=1e-4)


def test_the_fsdp2_config_file_is_the_one_recover_uses():
    """configs/fsdp/fsdp2.json (run_clm.py's --fsdp_config in the docs) and recover --fsdp's Trainer config agree."""
    from hf_alibi.train.distributed import FSDP2_CONFIG

    assert json.loads((ROOT / "configs" / "fsdp" / "fsdp2.json").read_text()) == FSDP2_CONFIG


def test_fsdp1_on_cpus_is_one_line(tmp_path):
    """The Trainer's --fsdp with fsdp_config version 1 is FSDP1, which gloo does not run: one line before training,
    not DDP in its place (transformers' default is version 2)."""
    out = tmp_path / "out"
    script_args = ["--use_cpu", "--fsdp", "full_shard", "--fsdp_config", '{"version": 1}', "--max_steps", "1",
                   "--output_dir", str(out)]  # fmt: skip
    result = _launch(_torchrun(), script_args, tmp_path)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "ValueError: FSDP on CPUs runs FSDP2 only" in line]
    assert errors, result.stderr[-3000:]
    assert "fsdp_version 2" in errors[0]
    assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*"))
