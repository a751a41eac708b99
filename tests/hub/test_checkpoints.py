"""hf_alibi/hub/checkpoints.py and hf_alibi/convert/positions.py: one answer to each question about a checkpoint and
its positions (the package's imports: tests/test_imports.py)."""

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from arch_cases import CASE_IDS, CASES
from transformers import GPT2Config, LlamaConfig, RobertaConfig, RobertaModel, T5Config

from hf_alibi.convert.positions import original_length, position_limit, position_table
from hf_alibi.hub import checkpoints
from hf_alibi.hub.checkpoints import CheckpointError, is_alibi, source_kind
from hf_alibi.recover import original_length as model_original_length


def tiny_roberta(pad_token_id=1) -> RobertaModel:
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=66, pad_token_id=pad_token_id,
    )  # fmt: skip
    return RobertaModel(config).eval()


def test_roberta_length_is_what_the_model_can_run():
    """The reference is the model itself: RoBERTa numbers positions from pad + 1, so 66 rows hold 64 tokens."""
    model = tiny_roberta()
    ids = torch.full((1, 65), 7)
    with torch.no_grad():
        model(input_ids=ids[:, :64])  # positions 2..65: the last row of the table
        with pytest.raises((IndexError, RuntimeError), match="out of (range|bounds)"):
            model(input_ids=ids)  # position 66: past the table
    config_dict = model.config.to_dict()
    assert original_length(config_dict) == original_length(model.config) == original_length(model) == 64
    assert model_original_length(model) == 64  # hf_alibi.recover
    assert position_limit(model) == 64  # hf_alibi.convert.positions (was 66: the table's rows)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_position_table_is_the_one_the_model_reads_from_its_first_used_row(case):
    """The reference is the model: with row i of its table set to i, what the table gives position 0 is the
    index position_table names, and the rows from there hold the original length (OPT's embed_positions too)."""
    model = case.make(attn_implementation="eager")
    found = position_table(model)
    if case.model_type not in ("gpt2", "bert", "roberta", "opt"):  # rotary and relative rows: no table
        assert found is None
        return
    table, first = found
    with torch.no_grad():
        table.weight.copy_(torch.arange(table.num_embeddings, dtype=table.weight.dtype)[:, None])
    seen = []
    handle = table.register_forward_hook(lambda module, args, output: seen.append(output[0, 0, 0].item()))
    with torch.no_grad():
        model(**case.inputs(1, 5))
    handle.remove()
    assert seen == [first]
    assert table.num_embeddings - first == original_length(model)


def test_original_length_other_configs():
    assert original_length(GPT2Config(n_positions=48)) == 48
    assert original_length({"model_type": "gpt2", "n_positions": 48}) == 48
    assert original_length(LlamaConfig(max_position_embeddings=8192)) == 8192
    assert original_length(T5Config()) is None  # relative positions: no limit stated
    # a null pad_token_id no longer raises TypeError; it counts as 0 (offset 1)
    assert original_length({"model_type": "roberta", "max_position_embeddings": 66, "pad_token_id": None}) == 65
    assert original_length({"model_type": "bert", "max_position_embeddings": 66, "pad_token_id": None}) == 66


def test_is_alibi_for_dicts_and_configs():
    assert is_alibi({"model_type": "alibi_gpt2", "alibi": {"heads": 4}})
    assert not is_alibi({"model_type": "gpt2", "alibi": {"heads": 4}})  # the prefix is part of the rule
    assert not is_alibi({"model_type": "alibi_gpt2"})  # and the settings
    assert not is_alibi(GPT2Config())


@pytest.mark.parametrize("name", ["my folder/v1", "user/na me", "a--b", "x/" + "y" * 120])
def test_a_name_that_is_neither_is_refused_at_once(name):
    assert not checkpoints.is_local(name) and not checkpoints.is_hub_id(name)
    with pytest.raises(CheckpointError, match="neither a folder nor a valid Hub id"):
        source_kind(name)


def test_folders_and_hub_ids(tmp_path):
    assert source_kind(str(tmp_path)) == "folder" and source_kind("./missing") == "folder"
    assert source_kind("a/b/c") == "folder"  # more than one "/": a path, never a Hub id
    assert checkpoints.is_hub_id("openai-community/gpt2") and checkpoints.is_hub_id("gpt2")


