"""scripts/run_clm.py resumed from a checkpoint: ALiBi or not is read from the checkpoint, not from --alibi."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GPT2Config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "run_clm.py")
TINY = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=32,n_head=4,n_positions=16"]
COMMON = ["--per_device_train_batch_size", "4", "--report_to", "none", "--seed", "0", "--tokenizer_vocab_size", "512"]
COMMON += ["--block_size", "32", "--do_train", "--use_cpu", "--disable_tqdm", "true", "--max_steps", "4"]


def _run(args, tmp_path) -> subprocess.CompletedProcess:
    stdlib = Path(os.__file__).parent
    train = tmp_path / "train.txt"
    if not train.exists():
        train.write_text((stdlib / "argparse.py").read_text())
    env = dict(os.environ, HF_ALIBI_CACHE=str(tmp_path / "cache"), HF_DATASETS_CACHE=str(tmp_path / "cache" / "ds"))
    return subprocess.run(
        [sys.executable, SCRIPT, *TINY, *COMMON, "--train_file", str(train), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_alibi_checkpoint_resumed_without_alibi_continues_as_alibi(tmp_path):
    # 4 steps in one go, saving at step 2; then the same 4 steps resumed from step 2 without --alibi
    first = _run(
        ["--alibi", "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(tmp_path / "a")], tmp_path
    )
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "alibi_gpt2"

    resumed = _run(
        ["--save_strategy", "no", "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint", str(checkpoint)],
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "is an ALiBi checkpoint" in resumed.stdout + resumed.stderr
    assert "continuing as ALiBi" in resumed.stdout + resumed.stderr
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["model_type"] == "alibi_gpt2" and config["alibi"]["heads"] == 4
    # the resumed run ends where the uninterrupted one did: same weights (no wpe in either)
    whole, again = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(whole) == sorted(again) and not any("wpe" in key for key in whole)
    for key in whole:
        torch.testing.assert_close(again[key], whole[key], rtol=1e-5, atol=1e-6, msg=key)


def test_plain_checkpoint_resumed_with_alibi_is_a_clear_error(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16).save_pretrained(checkpoint)
    result = _run(
        ["--alibi", "--output_dir", str(tmp_path / "b"), "--resume_from_checkpoint", str(checkpoint)], tmp_path
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: --resume_from_checkpoint") and "is not an ALiBi checkpoint" in last, last
    assert "Resume it without --alibi" in last
    assert not (tmp_path / "b").exists()  # stopped before anything was trained or written


def test_checkpoints_without_config_json_get_one(tmp_path):
    """With FSDP's SHARDED_STATE_DICT the Trainer writes only shards into checkpoint-N: run_clm.py's callback
    adds config.json there (on the main process only, never over an existing one), so resuming knows."""
    import importlib.util
    from types import SimpleNamespace

    from tiny import tiny_gpt2

    import hf_alibi

    spec = importlib.util.spec_from_file_location("run_clm", SCRIPT)
    run_clm = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_clm", run_clm)  # its dataclasses look their module up there
    spec.loader.exec_module(run_clm)
    model = hf_alibi.patch_model(tiny_gpt2())
    args = SimpleNamespace(output_dir=str(tmp_path))
    (tmp_path / "checkpoint-4" / "pytorch_model_fsdp_0").mkdir(parents=True)
    callback = run_clm.SaveConfigCallback()
    callback.on_save(args, SimpleNamespace(is_world_process_zero=False, global_step=4), None, model=model)
    assert not (tmp_path / "checkpoint-4" / "config.json").exists()  # not the main process
    callback.on_save(args, SimpleNamespace(is_world_process_zero=True, global_step=4), None, model=model)
    assert run_clm.checkpoint_alibi_settings(tmp_path / "checkpoint-4") == model.config.alibi
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / "checkpoint-6" / "config.json").write_text('{"model_type": "gpt2"}')
    callback.on_save(args, SimpleNamespace(is_world_process_zero=True, global_step=6), None, model=model)
    assert json.loads((tmp_path / "checkpoint-6" / "config.json").read_text()) == {"model_type": "gpt2"}
    assert run_clm.checkpoint_alibi_settings(tmp_path / "checkpoint-6") is None
