"""``hf-alibi serve`` survives its clients (hf_alibi/serve/guard.py, hf_alibi/serve/request_checks.py), measured from
outside: the real server on 127.0.0.1 (a child process, tests/serve/test_serve.py's start and stop), a real HTTP
client, plain and ``--continuous-batching``. Bad requests answer 400 in OpenAI's error shape, each followed by good
requests answered with their tokens; no field of any JSON type answers 5xx or breaks a stream; the cap on new
tokens; 32 clients at once, every answer equal to the same request's greedy tokens alone; a worker killed by an input
nobody foresaw ends the process in one line, and the server started again answers as before.

Answers are compared with greedy ``generate()`` of the folder reloaded by transformers alone, on a tiny converted
Llama trained here for a few dozen steps on three sentences: its greedy choices win by a wide logit margin
(checked), so two correct kernels cannot pick different tokens."""

from __future__ import annotations

import json
import random
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_serve
import torch
import transformers
from test_serve import start, stop

import hf_alibi
from hf_alibi.cli import main as cli_main
from hf_alibi.train.data import train_tokenizer

pytestmark = test_serve.pytestmark  # the serving extra, and the server version hf-alibi serve wraps

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Attention with linear biases.", "Hello world, how are you?"]
# prefixes of the training text, cut at words: in distribution, so greedy decoding is decisive
PROMPTS = ["The quick", "The quick brown fox", "Attention", "Attention with", "Hello world", "Hello world, how",
           "fox jumps over", "The quick brown fox jumps over the lazy dog. Attention with"]  # fmt: skip
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the chat prompt is the text itself
CAP = 6  # the servers' --max-new-tokens-cap: below the longest greedy answer, so the cap shows
MARGIN = 0.5  # the least logit lead of each greedy token over the runner-up, checked on every reference
CB = ("--continuous-batching",)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama, converted, trained 40 steps on TEXTS (memorised: each prefix has one clear continuation)."""
    path = tmp_path_factory.mktemp("served-trained")
    tokenizer = train_tokenizer(TEXTS * 20, vocab_size=400)
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=16, vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = hf_alibi.patch_model(transformers.LlamaForCausalLM(config))
    ids = []
    for turn in range(12):
        for text in TEXTS[turn % 3 :] + TEXTS[: turn % 3]:
            ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    data = torch.tensor(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(40):  # rows of 48 tokens: past the 16 positions of the original
        rows = torch.stack([data[s : s + 48] for s in range(step % 23, len(ids) - 48, 31)][:8])
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def greedy(folder):
    """Each prompt's greedy tokens (at most CAP, to the end of text included) from generate() on it alone, the
    folder reloaded by transformers alone; ``answer(prompt, n)`` is the text of the first n."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                          return_dict=True)["input_ids"]])  # fmt: skip
        assert ids[0].tolist() == tokenizer(prompt)["input_ids"]  # the chat prompt is the plain one
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=CAP + 4, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
        tops = [step[0].topk(2).values for step in out.logits]
        assert min(float(top[0] - top[1]) for top in tops) > MARGIN, prompt
        tokens[prompt] = out.sequences[0, ids.shape[1] :].tolist()
    assert any(len(t) > CAP for t in tokens.values())  # the cap cuts some answers

    def answer(prompt: str, n: int) -> str:
        return tokenizer.decode(tokens[prompt][:n], skip_special_tokens=True)

    answer.tokens = tokens
    return answer