def test_offline_hub_id_fails_without_waiting(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set and it is not in the local cache"):
        checkpoints.read_config("someone/some-model")
    assert time.perf_counter() - start < 5  # no network attempt (a generous bound, not a benchmark)


def test_staged_output_turns_oserror_into_one_error(tmp_path):
    out = tmp_path / "new" / "out"
    with pytest.raises(CheckpointError, match="Could not write OUT .*: No space left on device"):
        with checkpoints.staged_output(out) as staging:
            (staging / "weights").write_text("half")
            raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []  # the staging folder and the parent it made are gone
    with checkpoints.staged_output(out) as staging:
        (staging / "weights").write_text("whole")
    assert [p.name for p in out.iterdir()] == ["weights"] and sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_a_source_is_resolved_once_and_carried(tmp_path, monkeypatch):
    # open_source checks the name and reads config.json once; the job then asks the Source, never the name again
    folder = tmp_path / "src"
    GPT2Config(n_layer=1, n_head=2, n_embd=8).save_pretrained(folder)
    source = checkpoints.open_source(folder)
    assert (source.kind, source.local, source.config["model_type"]) == ("folder", True, "gpt2")
    assert source.has_tokenizer() is False and source.model_class().__name__ == "GPT2LMHeadModel"
    (folder / "tokenizer.json").write_text("{}")
    assert source.has_tokenizer() is True
    assert checkpoints.open_source(source) is source and checkpoints.read_config(folder) == source.config
    asked = []
    monkeypatch.setattr(checkpoints, "check_source", lambda *a: asked.append(a) or "folder")
    assert checkpoints.open_source(source) is source and asked == []  # carried: not checked again
    hub = checkpoints.Source("someone/model", "hub", {"model_type": "gpt2"})
    assert not hub.local and hub.has_tokenizer() is None


_WRITER = """
import sys, time
from hf_alibi.hub.checkpoints import staged_output
with staged_output(sys.argv[1]) as staging:
    (staging / "model.safetensors").write_bytes(b"x" * 3000)  # half a model
    print(staging, flush=True)
    time.sleep(600)
"""


def _writer(out):
    """A process writing ``out`` through staged_output, stopped inside the block: (process, its staging folder)."""
    process = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    return process, Path(process.stdout.readline().strip())


def test_a_killed_runs_staging_folder_is_removed_by_the_next_run_for_that_out(tmp_path, caplog):
    out = tmp_path / "alibi"
    alive, running = _writer(out)  # a run for this OUT, still writing
    killed, dead = _writer(out)  # another, then killed
    killed.send_signal(signal.SIGKILL)  # as the OOM killer does: no handler, no cleanup
    killed.wait(timeout=60)
    unmarked = tmp_path / ".alibi.abcd1234"  # no mark (another tool, an older version): whose, nobody can tell
    unmarked.mkdir()
    (unmarked / "weights").write_bytes(b"y" * 2048)
    other = tmp_path / ".alibi-2.abcd1234"  # another OUT's
    other.mkdir()
    try:
        assert dead.is_dir() and running.is_dir()
        with caplog.at_level(logging.WARNING, logger="hf_alibi"):
            with checkpoints.staged_output(out) as staging:
                (staging / "weights").write_text("whole")
        assert not dead.exists()
        assert running.is_dir() and unmarked.is_dir() and other.is_dir()
        said = [r.getMessage() for r in caplog.records if r.name == "hf_alibi"]
        assert sorted(said) == sorted(
            [  # its size counts the mark (about 70 bytes)
                f"removed {dead} (3.0 KB): the staging folder of a run for alibi that died (pid {killed.pid})",
                f"left {unmarked} (2.0 KB) alone: the staging folder of a run that left no mark for alibi; "
                "remove it if no run is writing it",
            ]
        ), said
        assert sorted(p.name for p in out.iterdir()) == ["weights"]  # the mark is not part of OUT
    finally:
        alive.kill()
        alive.wait(timeout=60)
