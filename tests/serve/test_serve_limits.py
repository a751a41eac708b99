"""``hf-alibi serve``'s bounds on hostile clients (hf_alibi/serve/guard.py, hf_alibi/serve/connections.py), measured
from outside: the real server on 127.0.0.1 (a child process, tests/serve/test_serve.py's start and stop), plain and
``--continuous-batching``, driven by raw sockets and the official ``openai`` client.

- a body over ``--max-body-bytes``, declared (Content-Length) or not (chunked), and a 10 MB one sent by the
  ``openai`` client: 413 in OpenAI's shape, the connection then closed; the server's RSS does not grow by them;
- a prompt over ``--max-prompt-tokens``: 400 before any generation;
- headers with Content-Length 1000 and no body, headers that never end: 408 within ``--read-timeout``, connection
  closed; a connection that sends nothing, before its first request or after one: closed after ``--idle-timeout``;
- a stream whose client leaves: transformers' batching scheduler holds no request and no cache block within 1 s
  (its own counts, read through ``GET /hf-alibi/load``), and the next request is answered at once with its greedy
  tokens (a generation left running would hold the plain server's one inference thread for seconds); the same for a
  non-streamed request in the batching worker whose client leaves before its answer;
- past ``--max-concurrent-requests`` the requests wait their turn outside the engine, in arrival order (a waiting
  client that leaves leaves the queue; a place freed goes to the next at once), and past ``--max-queued-requests``
  the next is answered 429 with Retry-After.

Every good answer is compared with greedy ``generate()`` of the folder alone (tests/serve/test_serve.py's
``expected``)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import openai
import pytest
import test_serve
from test_serve import NEW_TOKENS, QUESTIONS, ask, expected, folder, start, stop  # noqa: F401 (fixtures)

pytestmark = test_serve.pytestmark

BODY_LIMIT = 65536
PROMPT_LIMIT = 64
READ_TIMEOUT = 2.0
IDLE_TIMEOUT = 1.0
CONCURRENT, QUEUED = 2, 2
ENDLESS = 20000  # new tokens of the streams that hold the places: minutes, longer than the test holds them
LONG = 1000  # new tokens of the stream left: seconds of generation on this untrained model, which never ends early
CB = ("--continuous-batching",)


@pytest.fixture(scope="module", params=[(), CB], ids=["plain", "continuous-batching"])
def server(request, folder):  # noqa: F811
    limits = ("--max-new-tokens-cap", str(ENDLESS), "--max-body-bytes", str(BODY_LIMIT), "--max-prompt-tokens",
              str(PROMPT_LIMIT), "--read-timeout", str(READ_TIMEOUT), "--idle-timeout", str(IDLE_TIMEOUT),
              "--max-concurrent-requests", str(CONCURRENT), "--max-queued-requests", str(QUEUED))  # fmt: skip
    process, port = start(folder, *limits, *request.param)
    process.port = port
    yield process
    log = stop(process)
    assert "Traceback" not in log, log[-3000:]
    assert f"at most {PROMPT_LIMIT} prompt tokens (--max-prompt-tokens; 400), {BODY_LIMIT} body bytes" in log


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The status, the JSON body and whatever follows it until the server closes (b"": closed, nothing more)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.lower().split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    rest = body[length:] + sock.recv(65536)  # the end of the stream
    return int(head.split()[1]), json.loads(body[:length]), rest


def assert_openai_error(payload: dict, code: str) -> None:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["code"] == code and error["message"], error


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("VmRSS")))


def load(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hf-alibi/load", timeout=10) as response:
        return json.loads(response.read())


def test_an_oversized_body_answers_413_and_is_read_no_further(server, folder, expected):  # noqa: F811
    port, head = server.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    before = rss_kib(server.pid)
    for _ in range(3):
        with connect(port) as sock:  # declared: refused from its Content-Length, before the body
            sock.sendall(f"{head}Content-Length: 10000000\r\n\r\n".encode() + b'{"prompt": "' + b"a" * 60000)
            status, payload, rest = read_answer(sock)
            assert status == 413 and rest == b""  # then the end of the stream
            assert_openai_error(payload, "request_too_large")
            assert "10000000 bytes, over this server's limit of 65536 bytes" in payload["error"]["message"]
        with connect(port) as sock:  # chunked: refused once the bytes read pass the limit
            sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            chunk = b"a" * 16384
            for _ in range(8):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            status, payload, rest = read_answer(sock)
            assert status == 413 and rest == b"" and "at least" in payload["error"]["message"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    for _ in range(10):  # 10 MB each, sent whole by the client before it reads the answer
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="m", prompt="a" * 10_000_000, max_tokens=3)
        assert refused.value.status_code == 413 and refused.value.body["code"] == "request_too_large"
    assert rss_kib(server.pid) - before < 20 * 1024  # 40 MB of bodies refused, none of it kept
    assert ask(port, folder, QUESTIONS[0]) == expected[QUESTIONS[0]]


def test_a_prompt_over_the_token_cap_answers_400_before_generation(server):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="m", prompt="Hello world " * 40, max_tokens=LONG)
    assert refused.value.body["code"] == "prompt_too_long" and refused.value.body["param"] == "prompt"
    assert f"over this server's cap of {PROMPT_LIMIT} prompt tokens" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi " * 100}], max_tokens=3)
    assert refused.value.body["code"] == "prompt_too_long" and refused.value.body["param"] == "messages"
    assert time.monotonic() - started < 2  # no generation of LONG tokens ran
    assert load(server.port)["in_flight"] == 0


def test_a_body_or_headers_that_never_come_answer_408_and_idle_connections_close(server):
    port = server.port
    with connect(port) as sock:  # headers, then nothing of the 1000 bytes announced
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        status, payload, rest = read_answer(sock)
        waited = time.monotonic() - started
    assert status == 408 and rest == b"" and READ_TIMEOUT - 0.2 < waited < READ_TIMEOUT + 1
    assert_openai_error(payload, "request_timeout")
    with connect(port) as sock:  # headers that never end
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for _ in range(3):
            time.sleep(0.4)  # a byte now and then: it still must finish in time
            sock.sendall(b"X: y\r\n")
        status, payload, rest = read_answer(sock)
        waited = time.monotonic() - started
    assert status == 408 and rest == b"" and waited < READ_TIMEOUT + 1
    assert_openai_error(payload, "request_timeout")
    with connect(port) as sock:  # nothing at all: closed after the idle timeout
        started = time.monotonic()
        assert sock.recv(100) == b""
        assert IDLE_TIMEOUT - 0.2 < time.monotonic() - started < IDLE_TIMEOUT + 1
    with connect(port) as sock:  # one request, then nothing: closed after the idle timeout
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, payload, _ = read_answer_keep_alive(sock)
        started = time.monotonic()
        assert status == 200 and sock.recv(100) == b""
        assert IDLE_TIMEOUT - 0.2 < time.monotonic() - started < IDLE_TIMEOUT + 1


def read_answer_keep_alive(sock: socket.socket) -> tuple[int, dict, bytes]:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body), b""


def test_a_stream_whose_client_leaves_frees_its_slot_at_once(server, folder, expected):  # noqa: F811
    port = server.port
    body = json.dumps({"prompt": "Hello world", "max_tokens": LONG, "temperature": 0, "stream": True}).encode()
    for _ in range(3):
        sock = connect(port)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        seen = b""
        while seen.count(b"data:") < 3:  # generating
            seen += sock.recv(65536)
        during = load(port)
        assert during["in_flight"] == 1
        if CB[0] in server.args:
            assert during["continuous_batching"]["active"] == 1 and during["continuous_batching"]["cache_blocks_held"]
        sock.close()
        left = time.monotonic()
        while True:
            now = load(port)
            batching = now["continuous_batching"]
            if now["in_flight"] == 0 and (batching is None or not any(batching.values())):
                break
            assert time.monotonic() - left < 1, now
            time.sleep(0.05)
        started = time.monotonic()  # the next request: answered at once (nothing else generating), its own tokens
        assert ask(port, folder, QUESTIONS[1]) == expected[QUESTIONS[1]]
        assert time.monotonic() - started < 1.5


def test_a_batched_request_whose_client_leaves_before_its_answer_is_dropped(server, folder, expected):  # noqa: F811
    """Non-streamed, in the batching worker: transformers' handler awaits the result and never sees the client go;
    the guard drops it from the batch. (Plain serving runs such a request to its end: it cannot be stopped.)"""
    if CB[0] not in server.args:
        pytest.skip("plain serving's generate() has no way to be stopped without a stream")
    port = server.port
    ask(port, folder, QUESTIONS[0])  # the batching worker started
    body = json.dumps({"prompt": "Hello world", "max_tokens": LONG, "temperature": 0}).encode()
    sock = connect(port)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    started = time.monotonic()
    while not load(port)["continuous_batching"]["cache_blocks_held"]:  # generating
        assert time.monotonic() - started < 10
        time.sleep(0.05)
    sock.close()
    left = time.monotonic()
    while True:
        now = load(port)
        if now["in_flight"] == 0 and not any(now["continuous_batching"].values()):
            break
        assert time.monotonic() - left < 1, now
        time.sleep(0.05)
    assert ask(port, folder, QUESTIONS[1]) == expected[QUESTIONS[1]]


def send(port: int, path: str, body: dict) -> socket.socket:
    sock = connect(port)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    return sock


def wait_for(port: int, want: dict, seconds: float = 3.0, batch_empty: bool = False) -> dict:
    """``GET /hf-alibi/load`` until its ``in_flight`` and ``queued`` are ``want``'s (and, with ``batch_empty``, the
    batching scheduler holds no request and no cache block: it drops a finished or cancelled request at its next
    step, just after the handler returns); fails after ``seconds`` (each change is one disconnect seen and one place
    handed on: milliseconds idle, seconds on a loaded machine)."""
    started = time.monotonic()
    while True:
        now = load(port)
        batching = now["continuous_batching"]
        empty = not batch_empty or batching is None or not any(batching.values())
        if {key: now[key] for key in want} == want and empty:
            return now
        assert time.monotonic() - started < seconds, (want, now)
        time.sleep(0.05)


def test_requests_past_the_concurrency_limit_wait_their_turn_and_past_the_queue_get_429(server, folder, expected):  # noqa: F811
    port = server.port
    endless = {"prompt": "Hello world", "max_tokens": ENDLESS, "temperature": 0, "stream": True}
    streams = [send(port, "/v1/completions", endless) for _ in range(CONCURRENT)]  # the places taken
    wait_for(port, {"in_flight": 2, "queued": 0}, 10)
    waiting = []
    for question in QUESTIONS[2:4]:  # two more: they wait, outside the engine
        waiting.append(send(port, "/v1/chat/completions", {"model": str(folder), "messages": [{"role": "user",
                       "content": question}], "max_tokens": NEW_TOKENS, "temperature": 0}))  # fmt: skip
        wait_for(port, {"in_flight": 2, "queued": len(waiting)})
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:  # one more than the queue holds: 429 at once
        client.completions.create(model=str(folder), prompt="Hi", max_tokens=3)
    assert refused.value.status_code == 429 and refused.value.response.headers["retry-after"] == "1"
    assert_openai_error({"error": refused.value.body}, "server_busy")
    assert time.monotonic() - started < 2
    waiting.pop(0).close()  # a waiting client leaves: out of the queue, no place taken
    wait_for(port, {"in_flight": 2, "queued": 1})
    streams.pop(0).close()  # a place freed: the next waiting request goes in at once (and may be answered already)
    assert wait_for(port, {"queued": 0})["in_flight"] in (1, 2)
    streams.pop(0).close()
    status, payload, _ = read_answer_keep_alive(waiting[0])
    waiting.pop(0).close()
    assert status == 200 and payload["choices"][0]["message"]["content"] == expected[QUESTIONS[3]]
    wait_for(port, {"in_flight": 0, "queued": 0}, batch_empty=True)  # nothing left behind in the engine either
