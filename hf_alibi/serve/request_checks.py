"""What ``hf-alibi serve`` checks in a request before transformers' server sees it: every field its handlers read
without checking (``int(body["max_tokens"])``, ``body["messages"]``, ``float(body["temperature"])``, ...), so that a
bad request answers 400 in OpenAI's error shape instead of HTTP 500, or of killing the continuous-batching worker (a
prompt of no tokens, ``max_tokens: -1``). transformers' own checks stay where they are (unknown fields: 422; a
request naming another model: 400); :mod:`hf_alibi.serve.guard` runs these checks on every request.

Checked on transformers 5.24.0 (``transformers/cli/serving/{completion,chat_completion,response,utils}.py``). The
standard library only, but for transformers' GenerationConfig to check a request's ``generation_config``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
SYSTEMONE, LOAD_MODEL = "/v1/systemone", "/load_model"  # checked by transformers (pydantic), or pinned here
TRANSCRIPTIONS = "/v1/audio/transcriptions"  # a speech model's: refused (the served model is a text model)
GUARDED = (COMPLETIONS, CHAT, RESPONSES, SYSTEMONE, LOAD_MODEL, TRANSCRIPTIONS)
# per endpoint, the fields that bound the new tokens, the one transformers reads first last
MAXIMUM_FIELDS = {COMPLETIONS: ("max_tokens",), CHAT: ("max_tokens", "max_completion_tokens"),
                  RESPONSES: ("max_output_tokens",)}  # fmt: skip
ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = ("text", "input_text", "output_text")
CAP_OPTION = "--max-new-tokens-cap"
DEFAULT_CAP = 1024  # transformers serve's own default for a request that names no maximum
PROMPT_OPTION = "--max-prompt-tokens"
# the deepest nesting of arrays and objects a request body may have: OpenAI's requests nest a few levels (a tool's
# JSON schema a few dozen), and Python's parser, which both servers run on the body again, fails past about 1,000
MAX_JSON_DEPTH = 100
# transformers matches each stop sequence against the whole vocabulary before generating (StopStringCriteria): about
# 30 ms a sequence on SmolLM2's 49,152 tokens, so 50,000 of them would hold the server for half an hour
MAX_STOP, MAX_STOP_CHARS = 16, 128
# the integers a request's fields may hold (64 bits): what torch.manual_seed takes (transformers seeds it with a
# request's seed), and what vLLM reads without a 500 (it fails on top_k: 10**30)
INTEGER_RANGE = (-(1 << 63), (1 << 64) - 1)


@dataclass(frozen=True)
class Limits:
    """What ``hf-alibi serve`` bounds per request and per connection, each with its flag (the defaults here are the
    flags' defaults, shown by ``hf-alibi serve --help``).

    - ``new_tokens``: new tokens per request (``--max-new-tokens-cap``);
    - ``prompt_tokens``: a prompt's tokens, as the model would read them (``--max-prompt-tokens``); a 10 MB prompt
      (3.4M tokens) grew transformers' batching server to 21 GB before the kernel ended it;
    - ``body_bytes``: a request body's bytes (``--max-body-bytes``), refused with 413 from its Content-Length or as
      soon as the bytes read pass it (chunked bodies too);
    - ``read_timeout``: seconds to receive a request's headers, and then its whole body (``--read-timeout``): 408;
    - ``idle_timeout``: seconds a connection may sit without a request (``--idle-timeout``), before its first
      request and between requests (uvicorn's keep-alive timeout);
    - ``concurrent``: generation requests inside the engine at once (``--max-concurrent-requests``); the others
      wait, in arrival order, outside it: 200 requests let into transformers' batching scheduler at once on 2 CPU
      cores held 12 GB and answered none of them in 300 s;
    - ``queued``: requests waiting for one of those places (``--max-queued-requests``); one more: 429.
    """

    new_tokens: int = DEFAULT_CAP
    prompt_tokens: int = 8192
    body_bytes: int = 1 << 20
    read_timeout: float = 30.0
    idle_timeout: float = 15.0  # past httpx's (the openai client's) 5 s keep-alive: the client closes first
    concurrent: int = 16
    queued: int = 1024


# each limit's flag (hf_alibi.cli.parser.SERVE_FLAGS) and the field of Limits it sets
LIMIT_FLAGS = {"max_new_tokens_cap": "new_tokens", "max_prompt_tokens": "prompt_tokens",
               "max_body_bytes": "body_bytes", "read_timeout": "read_timeout",
               "idle_timeout": "idle_timeout", "max_concurrent_requests": "concurrent",
               "max_queued_requests": "queued"}  # fmt: skip


LIMITS_ENV = "HF_ALIBI_SERVE_LIMITS"  # hf-alibi serve --engine vllm: Limits as JSON, for vLLM's server process
VLLM_MIDDLEWARE = "hf_alibi.serve.vllm.guard.VllmGuard"  # what vLLM's --middleware imports


def limits_environment(limits: Limits) -> dict:
    """The environment variables that hand ``limits`` to vLLM's server process (:data:`VLLM_MIDDLEWARE` reads them)
    and to its uvicorn server's keep-alive timeout (whole seconds)."""
    return {LIMITS_ENV: json.dumps(dataclasses.asdict(limits)),
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(max(1, round(limits.idle_timeout)))}  # fmt: skip


def limits_from_environment() -> Limits | None:
    """The limits :func:`limits_environment` handed to this process, or None."""
    given = os.environ.get(LIMITS_ENV)
    return None if given is None else Limits(**json.loads(given))


def openai_error(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, the one shape every refusal of the server is answered in: ``type`` is
    ``invalid_request_error`` for a client's error (status below 500), ``server_error`` otherwise.

    >>> openai_error("no", 503)["error"]["type"]
    'server_error'
    """
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BadRequest(ValueError):
    """A request the server refuses: ``payload()`` is OpenAI's error object, answered with ``status``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def payload(self) -> dict:
        return openai_error(str(self), self.status, self.param, self.code)


def parse_json(raw: bytes | str):
    """The JSON document in ``raw``; raises :class:`BadRequest` (400, ``invalid_json``) where it is not JSON, and
    where Python's parser fails on it beyond the syntax, which a server would answer 500 with a traceback: arrays or
    objects nested deeper than :data:`MAX_JSON_DEPTH`, an integer of more digits than ``int`` reads from text."""
    too_deep = BadRequest(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json")  # fmt: skip
    try:
        document = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors, so is the digits limit
        reason = "an integer too long to read" if "integer string conversion" in str(error) else error
        raise BadRequest(f"the request body is not JSON: {reason}", code="invalid_json") from None
    level, depth = [document], 0
    while True:  # one level of nesting a turn: every value is looked at once
        containers = [value for value in level if isinstance(value, (dict, list))]
        if not containers:
            return document
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise too_deep
        level = [value for c in containers for value in (c.values() if isinstance(c, dict) else c)]


def check_body(path: str, raw: bytes, tokenizer, cap: int, pinned: str, prompt_cap: int | None = None) -> dict:
    """The request ``raw`` (the JSON body POSTed to ``path``, one of :data:`GUARDED`) checked, with the bound on its
    new tokens written in the field transformers reads first (the request's own, or ``cap`` when it names none);
    raises :class:`BadRequest`. ``pinned``: the one model the server serves; ``prompt_cap``: the most tokens a
    prompt may have (None: any).

    >>> check_body("/v1/completions", b'{"prompt": "Hi", "max_tokens": 8}', tokenizer, 1024, "./m")  # doctest: +SKIP
    {'prompt': 'Hi', 'max_tokens': 8}
    """
    if path == TRANSCRIPTIONS:
        raise BadRequest(f"this server serves a text model: {TRANSCRIPTIONS} needs a speech-recognition model",
                         code="unsupported_endpoint")  # fmt: skip
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    if path == LOAD_MODEL and body.get("model") != pinned:  # transformers would load another model beside it
        raise _fail("model", f"{pinned!r}: this server serves that model only", body.get("model"))
    if path not in MAXIMUM_FIELDS:
        return body
    # a null field is the field left out, as OpenAI reads it (transformers' handlers fail on some), and so is an
    # empty logit_bias (transformers' sequence_bias refuses one)
    body = {
        field: value for field, value in body.items() if value is not None and (field, value) != ("logit_bias", {})
    }
    _check_common(body, tokenizer)
    body[MAXIMUM_FIELDS[path][-1]] = bounded_new_tokens(body, MAXIMUM_FIELDS[path], cap)
    check_integers(body)
    if path == COMPLETIONS:
        tokens, param = _check_prompt(body, tokenizer), "prompt"
    else:
        messages = _chat_messages(body["messages"] if "messages" in body else None) if path == CHAT else (
            _response_messages(body))  # fmt: skip
        param = "messages" if path == CHAT else "input"
        tokens = _check_template(messages, body, tokenizer, param)
    if prompt_cap is not None and tokens > prompt_cap:
        raise BadRequest(
            f"`{param}` is {tokens} tokens, over this server's cap of {prompt_cap} prompt tokens (started with "
            f"{PROMPT_OPTION} {prompt_cap}; restart it with a larger {PROMPT_OPTION} to allow more)",
            param=param, code="prompt_too_long",
        )  # fmt: skip
    return body


def _fail(param: str, must: str, value) -> BadRequest:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return BadRequest(f"`{param}` must be {must} (got {shown})", param=param)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def bounded_new_tokens(body: dict, fields: tuple[str, ...], cap: int) -> int:
    """The request's bound on new tokens (its last field given wins, as in transformers), at most ``cap``."""
    asked = None
    for field in fields:
        value = body.get(field)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise _fail(field, "a positive integer (the number of new tokens)", value)
        if value > cap:
            raise BadRequest(
                f"`{field}` is {value}, over this server's cap of {cap} new tokens per request (started with "
                f"{CAP_OPTION} {cap}; restart it with a larger {CAP_OPTION} to allow more)",
                param=field, code="max_tokens_over_cap",
            )  # fmt: skip
        asked = value
    return cap if asked is None else asked


def check_integers(body: dict) -> None:
    """Every top-level integer of a generation request within :data:`INTEGER_RANGE` (both servers' engines)."""
    low, high = INTEGER_RANGE
    for field, value in body.items():
        if _is_int(value) and not low <= value <= high:
            raise _fail(field, "an integer from -2**63 to 2**64 - 1 (64 bits)", value)


def _check_common(body: dict, tokenizer) -> None:
    """The fields every generation endpoint reads (BaseHandler._resolve_model, _build_generation_config)."""
    checks = {
        "model": (lambda v: isinstance(v, str) and v, "a non-empty string"),
        "stream": (lambda v: isinstance(v, bool), "true or false"),
        "parallel_tool_calls": (lambda v: isinstance(v, bool), "true or false"),  # echoed in a pydantic Response
        "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
        "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "seed": (_is_int, "an integer"),  # within 64 bits: check_integers
        # transformers turns it into repetition_penalty = 1 + frequency_penalty, which must be positive
        "frequency_penalty": (lambda v: _is_number(v) and -1 < v <= 2, "a number in (-1, 2]"),
        "n": (lambda v: v == 1 and _is_int(v), "1 (this server answers one choice per request)"),
        "stop": (
            _stop_strings,
            f"a non-empty string or a list of at most {MAX_STOP}, each of at most {MAX_STOP_CHARS} characters",
        ),
        "suffix": (lambda v: isinstance(v, str), "a string"),
        "instructions": (lambda v: isinstance(v, str), "a string"),
        "chat_template_kwargs": (lambda v: isinstance(v, dict), "a JSON object"),
        "tools": (lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "a list of objects"),
        "logit_bias": (
            lambda v: _logit_bias(v, len(tokenizer)),
            f"an object of token ids (0 to {len(tokenizer) - 1}) to numbers in [-100, 100]",
        ),
    }
    for field, (ok, must) in checks.items():
        if body.get(field) is not None and not ok(body[field]):
            raise _fail(field, must, body[field])
    if body.get("generation_config") is not None:
        _check_generation_config(body["generation_config"])


def _stop_strings(value) -> bool:
    values = [value] if isinstance(value, str) else value
    return (
        isinstance(values, list)
        and 0 < len(values) <= MAX_STOP
        and all(isinstance(v, str) and 0 < len(v) <= MAX_STOP_CHARS for v in values)
    )


def _logit_bias(value, vocabulary: int) -> bool:
    if not isinstance(value, dict):
        return False
    return all(k.isdigit() and int(k) < vocabulary and _is_number(v) and -100 <= v <= 100 for k, v in value.items())


def _check_generation_config(value) -> None:
    """transformers builds ``GenerationConfig(**json.loads(value))``: it must, and pass its strict validation (a
    flag that generation would ignore is refused, with GenerationConfig's own reason)."""
    try:
        fields = parse_json(value) if isinstance(value, str) else None
    except BadRequest:
        fields = None
    if not isinstance(fields, dict):
        raise _fail("generation_config", "a string holding a JSON object of GenerationConfig fields", value)
    from transformers import GenerationConfig

    try:
        GenerationConfig(**fields).validate(strict=True)
    except Exception as error:  # noqa: BLE001 (any refusal of GenerationConfig is the client's: answered 400)
        reason = " ".join(str(error).split())
        raise BadRequest(f"`generation_config` is refused: {reason}", param="generation_config") from None


def _check_prompt(body: dict, tokenizer) -> int:
    """The prompt's number of tokens (at least one)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _fail("prompt", "a non-empty string", prompt)
    tokens = len(tokenizer(prompt)["input_ids"])
    if not tokens:
        raise BadRequest(f"`prompt` {prompt!r} is no tokens for this model's tokenizer", param="prompt",
                         code="empty_prompt")  # fmt: skip
    return tokens


def _chat_messages(messages, param: str = "messages") -> list[dict]:
    """The messages as the chat template will see them (transformers' get_processor_inputs_from_messages for a
    text model: content parts joined into one string)."""
    if not isinstance(messages, list) or not messages:
        raise _fail(param, "a non-empty list of messages", messages)
    return [_chat_message(message, f"{param}[{i}]") for i, message in enumerate(messages)]


def _chat_message(message, param: str) -> dict:
    if not isinstance(message, dict):
        raise _fail(param, "an object with `role` and `content`", message)
    role = message.get("role")
    if role not in ROLES:
        raise _fail(f"{param}.role", f"one of {', '.join(ROLES)}", role)
    rendered = {"role": role, "content": _text(message.get("content"), f"{param}.content")}
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise _fail(f"{param}.tool_calls", "absent on a message whose role is not assistant", role)
        rendered["tool_calls"] = _tool_calls(message["tool_calls"], f"{param}.tool_calls")
        rendered["content"] = ""
    if message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise _fail(f"{param}.tool_call_id", "a string", message["tool_call_id"])
        rendered["tool_call_id"] = message["tool_call_id"]
    return rendered


def _text(content, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _fail(param, "a string or a list of text parts", content)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _fail(f"{param}[{i}]", 'a text part ({"type": "text", "text": "..."}: this model reads text only)',
                        part)  # fmt: skip
        texts.append(part["text"])
    return " ".join(texts)


def _tool_calls(calls, param: str) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise _fail(param, "a non-empty list", calls)
    checked = []
    for i, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = parse_json(arguments)
            except BadRequest:
                arguments = None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and isinstance(arguments, dict)):
            raise _fail(f"{param}[{i}]", 'a call {"function": {"name": "...", "arguments": "<a JSON object>"}}', call)
        checked.append({**call, "function": {**function, "arguments": arguments}})
    return checked


def _response_messages(body: dict) -> list[dict]:
    """``/v1/responses``'s ``input`` (and ``instructions``) as chat messages (ResponseHandler._normalize_input)."""
    given = body.get("input")
    if isinstance(given, str) and given:
        messages = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given and all(isinstance(item, dict) for item in given):
        if "role" not in given[0]:  # a flat list of content parts: one user message
            messages = [{"role": "user", "content": given}]
        else:
            messages = [_response_item(item, f"input[{i}]") for i, item in enumerate(given)]
            messages = [message for message in messages if message is not None]
    else:
        raise _fail("input", "a non-empty string or a non-empty list of input items", given)
    if body.get("instructions"):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    return _chat_messages(messages, "input")


def _response_item(item: dict, param: str) -> dict | None:
    kind = item.get("type")
    if "role" in item:
        return {"role": item["role"], "content": item.get("content", "")}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise _fail(param, "a function_call_output with string `call_id` and `output`", item)
        return {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
    if kind == "function_call":
        if not isinstance(item.get("call_id"), str):
            raise _fail(param, "a function_call with a string `call_id`", item)
        call = {"id": item["call_id"], "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "reasoning":
        parts = item.get("content") or []
        if not isinstance(parts, list) or not all(_is_text_part(p) for p in parts):
            raise _fail(param, "a reasoning item whose content is a list of text parts", item)
        return None
    raise _fail(param, "a message (with `role`), function_call, function_call_output or reasoning item", item)


def _is_text_part(part) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str)


def _check_template(messages: list[dict], body: dict, tokenizer, param: str) -> int:
    """The chat template renders ``messages`` into at least one token (transformers renders them again): how many."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest(MISSING_TEMPLATE, param=param, code="chat_template_missing")
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=body.get("tools"), tokenize=True, return_dict=True,
            **(body.get("chat_template_kwargs") or {}),
        )["input_ids"]  # fmt: skip
    except Exception as error:  # noqa: BLE001 (the template refused the client's messages: answered 400)
        raise BadRequest(f"the chat template refused these messages: {error}", param=param,
                         code="chat_template_error") from None  # fmt: skip
    if not ids:
        raise BadRequest("the chat template renders these messages into no tokens", param=param, code="empty_prompt")
    return len(ids)


MISSING_TEMPLATE = (
    "this model's tokenizer has no chat template, so /v1/chat/completions and /v1/responses cannot format messages: "
    "send plain text to /v1/completions, or serve a folder whose tokenizer_config.json has a chat_template"
)
