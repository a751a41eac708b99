"""DeepSpeed ZeRO on the CPU (``DS_ACCELERATOR=cpu``, gloo): conversions under partitioned weights.

Under ZeRO-3 every weight ``from_pretrained`` builds is a partition (``deepspeed.zero.Init``): read as it is, a
position table's mean is of nothing. ``tests/deepspeed_worker.py`` converts each model in 2 processes under ZeRO-3
(every preset, the options, slopes fitted on the partitioned original, a model trained with ALiBi); here the same
conversions run in one process, on whole weights, and every weight and setting must be equal, exactly. The worker
also reloads a saved conversion under ``zero.Init`` and tries to convert an FSDP2-sharded model (refused).
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

import hf_alibi

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import deepspeed_worker as worker  # noqa: E402
from arch_cases import CASES, NATIVE_CASES  # noqa: E402
from sharing import free_port, torch_threads  # noqa: E402

# absolute (tied, offset, encoder tables: BERT's and RoBERTa's padding rows), rotary (full, partial), relative,
# and a model trained with ALiBi (its check reads the fused projection's shape)
CONVERTED = ["gpt2", "opt", "bert", "roberta", "llama", "gpt_neox", "t5"]
NATIVE = ["falcon-rw-6"]


def _original(name: str) -> transformers.PreTrainedModel:
    case = next(c for c in [*CASES, *NATIVE_CASES] if c.name == name)
    return case.make(seed=0)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """The worker's outputs: ``out/CASE/NAME.pt`` per conversion, ``reloaded.pt``, ``refusals.json``."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("out")
    for name in CONVERTED + NATIVE:
        _original(name).save_pretrained(src / name)
    for name in CONVERTED:  # a saved conversion, to reload under zero.Init
        converted = hf_alibi.patch_model(_original(name), preset="pretrained")
        converted.save_pretrained(src / f"{name}-alibi")
        auto = next(c.auto_class for c in CASES if c.name == name)
        (src / f"{name}-alibi" / "auto_class.txt").write_text(auto)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    worker_script = str(ROOT / "tests" / "deepspeed_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), worker_script, str(out), str(src), *CONVERTED, *NATIVE]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return src, out


def _one_process(src: Path, name: str, keywords: dict) -> transformers.PreTrainedModel:
    """The same conversion on whole weights, written out here (one thread, as each rank ran)."""
    config = json.loads((src / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(src)
    keywords = worker.applicable(model.config, dict(keywords))
    if keywords.pop("fit", False):
        with torch_threads(1):
            keywords["slopes"] = hf_alibi.fit_slopes(model, worker.FIT_IDS[None], sinks=1)
    return hf_alibi.patch_model(model, **keywords)


@pytest.mark.parametrize("name", CONVERTED + NATIVE)
def test_a_zero3_conversion_in_two_processes_equals_the_one_process_conversion(zero3, name):
    src, out = zero3
    done = worker.conversions(src / name)
    expected_names = {"paper"} if name in NATIVE else set(worker.CONVERSIONS) - ({"fit"} if name == "t5" else set())
    assert set(done) == expected_names
    for conversion, keywords in done.items():
        expected = _one_process(src / name, conversion, keywords)
        saved = torch.load(out / name / f"{conversion}.pt")
        state, want = saved["state"], expected.state_dict()
        assert state.keys() == want.keys(), (conversion, state.keys() ^ want.keys())
        different = [key for key in want if not torch.equal(state[key], want[key])]
        assert not different, (name, conversion, different)
        if name not in NATIVE:
            assert saved["alibi"] == expected.config.alibi, conversion
    if name not in NATIVE:  # the position path is really converted: the preset folded the mean into GPT-2's wte
        original = _original(name).state_dict()
        pretrained = torch.load(out / name / "pretrained.pt")["state"]
        if name == "gpt2":
            mean = original["transformer.wpe.weight"][:16].mean(0)
            torch.testing.assert_close(
                pretrained["transformer.wte.weight"], original["transformer.wte.weight"] + mean, rtol=0, atol=1e-6
            )


@pytest.mark.parametrize("name", CONVERTED)
def test_a_saved_conversion_reloads_under_zero3_with_its_weights(zero3, name):
    src, out = zero3
    saved = torch.load(out / name / "reloaded.pt")
    auto = getattr(transformers, (src / f"{name}-alibi" / "auto_class.txt").read_text().strip())
    expected = auto.from_pretrained(src / f"{name}-alibi")
    assert saved["class"] == type(expected).__name__ and saved["class"].startswith("Alibi")
    want = expected.state_dict()
    assert saved["state"].keys() == want.keys()
    assert all(torch.equal(saved["state"][key], want[key]) for key in want), name


def test_an_fsdp2_sharded_model_is_refused_whole(zero3):
    _, out = zero3
    report = json.loads((out / "refusals.json").read_text())
    assert report["message"] and "changes the model's weights, but they are sharded DTensors" in report["message"]
    assert "use the whole model first, then shard it" in report["message"]
    assert "\n" not in report["message"] and report["unchanged"], report


def test_a_meta_model_is_refused_where_the_conversion_reads_weights():
    with torch.device("meta"):
        model = _original("gpt2")
    with pytest.raises(ValueError, match="meta device") as error:
        hf_alibi.patch_model(model, preset="pretrained")  # folds wpe's mean into wte: values
    assert "\n" not in str(error.value)
    assert type(model).__name__ == "GPT2LMHeadModel" and hasattr(model.transformer, "wpe")  # unchanged
    with pytest.raises(ValueError, match="meta device"):
        hf_alibi.fit_slopes(model, worker.FIT_IDS[None])
    hf_alibi.patch_model(model)  # the paper's method reads no weight: it converts an empty model
    assert model.config.model_type == "alibi_gpt2"


# run_clm.py --alibi --deepspeed, converting a pretrained checkpoint (the same initial weights everywhere: a model
# built under zero.Init is initialized partition by partition, so from scratch the runs would start apart): 2
# processes of 4 rows each against one process of 8 (the same 8 rows per step: accelerate gives rank r the r-th batch
# of each pair), no dropout, so the losses differ only by how the ranks' sums are reduced
SCRIPT = str(ROOT / "scripts" / "run_clm.py")
TRAIN = ["--alibi", "--report_to", "none", "--seed", "0", "--block_size", "32", "--do_train", "--disable_tqdm",
         "true", "--max_steps", "3", "--logging_steps", "1", "--max_train_samples", "64", "--save_strategy", "steps",
         "--save_steps", "2", "--learning_rate", "1e-3"]  # fmt: skip


def _run_clm(init: Path, out: Path, *extra: str, processes: int = 1, deepspeed: str | None = None) -> list[float]:
    """run_clm.py on ``init``, one process (8 rows a step) or ``processes`` under torchrun (8 / processes each): the
    losses it logged."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_ALIBI_CACHE=str(init / "cache"),
               HF_DATASETS_CACHE=str(init / "cache" / "ds"), DS_ACCELERATOR="cpu")  # fmt: skip
    command = [sys.executable, SCRIPT] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
        str(free_port()), SCRIPT]  # fmt: skip
    command += ["--model_name_or_path", str(init / "model"), *TRAIN, "--output_dir", str(out), *extra]
    command += ["--per_device_train_batch_size", str(8 // processes)]
    if deepspeed is None:
        command += ["--use_cpu"]
    elif deepspeed == "fsdp2":  # the Trainer's own FSDP arguments, FSDP2 on gloo (train.distributed.fsdp_on_cpu)
        command += ["--use_cpu", "--fsdp", "full_shard", "--fsdp_config", str(ROOT / "configs/fsdp/fsdp2.json")]
    else:
        command += ["--deepspeed", str(ROOT / "configs" / "deepspeed" / deepspeed)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """A tiny original GPT-2 with the embedded corpus's tokenizer (``init/model``), and its one-process run."""
    from hf_alibi.train.data import embedded_tokenizer, load_raw_datasets

    init = tmp_path_factory.mktemp("init")
    tokenizer = embedded_tokenizer(load_raw_datasets(), 512, init / "cache")
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=4, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(init / "model")
    tokenizer.save_pretrained(init / "model")
    single = tmp_path_factory.mktemp("single")
    return init, single, _run_clm(init, single)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)  # the ALiBi class, after import hf_alibi
    assert type(model).__name__ == "AlibiGPT2LMHeadModel"
    return model.state_dict()


@pytest.mark.parametrize("launch", ["ddp", "zero3.json", "fsdp2", pytest.param("zero2.json", marks=pytest.mark.slow)])
def test_run_clm_in_two_processes_gives_the_single_process_losses_and_checkpoint(single_run, tmp_path, launch):
    """DDP, ZeRO-3, FSDP2 and ZeRO-2 (slow; .ci/run runs it) against one process."""
    init, single, expected = single_run
    config = None if launch == "ddp" else launch
    losses = _run_clm(init, tmp_path / "ds", processes=2, deepspeed=config)
    assert len(losses) == len(expected) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    assert losses[-1] < losses[0]  # it trained (lr 1e-3)
    if launch == "fsdp2":  # sharded, not DDP: the Trainer's FSDP checkpoint file (FULL_STATE_DICT)
        assert (tmp_path / "ds" / "checkpoint-2" / "pytorch_model_fsdp.bin").is_file()
    saved, want = _weights(tmp_path / "ds"), _weights(single)  # the whole model, gathered on save
    assert saved.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(saved[key], want[key], rtol=0, atol=1e-5, msg=key)
    # resumed from its step-2 checkpoint (DeepSpeed's own partitioned optimizer states), step 3 again
    shutil.rmtree(tmp_path / "ds" / "checkpoint-3")  # the last one left: checkpoint-2
    resumed = _run_clm(init, tmp_path / "ds", "--resume_from_checkpoint", "last", processes=2, deepspeed=config)
    torch.testing.assert_close(torch.tensor(resumed[-1]), torch.tensor(losses[-1]), rtol=1e-5, atol=0)


def test_a_deepspeed_config_hf_alibi_cannot_honour_is_one_line_before_anything_is_written(tmp_path):
    """ZeRO-3 without gathering the weights on save: the Trainer would write no whole checkpoint."""
    config = json.loads((ROOT / "configs" / "deepspeed" / "zero3.json").read_text())
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    (tmp_path / "partitions_only.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    command = [sys.executable, SCRIPT, "--model_type", "gpt2", "--alibi", "--do_train", "--max_steps", "1",
               "--output_dir", str(out), "--deepspeed", str(tmp_path / "partitions_only.json")]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_ALIBI_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "ValueError: --deepspeed: a ZeRO-3 config without" in last and "set it true" in last, last
    assert not out.exists()
    with pytest.raises(ValueError, match="zero_optimization.stage is 5; use 0 to 3"):
        hf_alibi.recover.RecoverySettings(deepspeed=_written(tmp_path, {"zero_optimization": {"stage": 5}}))


def _written(folder: Path, config: dict) -> str:
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder / "config.json")
