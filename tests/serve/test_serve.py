"""``hf-alibi serve`` (hf_alibi/serve/server.py): a converted tiny Llama behind transformers' own server, started as a
child process on 127.0.0.1, with and without ``--continuous-batching``. Every answer is checked against greedy
``generate()`` of the same converted model on the same chat-templated prompt, alone: one request, one streamed, and
8 at once (each answer its own request's, none mixed up)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version
from transformers.utils.import_utils import is_serve_available

import hf_alibi
from hf_alibi.cli import main as cli_main
from hf_alibi.serve.server import SERVER_CHECKED
from hf_alibi.train.data import train_tokenizer

pytestmark = [
    pytest.mark.skipif(
        not is_serve_available(),
        reason="transformers serve needs its serving extra: pip install 'transformers[serving]'",
    ),
    pytest.mark.skipif(  # below it, hf-alibi serve refuses in one line (test_serve_version.py)
        version.parse(transformers.__version__) < version.parse(SERVER_CHECKED),
        reason=f"hf-alibi serve wraps transformers {SERVER_CHECKED}'s server or newer",
    ),
]

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Attention with linear biases.", "Hello world, how are you?"]
QUESTIONS = ["Hello world", "How are you?", "The lazy dog", "Linear biases", "fox", "Attention!", "quick brown", "Hi"]
NEW_TOKENS = 12
READY_SECONDS = 60


def chat_folder(path, build) -> Path:
    """``path`` holding ``build(tokens)`` (a model from the token ids it needs), saved, and a tokenizer trained here
    with a chat template (prompts past 16 positions)."""
    tokenizer = train_tokenizer(TEXTS * 20, vocab_size=400)
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    tokens = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    build(tokens).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A converted tiny Llama (16 positions)."""
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=16)  # fmt: skip
    return chat_folder(tmp_path_factory.mktemp("served"), lambda tokens: hf_alibi.patch_model(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, **tokens)).eval()))  # fmt: skip


@pytest.fixture(scope="module")
def bloom_folder(tmp_path_factory):
    """A tiny BLOOM (trained with ALiBi: its original format, no hf_alibi in config.json)."""
    config = dict(hidden_size=32, n_layer=2, n_head=4, initializer_range=0.5)
    return chat_folder(tmp_path_factory.mktemp("served-bloom"), lambda tokens: transformers.BloomForCausalLM(
        transformers.BloomConfig(**config, **tokens)))  # fmt: skip


@pytest.fixture(scope="module")
def expected(folder):
    return greedy_answers(folder)


@pytest.fixture(scope="module")
def bloom_expected(bloom_folder):
    return greedy_answers(bloom_folder)


