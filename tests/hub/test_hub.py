"""Pushing to the Hub: everything up to the upload, and a clear error when the Hub cannot be reached.

Nothing here reaches the network: ``HfApi.create_repo`` / ``upload_folder`` are replaced by fakes that
record what would be uploaded (a copy of the folder), and that copy is loaded in fresh processes, with
hf_alibi and without it (``trust_remote_code=True``).
"""

import json
import os
import shutil
import subprocess
import sys

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.hf_api import RepoUrl
from sharing import REPO_ROOT, TINY_BY_TYPE, example_inputs, folder_hash, last_json_line, make_tokenizer, run_child

import hf_alibi
from hf_alibi import cli
from hf_alibi.hub import HubConnectionError

try:  # the HTTP client under huggingface_hub: httpx2 (huggingface_hub 2.x) or httpx
    from httpx2 import ConnectError
except ImportError:
    from httpx import ConnectError


class FakeHub:
    """Stands in for the Hub: records create_repo calls and copies each uploaded folder."""

    def __init__(self, root):
        self.root, self.repos, self.uploads = root, [], []

    def install(self, monkeypatch):
        hub = self

        def create_repo(api, repo_id, *, private=None, exist_ok=False, **kwargs):
            hub.repos.append({"repo_id": repo_id, "private": private, "token": api.token})
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(api, *, repo_id, folder_path, commit_message=None, **kwargs):
            copy = hub.root / f"upload{len(hub.uploads)}"
            shutil.copytree(folder_path, copy)
            hub.uploads.append({"repo_id": repo_id, "folder": copy, "commit_message": commit_message, **kwargs})
            return f"https://huggingface.co/{repo_id}/commit/0"

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        return self


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    return FakeHub(tmp_path).install(monkeypatch)


CHILD = """
import json, sys, torch, transformers
expected = torch.load(EXPECTED)
if not BLOCKED:
    import hf_alibi  # registers the ALiBi types: plain from_pretrained, no remote code
kwargs = {"trust_remote_code": True} if BLOCKED else {}
model = transformers.AutoModelForCausalLM.from_pretrained(".", **kwargs).eval()
with torch.no_grad():
    logits = model(**expected["inputs"]).logits
print(json.dumps({"module": type(model).__module__, "diff": (logits - expected["logits"]).abs().max().item(),
                  "alibi": model.config.alibi}))
"""


def test_push_to_hub_uploads_a_folder_that_loads_with_and_without_hf_alibi(fake_hub, tmp_path):
    model = hf_alibi.patch_model(TINY_BY_TYPE["gpt2"].make())
    inputs = example_inputs("gpt2", model)
    with torch.no_grad():
        expected = {"inputs": inputs, "logits": model(**inputs).logits}
    torch.save(expected, tmp_path / "expected.pt")

    model.push_to_hub("me/alibi-tiny", private=True, commit_message="first", tags=["demo"])

    assert fake_hub.repos == [{"repo_id": "me/alibi-tiny", "private": True, "token": None}]
    (upload,) = fake_hub.uploads
    assert upload["repo_id"] == "me/alibi-tiny" and upload["commit_message"] == "first"
    folder = upload["folder"]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_alibi.py", "README.md"} <= names
    card = ModelCard.load(folder / "README.md")
    assert {"alibi", "demo"} <= set(card.data.tags)  # hf_alibi's card, not transformers' generic one
    assert json.loads((folder / "config.json").read_text())["alibi"] == model.config.alibi

    for block in (False, True):
        code = f"EXPECTED = {str(tmp_path / 'expected.pt')!r}\nBLOCKED = {block}\n" + CHILD
        result = run_child(code, folder, tmp_path / f"hf{block}", block_hf_alibi=block)
        assert result.returncode == 0, result.stderr[-4000:]
        report = last_json_line(result.stdout)
        assert report["diff"] <= 1e-6, report
        assert report["alibi"] == model.config.alibi
        assert report["module"].endswith("modeling_alibi" if block else "hf_alibi.models"), report


def test_save_pretrained_with_push_to_hub_uploads_the_remote_code(fake_hub, tmp_path):
    model = hf_alibi.patch_model(TINY_BY_TYPE["gpt2"].make())
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, repo_id="me/saved", commit_message="via save")
    (upload,) = fake_hub.uploads
    assert upload["repo_id"] == "me/saved" and upload["commit_message"] == "via save"
    assert folder_hash(upload["folder"]) == folder_hash(tmp_path / "saved")
    assert (upload["folder"] / "modeling_alibi.py").exists()


def test_cli_push_uploads_exactly_out(fake_hub, tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    TINY_BY_TYPE["gpt2"].make().save_pretrained(src)
    make_tokenizer(src)
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    code = cli.main(["convert", str(src), str(out), "--push-to-hub", "me/cli", "--private", "--commit-message", "m"])
    assert code == 0
    assert fake_hub.repos == [{"repo_id": "me/cli", "private": True, "token": None}]  # HF_TOKEN: huggingface_hub's
    (upload,) = fake_hub.uploads
    assert upload["commit_message"] == "m"
    assert folder_hash(upload["folder"]) == folder_hash(out)
    assert "Pushed" in capsys.readouterr().out


def test_offline_push_fails_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = hf_alibi.patch_model(TINY_BY_TYPE["gpt2"].make())
    with pytest.raises(HubConnectionError) as error:
        model.push_to_hub("me/offline")
    message = str(error.value)
    assert "Could not reach the Hugging Face Hub to push 'me/offline'" in message
    assert "Nothing was uploaded" in message and "HF_HUB_OFFLINE" in message


def test_network_error_during_upload_is_reported_with_the_folder(tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    TINY_BY_TYPE["gpt2"].make().save_pretrained(src)
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: RepoUrl(f"https://huggingface.co/{repo_id}"))

    def upload_folder(api, **kwargs):
        raise ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", str(src), str(out), "--push-to-hub", "me/net"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "hf-alibi: error: Could not reach the Hugging Face Hub to push 'me/net'" in err
    assert str(out) in err and "hf upload me/net" in err
    assert (out / "modeling_alibi.py").exists()  # the converted checkpoint is kept


def test_convert_from_a_hub_id_offline_cache(tmp_path):
    """SRC as a Hub id, resolved from a local Hub cache (offline): base_model lands in the card header."""
    snapshot = tmp_path / "hf" / "hub" / "models--someone--tiny-gpt2" / "snapshots" / ("0" * 40)
    TINY_BY_TYPE["gpt2"].make().save_pretrained(snapshot)
    make_tokenizer(snapshot)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "hf_alibi", "convert", "someone/tiny-gpt2", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "someone/tiny-gpt2"
    assert "[someone/tiny-gpt2](https://huggingface.co/someone/tiny-gpt2)" in card.text
    assert (out / "tokenizer.json").exists()

    missing = subprocess.run(
        [sys.executable, "-m", "hf_alibi", "convert", "someone/not-there", str(tmp_path / "out2")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert missing.returncode == 2
    assert "hf-alibi: error: Could not read the config of SRC 'someone/not-there'" in missing.stderr
    assert not (tmp_path / "out2").exists()
