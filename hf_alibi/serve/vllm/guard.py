"""``hf-alibi serve MODEL --engine vllm``'s bounds on requests, in vLLM's own OpenAI server (its ``--middleware``:
an ASGI class vLLM adds by import path, without arguments, so its limits come from the environment the command line
sets: :func:`hf_alibi.serve.request_checks.limits_environment`).

vLLM's server reads any body whole, however large, keeps a connection whose body never comes open for as long as
the client likes, and queues every request it is sent. Here, as for transformers' server
(:mod:`hf_alibi.serve.guard`, :mod:`hf_alibi.serve.connections`):

- every POST's body at most ``--max-body-bytes`` (413, read no further) and read within ``--read-timeout`` (408);
- the generation requests (completions, chat, responses) at most ``--max-concurrent-requests`` at once inside vLLM,
  the rest waiting in arrival order, at most ``--max-queued-requests`` of them (then 429);
- a request's new tokens at most ``--max-new-tokens-cap``: one that names no maximum gets the cap, one that asks more
  is refused (400);
- a generation request's body, and any JSON one, parsed here first, as for transformers' server: 400 in OpenAI's
  shape for what is not JSON, nests past ``MAX_JSON_DEPTH`` or holds an integer too long to read (vLLM's own parse
  answers FastAPI's ``{"detail": ...}``), and a generation request's integer fields within 64 bits (vLLM answers
  ``top_k: 10**30`` with a 500);
- ``GET /hf-alibi/load``: requests inside and waiting.

What vLLM checks itself (the fields, the prompt against ``--max-model-len``) it answers in OpenAI's shape;
``--max-prompt-tokens`` is transformers' server's only (vLLM's bound is ``--max-model-len``)."""

from __future__ import annotations

import json

from ..guard import CLOSE, LOAD_PATH, Admission, admitted, answer_json, read_body, replayed
from ..request_checks import (
    MAXIMUM_FIELDS,
    BadRequest,
    Limits,
    bounded_new_tokens,
    check_integers,
    limits_from_environment,
    parse_json,
)

JSON_TYPE = b"application/json"


class VllmGuard:
    """ASGI middleware for vLLM's server (see the module)."""

    def __init__(self, app, limits: Limits | None = None):
        self.app, self.limits = app, limits or limits_from_environment() or Limits()
        self.admission = Admission(self.limits.concurrent, self.limits.queued)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == LOAD_PATH:
            await answer_json(send, 200, {"in_flight": self.admission.inside, "queued": self.admission.waiting})
            return
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(scope, receive, self.limits)
        except BadRequest as error:  # 413, 408: the connection closed after the answer
            await answer_json(send, error.status, error.payload(), CLOSE)
            return
        if raw is None:  # the client left
            return
        try:
            raw = self._capped(scope, raw)
        except BadRequest as error:
            await answer_json(send, error.status, error.payload())
            return
        scope, replay = replayed(scope, raw, receive)  # then the client's own stream: vLLM watches it for a disconnect
        if scope["path"] not in MAXIMUM_FIELDS:
            await self.app(scope, replay, send)
            return
        if not await admitted(self.admission, receive, send):
            return
        try:
            await self.app(scope, replay, send)
        finally:
            self.admission.leave()

    def _capped(self, scope, raw: bytes) -> bytes:
        """The body with its bound on new tokens at most the cap (written in when it names none). A generation
        request's body, and any JSON one, must pass :func:`parse_json` (:class:`BadRequest` otherwise); one that is
        JSON but not an object is passed on as it came, for vLLM to refuse."""
        fields = MAXIMUM_FIELDS.get(scope["path"])
        if fields is None and not (raw and dict(scope["headers"]).get(b"content-type", b"").startswith(JSON_TYPE)):
            return raw
        body = parse_json(raw)
        if fields is None or not isinstance(body, dict):
            return raw
        body[fields[-1]] = bounded_new_tokens(body, fields, self.limits.new_tokens)
        check_integers(body)
        return json.dumps(body).encode()
