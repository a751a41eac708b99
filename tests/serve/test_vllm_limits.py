"""``hf-alibi serve MODEL --engine vllm``'s bounds (hf_alibi/serve/vllm/guard.py, in vLLM's own OpenAI server as its
``--middleware``; hf_alibi/serve/connections.py in its uvicorn server), measured from outside on the real vLLM server
on 127.0.0.1 (marker vllm; tests/serve/test_vllm.py's tiny converted Llama and its offline engine's tokens):

- a body over ``--max-body-bytes`` declared by its Content-Length: 413 in OpenAI's shape, the connection closed;
- a body announced and never sent: 408 within ``--read-timeout``; a connection that sends nothing: closed after
  ``--idle-timeout`` (vLLM's server keeps both open as long as the client likes);
- a JSON body nested past 100 levels or holding an integer too long to read, on a generation endpoint or any other
  JSON one: 400 in OpenAI's shape (vLLM's own parse answers FastAPI's ``{"detail": ...}``); a field's integer past 64
  bits: 400 (vLLM answers ``top_k: 10**30`` with a 500);
- ``max_tokens`` past ``--max-new-tokens-cap``: 400; a request naming no maximum generates at most the cap;
- a good request, streamed and not, is answered with the offline engine's greedy tokens, and ``/hf-alibi/load``
  counts nothing in flight after it."""

from __future__ import annotations

import hf_alibi_boot.vllm  # noqa: F401  first: where .[vllm] put CUDA builds of torchvision & co, hides them

# isort: split
import json
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from test_serve_limits import assert_openai_error, read_answer
from test_vllm import MAX_TOKENS, PROMPTS, _post, _run_engine, _vllm_server, folders  # noqa: F401 (fixture)

pytestmark = pytest.mark.vllm

BODY_LIMIT, READ_TIMEOUT, IDLE_TIMEOUT, CAP = 65536, 2, 2, 16
FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
         "--max-num-batched-tokens", "64"]  # fmt: skip


@pytest.fixture(scope="module")
def server(folders):  # noqa: F811
    limits = ["--max-body-bytes", str(BODY_LIMIT), "--read-timeout", str(READ_TIMEOUT), "--idle-timeout",
              str(IDLE_TIMEOUT), "--max-new-tokens-cap", str(CAP)]  # fmt: skip
    entry = ("-m", "hf_alibi", "serve")
    with _vllm_server(folders["llama"], "--engine", "vllm", *limits, *FLAGS, entry=entry) as base:
        yield SimpleNamespace(port=int(base.rsplit(":", 1)[1].split("/")[0]))


def raw(port: int, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(payload)
    return sock


def test_vllms_server_bounds_bodies_their_time_and_idle_connections(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with raw(server.port, head + b"Content-Length: 10000000\r\n\r\n" + b'{"prompt": "' + b"a" * 60000) as sock:
        status, payload, rest = read_answer(sock)
    assert status == 413 and rest == b""
    assert_openai_error(payload, "request_too_large")
    with raw(server.port, head + b"Content-Length: 1000\r\n\r\n{") as sock:
        started = time.monotonic()
        status, payload, rest = read_answer(sock)
        waited = time.monotonic() - started
    assert status == 408 and rest == b"" and READ_TIMEOUT - 0.2 < waited < READ_TIMEOUT + 1.5
    assert_openai_error(payload, "request_timeout")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""
        assert time.monotonic() - started < IDLE_TIMEOUT + 1.5


def test_vllms_server_answers_400_for_what_vllm_fails_on(server, folders):  # noqa: F811
    deep = b"[" * 5000 + b"]" * 5000
    nested = b'{"model": "m", "prompt": "a", "x": ' + b"[" * 100 + b"]" * 100 + b"}"  # 101 levels
    digits = b'{"model": "m", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"
    for path, body in [("/v1/completions", deep), ("/v1/completions", nested), ("/v1/chat/completions", digits),
                       ("/tokenize", deep)]:  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400, (path, body[:40])
        assert_openai_error(json.loads(refused.value.read()), "invalid_json")
    base, model = f"http://127.0.0.1:{server.port}/v1", str(folders["llama"])
    with pytest.raises(urllib.error.HTTPError) as refused:  # vLLM alone: 500
        _post(f"{base}/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 2, "top_k": 10**30})
    assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["param"] == "top_k"
    assert _post(f"{base}/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 2, "top_k": 2**63})


def test_vllms_server_caps_new_tokens_and_answers_good_requests_as_the_offline_engine(server, folders, tmp_path):  # noqa: F811
    offline = _run_engine(folders["llama"], tmp_path, rounds=1)[0]
    base, model = f"http://127.0.0.1:{server.port}/v1", str(folders["llama"])
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    for i, prompt in enumerate(PROMPTS):
        assert (
            _post(f"{base}/completions", {**body, "prompt": prompt})["choices"][0]["token_ids"] == offline[i]["tokens"]
        )
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(f"{base}/completions", {**body, "prompt": PROMPTS[0], "max_tokens": CAP + 1})
    assert refused.value.code == 400
    assert_openai_error(json.loads(refused.value.read()), "max_tokens_over_cap")
    unbounded = {"model": model, "prompt": PROMPTS[1], "temperature": 0, "ignore_eos": True}
    assert _post(f"{base}/completions", unbounded)["usage"]["completion_tokens"] == CAP
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/hf-alibi/load", timeout=10) as answer:
        assert json.loads(answer.read()) == {"in_flight": 0, "queued": 0}