def greedy_answers(folder) -> dict[str, str]:
    """Each question's greedy answer from generate() on it alone (the folder reloaded, as the server loads it, by
    transformers alone: a converted folder's remote code, BLOOM's own class)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    answers = {}
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(messages(question), add_generation_prompt=True, return_dict=True)
        ids = torch.tensor([ids["input_ids"]])
        assert ids.shape[1] > 16  # past the original position table
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        answers[question] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(answers.values())) > 1  # the prompts lead to different answers: a mix-up would show
    return answers


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(port: int, body: dict, timeout: float = 60):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    return urllib.request.urlopen(request, timeout=timeout)


def ask(port: int, folder, question: str) -> str:
    body = {"model": str(folder), "messages": messages(question), "max_tokens": NEW_TOKENS, "temperature": 0}
    with post(port, body) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def ask_streaming(port: int, folder, question: str) -> str:
    body = {"model": str(folder), "messages": messages(question), "max_tokens": NEW_TOKENS, "temperature": 0,
            "stream": True}  # fmt: skip
    text = []
    with post(port, body) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                for choice in json.loads(line.removeprefix("data:"))["choices"]:
                    text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def start(folder, *options: str) -> tuple[subprocess.Popen, int]:
    """The server on a free port, ready; its log goes to a file (a pipe nobody reads would fill after a few hundred
    requests' log lines and stall the server), read by :func:`stop`."""
    port = free_port()
    command = [sys.executable, "-m", "hf_alibi", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", *options]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    server.log = log
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited ({server.returncode}):\n{read_log(server)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if json.loads(response.read()).get("status") == "ok":
                    return server, port
        except OSError:
            time.sleep(0.5)
    server.kill()
    server.wait()
    raise AssertionError(f"the server was not ready in {READY_SECONDS} s:\n{read_log(server)}")


def read_log(server: subprocess.Popen) -> str:
    server.log.seek(0)
    return server.log.read()


def stop(server: subprocess.Popen) -> str:
    """Stop the server; its whole log."""
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log = read_log(server)
    server.log.close()
    return log


@pytest.mark.parametrize("options", [(), ("--continuous-batching",)], ids=["plain", "continuous-batching"])
def test_transformers_serve_answers_each_request_with_its_greedy_tokens(folder, expected, options):
    server, port = start(folder, *options)
    try:
        assert ask(port, folder, QUESTIONS[0]) == expected[QUESTIONS[0]]
        # streamed: the same text, but for trailing bytes of an unfinished character, which a streaming detokenizer
        # holds back (the tiny model's byte-level tokens often end mid-character)
        streamed, whole = ask_streaming(port, folder, QUESTIONS[1]), expected[QUESTIONS[1]]
        assert streamed and whole.startswith(streamed) and not whole[len(streamed) :].strip("\ufffd")
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # all at once: none lost, none mixed up
            answers = list(pool.map(lambda q: ask(port, folder, q), QUESTIONS))
        assert answers == [expected[q] for q in QUESTIONS]
    finally:
        log = stop(server)
    # transformers' own log of each request: which path served it
    assert f"CB: {bool(options)}" in log and f"CB: {not options}" not in log


def test_a_model_trained_with_alibi_is_served_on_hf_alibis_attention(bloom_folder, bloom_expected):
    """A BLOOM folder (its original format) behind the server with continuous batching, which transformers' own
    BLOOM cannot run (its forward asks the paged cache for a length): 8 requests at once, each answered with its
    greedy tokens from transformers' own BLOOM, none mixed up."""
    server, port = start(bloom_folder, "--continuous-batching")
    try:
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(lambda q: ask(port, bloom_folder, q), QUESTIONS))
        assert answers == [bloom_expected[q] for q in QUESTIONS]
    finally:
        log = stop(server)
    assert "CB: True" in log and "CB: False" not in log


def test_serve_needs_a_converted_model_first(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        cli_main(["serve", "--port", "8000"])
    assert caught.value.code == 2 and "MODEL first" in capsys.readouterr().err
    original = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))  # fmt: skip
    original.save_pretrained(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        cli_main(["serve", str(tmp_path)])
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.startswith("hf-alibi: error: ") and error.count("\n") == 1
    assert "not an ALiBi checkpoint" in error and "hf-alibi convert" in error


def test_serve_without_the_serving_extras_says_what_to_install(folder):
    """transformers' own check (is_serve_available) finds no fastapi: one line naming the extra, before MODEL loads
    (transformers' server would raise its ImportError, a whole traceback, after loading it)."""
    code = "import sys; sys.modules['fastapi'] = None; import hf_alibi.cli as b; sys.exit(b.main(sys.argv[1:]))"
    child = subprocess.run(
        [sys.executable, "-c", code, "serve", str(folder), "--port", "8000"], capture_output=True, text=True,
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert child.returncode == 2, child.stderr[-3000:]
    assert child.stderr.count("\n") == 1 and child.stderr.startswith("hf-alibi: error: ")
    assert "pip install 'hf_alibi[serve]'" in child.stderr and "transformers[serving]" in child.stderr


def test_a_model_trained_with_alibi_gets_one_serving_class_per_original(bloom_folder):
    # serve() asks for the class twice (before and after transformers' CLI app is made): the same class both times
    from hf_alibi.hub.checkpoints import read_config
    from hf_alibi.serve.server import native_loader

    config = read_config(str(bloom_folder), "MODEL")
    first, second = native_loader(config, str(bloom_folder)), native_loader(config, str(bloom_folder))
    assert (
        first is second
        and first.__name__ == "BloomForCausalLM"
        and first._served_original.__module__.startswith("transformers.")
    )