def call(port: int, path: str, body, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def ask(port: int, endpoint: str, prompt: str, n: int | None) -> str:
    """The text answered for ``prompt`` on ``endpoint`` (greedy; at most n new tokens, or the server's cap)."""
    field, body = {"completions": ("max_tokens", {"prompt": prompt}),
                   "chat": ("max_completion_tokens", {"messages": [{"role": "user", "content": prompt}]}),
                   "responses": ("max_output_tokens", {"input": prompt, "stream": False})}[endpoint]  # fmt: skip
    body = {**body, "temperature": 0, **({field: n} if n is not None else {})}
    status, answer = call(port, "/v1/" + endpoint.replace("chat", "chat/completions"), body)
    assert status == 200, answer
    if endpoint == "completions":
        return answer["choices"][0]["text"]
    if endpoint == "chat":
        return answer["choices"][0]["message"]["content"]
    return answer["output"][0]["content"][0]["text"]


@pytest.fixture(scope="module", params=[(), CB], ids=["plain", "continuous-batching"])
def server(request, folder):
    server, port = start(folder, "--max-new-tokens-cap", str(CAP), *request.param)
    yield port
    log = stop(server)
    assert "Traceback" not in log, log[-3000:]  # no request reached a failure inside the server
    assert f"CB: {bool(request.param)}" in log and f"CB: {not request.param}" not in log  # the path asked for
    assert f"hf-alibi serve: at most {CAP} new tokens per request" in log


USER = [{"role": "user", "content": "Hello world"}]
# (endpoint, body, the param the error names): each is HTTP 500, or a dead batching worker, without the guard
BAD = [
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": ["Hello"], "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "Hello", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "Hello", "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 3}, "messages"),
    ("/v1/chat/completions", {"messages": "Hello", "max_tokens": 3}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, "messages"),  # no tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "Hi"}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": -5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "frequency_penalty": -1}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"token": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": USER, "generation_config": "{not json"}, "generation_config"),
    ("/v1/chat/completions", {"messages": USER, "generation_config": '{"max_new_tokens": -1}'}, "generation_config"),
    ("/v1/chat/completions", {"messages": USER, "seed": "one"}, "seed"),
    ("/v1/responses", {"max_output_tokens": 3, "stream": False}, "input"),
    ("/v1/responses", {"input": "", "stream": False}, "input"),
    ("/v1/responses", {"input": [], "stream": False}, "input"),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": -5, "stream": False}, "max_output_tokens"),
    ("/v1/responses", {"input": [{"role": "robot", "content": "Hi"}], "stream": False}, "input[0].role"),
    ("/v1/responses", {"input": "Hello", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),  # a broken stream
    ("/load_model", {"model": "someone/another-model"}, "model"),
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    # what Python's parser fails on past the syntax (500 and a traceback in the server's own parse), and what would
    # hold the server: nesting past the recursion limit, and past 100 levels (here 1 object + 100 arrays, 101); an
    # integer of 5,000 digits; a seed torch cannot take; more stop sequences, or longer, than transformers should match
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, None),
    ("/v1/completions", b'{"prompt": "Hello", "x": ' + b"[" * 100 + b"]" * 100 + b"}", None),
    ("/v1/completions", b'{"prompt": "Hello", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("/v1/completions", {"prompt": "Hello", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "Hello", "stop": ["x"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "Hello", "stop": "x" * 129}, "stop"),
    ("/v1/chat/completions", {"messages": USER, "generation_config": "[" * 5000 + "]" * 5000}, "generation_config"),
]


def test_bad_requests_answer_400_and_the_server_answers_the_next_one(server, greedy):
    """Every bad request: 400 in OpenAI's error shape naming the field, and after each, a good request on each
    endpoint answered with its greedy tokens (the worker alive, nothing left behind)."""
    endpoints = ["completions", "chat", "responses"]
    for i, (path, body, param) in enumerate(BAD):
        status, answer = call(server, path, body)
        assert status == 400, (path, body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param and error["message"], (body, error)
        prompt, n = PROMPTS[i % len(PROMPTS)], 1 + i % CAP
        assert ask(server, endpoints[i % 3], prompt, n) == greedy(prompt, n), (path, body)
    over = call(server, "/v1/completions", {"prompt": "Hello", "max_tokens": CAP + 1})[1]["error"]
    assert over["code"] == "max_tokens_over_cap" and f"--max-new-tokens-cap {CAP}" in over["message"]
    # transformers' own refusals, in the same shape: an unknown field (422), another model's name (400)
    status, answer = call(server, "/v1/completions", {"prompt": "Hello", "unknown_field": 1})
    assert status == 422 and "unknown_field" in answer["error"]["message"]
    status, answer = call(server, "/v1/completions", {"prompt": "Hello", "model": "someone/another-model"})
    assert status == 400 and "pinned" in answer["error"]["message"]
    # a speech model's endpoint (HTTP 500 on a text model without the guard), sent as multipart like a real client
    upload = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--b--\r\n'
    request = urllib.request.Request(f"http://127.0.0.1:{server}/v1/audio/transcriptions", data=upload,
                                     headers={"Content-Type": "multipart/form-data; boundary=b"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["code"] == "unsupported_endpoint"
    with urllib.request.urlopen(f"http://127.0.0.1:{server}/health", timeout=10) as response:
        assert json.loads(response.read())["status"] == "ok"


# every field transformers' handlers read (transformers/cli/serving/{completion,chat_completion,response,utils}.py,
# body.get / body[...]) and a few more clients send, per endpoint, with a value of each JSON type and edge
FIELDS = {
    "/v1/completions": ({"prompt": "Hello", "max_tokens": 2}, ["prompt", "max_tokens", "temperature", "top_p", "n",
                        "stream", "stop", "frequency_penalty", "logit_bias", "seed", "suffix", "generation_config",
                        "logprobs", "echo", "best_of", "user", "stream_options"]),
    "/v1/chat/completions": ({"messages": USER, "max_tokens": 2}, ["messages", "max_tokens", "max_completion_tokens",
                             "temperature", "top_p", "n", "stream", "stop", "frequency_penalty", "logit_bias", "seed",
                             "tools", "tool_choice", "response_format", "chat_template_kwargs", "generation_config",
                             "parallel_tool_calls", "logprobs", "top_logprobs"]),
    "/v1/responses": ({"input": "Hello", "max_output_tokens": 2}, ["input", "instructions", "max_output_tokens",
                      "temperature", "top_p", "stream", "tools", "tool_choice", "parallel_tool_calls",
                      "generation_config", "seed", "metadata", "text"]),
}  # fmt: skip
ANY_JSON = [None, True, False, -1, 0, 1, 10**30, 1.5, 1e308, "", "x", "9" * 3000, [], [1, 2], ["a"], [[1]],
            [{"type": "text", "text": "Hi"}], {}, {"a": 1}]  # fmt: skip


def test_no_field_of_any_json_type_fails_the_server(server):
    """Each field, each JSON type, streamed and not: answered 200 or refused 4xx, never 5xx; a stream that breaks
    after its 200 leaves a traceback in the log, which the fixture's teardown finds."""
    for path, (base, fields) in FIELDS.items():
        for field in fields:
            for value in ANY_JSON:
                for stream in (False, True):
                    body = {**base, "stream": stream, field: value} if field != "stream" else {**base, field: value}
                    status, answer = call_raw(server, path, body)
                    assert status < 500, (path, field, value, stream, answer)


def call_raw(port: int, path: str, body) -> tuple[int, bytes]:
    """The status and the body as it came (JSON, or a stream's events)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_what_the_checks_take_at_their_edges_is_answered(server, greedy):
    """JSON nested exactly 100 levels (a tool's schema), the largest seed torch takes, 16 stop sequences of 128
    characters (none in the answer), a null field and an empty logit_bias (each read as the field left out; both are
    HTTP 500 in transformers' handler): answered with the greedy tokens."""
    schema = {}
    for _ in range(95):
        schema = {"items": schema}  # 96 levels of objects, under the body, tools, the tool and its function: 100
    prompt = PROMPTS[1]
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "temperature": 0, "seed": 2**64 - 1,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            "stop": ["~" * 128] * 16, "chat_template_kwargs": None, "logit_bias": {}}  # fmt: skip
    status, answer = call(server, "/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["message"]["content"] == greedy(prompt, 3), answer


def test_a_request_naming_no_maximum_gets_the_cap(server, greedy):
    """Without max_tokens, transformers' server generates up to 1024 tokens (more on a request's own
    generation_config): here the cap, on each endpoint; a generation_config asking more is held to it too."""
    long = max(PROMPTS, key=lambda p: len(greedy.tokens[p]))
    for endpoint in ("completions", "chat", "responses"):
        assert ask(server, endpoint, long, None) == greedy(long, CAP)
    body = {"prompt": long, "temperature": 0, "generation_config": json.dumps({"max_new_tokens": 50})}
    status, answer = call(server, "/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == CAP
    assert answer["choices"][0]["text"] == greedy(long, CAP)


def requests_mix(count: int, seed: int = 0) -> list[tuple[str, str, int]]:
    pick = random.Random(seed)
    return [(pick.choice(["completions", "chat", "responses"]), pick.choice(PROMPTS), pick.randint(1, CAP))
            for _ in range(count)]  # fmt: skip


def under_load(port: int, greedy, count: int, clients: int = 32) -> None:
    """``count`` requests (mixed endpoints, prompts, lengths) from ``clients`` at once, every eighth a bad one: each
    good answer equals the same request's greedy tokens alone, each bad one answers 400 (in continuous batching,
    they arrive while the worker runs a batch)."""
    mix = requests_mix(count)

    def one(i: int):
        if i % 8 == 7:
            path, body, _ = BAD[i % len(BAD)]
            return call(port, path, body)[0]
        return ask(port, *mix[i])

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(one, range(count)))
    expected = [400 if i % 8 == 7 else greedy(prompt, n) for i, (_, prompt, n) in enumerate(mix)]
    assert answers == expected
    assert len(set(answers)) > 5  # the prompts lead to different answers: a mix-up would show
    print(f"{count} requests from {clients} clients in {time.monotonic() - started:.1f} s")


def test_32_clients_at_once_each_get_their_own_answer(server, greedy):
    under_load(server, greedy, count=96)


@pytest.mark.slow
def test_32_clients_sustained(server, greedy):
    under_load(server, greedy, count=480)


@pytest.fixture(scope="module")
def broken_folder(folder, tmp_path_factory):
    """The trained folder with a tokenizer that knows one token more than the model (``<boom>``: an index past
    the embedding, the input nobody foresaw that kills the batching worker) and no chat template."""
    path = tmp_path_factory.mktemp("served-broken")
    shutil.copytree(folder, path, dirs_exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<boom>"])
    tokenizer.chat_template = None
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config.get("chat_template") is None and not (path / "chat_template.jinja").exists()
    return path


def test_a_dead_batching_worker_ends_the_server_in_one_line_and_a_restart_answers(broken_folder, greedy):
    server, port = start(broken_folder, *CB)
    try:
        status, answer = call(port, "/v1/chat/completions", {"messages": USER})
        assert status == 400 and answer["error"]["code"] == "chat_template_missing"
        assert "no chat template" in answer["error"]["message"] and "/v1/completions" in answer["error"]["message"]
        assert ask(port, "completions", "The quick", 4) == greedy("The quick", 4)
        status, answer = call(port, "/v1/completions", {"prompt": "The quick <boom>", "max_tokens": 3})
        # the worker's failure reaches this request as a failed generation (500) or a dead worker (503), whichever
        # transformers sees first
        assert status in (500, 503) and answer["error"]["type"] == "server_error", answer
        code = server.wait(timeout=30)  # without the watch: it answers 503 to every request, until stopped
    finally:
        log = stop(server)
    assert code == 3
    last = log.strip().splitlines()[-1]
    assert last.startswith("hf-alibi serve: the continuous-batching worker died (index out of range")
    assert last.endswith("exiting with status 3 so that a supervisor restarts the server")
    assert "hf-alibi serve: MODEL's tokenizer has no chat template" in log
    server, port = start(broken_folder, *CB)  # what the supervisor does
    try:
        assert ask(port, "completions", "The quick", 4) == greedy("The quick", 4)
    finally:
        stop(server)


@pytest.mark.parametrize("value", ["0", "-3", "many", None])
def test_a_bad_cap_is_one_line(folder, capsys, value):
    with pytest.raises(SystemExit) as caught:
        cli_main(["serve", str(folder), "--port", "8000", "--max-new-tokens-cap", *([value] if value else [])])
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.startswith("hf-alibi: error: ") and error.count("\n") == 1
    assert "--max-new-tokens-cap takes a positive number" in error


def test_a_folder_without_a_tokenizer_is_one_line(folder, tmp_path, capsys):
    """The requests' checks need MODEL's tokenizer: a folder without one is refused in one line before the server
    starts (transformers' server raised its own traceback while preloading)."""
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (tmp_path / name).unlink(missing_ok=True)
    with pytest.raises(SystemExit) as caught:
        cli_main(["serve", str(tmp_path), "--port", "8000"])
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.startswith("hf-alibi: error: ") and error.count("\n") == 1
    assert "has no tokenizer that loads" in error
