"""What ``hf-alibi serve`` adds around transformers' server, in the server process, without copying it:

- :class:`RequestGuard`, an ASGI middleware on the app transformers builds: every POST to a generation endpoint is
  checked (:func:`hf_alibi.serve.request_checks.check_body`) before a handler reads it; a bad one answers 400 in
  OpenAI's error shape, and transformers' own refusals (``{"detail": ...}``) are answered in that shape too.
- the cap on new tokens per request (``--max-new-tokens-cap``, read by the command line:
  :func:`hf_alibi.cli.checks.serve_options`; :data:`~hf_alibi.serve.request_checks.DEFAULT_CAP` by default), written
  into each request: one that names no maximum gets the cap, one that asks more is refused.
- :func:`watch_worker`: if the continuous-batching worker dies anyway (an input nobody foresaw: transformers answers
  every later request 503 until the process ends), the process says so in one line and exits with
  :data:`WORKER_DIED_STATUS`, for a supervisor (systemd, Kubernetes, a shell loop) to start it again.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import threading
import time

from .request_checks import CAP_OPTION, CHAT, COMPLETIONS, GUARDED, BadRequest, check_body, openai_error

WORKER_DIED_STATUS = 3
_POLL_SECONDS = 0.2
_FLUSH_SECONDS = 1.0  # the failed requests' 503 answers go out before the process ends


def say(line: str) -> None:
    print(f"hf-alibi serve: {line}", file=sys.stderr, flush=True)


class RequestGuard:
    """ASGI middleware: the generation endpoints' requests checked and bounded, and every 4xx / 5xx of those
    endpoints answered in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, app, tokenizer, cap: int, pinned: str):
        self.app, self.tokenizer, self.cap, self.pinned = app, tokenizer, cap, pinned

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GUARDED:
            await self.app(scope, receive, send)
            return
        raw, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw, more = raw + message.get("body", b""), message.get("more_body", False)
        try:
            body = json.dumps(check_body(scope["path"], raw, self.tokenizer, self.cap, self.pinned)).encode()
        except BadRequest as error:
            await _answer(send, error.status, error.payload())
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        given = False

        async def replay():
            nonlocal given
            if given:  # then the client's own stream: its disconnect ends a streamed answer
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        sending = _OpenAIErrors(send)
        try:
            await self.app(scope, replay, sending)
        except Exception as error:  # noqa: BLE001 (a failure inside the server: 500 in OpenAI's shape, logged)
            if sending.started:
                raise
            logging.getLogger("hf_alibi.serve").exception("request to %s failed", scope["path"])
            await _answer(send, 500, openai_error(f"the server failed on this request: {error}", 500))


async def _answer(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _OpenAIErrors:
    """``send`` with a JSON error answer of transformers' (``{"detail": ...}``, ``{"error": "..."}``) rewritten in
    OpenAI's shape, its status kept; ``started``: whether an answer has begun."""

    def __init__(self, send):
        self.send, self.started, self.held = send, False, None

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.started = True
            if message["status"] >= 400:
                self.held = (message["status"], b"")
                return
        if self.held is None:
            await self.send(message)
            return
        status, held = self.held[0], self.held[1] + message.get("body", b"")
        self.held = (status, held)
        if message.get("more_body", False):
            return
        try:
            given = json.loads(held)
        except (UnicodeDecodeError, json.JSONDecodeError):
            given = held.decode(errors="replace")
        if isinstance(given, dict) and isinstance(given.get("error"), dict):
            await _answer(self.send, status, given)
            return
        detail = given.get("detail", given.get("error", given)) if isinstance(given, dict) else given
        await _answer(self.send, status, openai_error(_detail_text(detail), status))


def _detail_text(detail) -> str:
    """FastAPI's ``detail`` (a string, or pydantic's list of ``{"loc", "msg"}``) as one line."""
    if isinstance(detail, list) and all(isinstance(item, dict) and "msg" in item for item in detail):
        where = [".".join(str(part) for part in item.get("loc", ())[1:]) for item in detail]  # without "body"
        return "; ".join(f"{place or 'body'}: {item['msg']}" for place, item in zip(where, detail))
    return detail if isinstance(detail, str) else json.dumps(detail)


def watch_worker(generation_state) -> threading.Thread:
    """A daemon thread that ends the process, with one line and :data:`WORKER_DIED_STATUS`, once transformers'
    continuous-batching worker is dead (``GenerationState.is_cb_alive()``; True while none was started)."""

    from .compat import cb_worker_fatal_error  # here: the command line's front reads this module without torch

    def watch():
        while generation_state.is_cb_alive():
            time.sleep(_POLL_SECONDS)
        reason = (cb_worker_fatal_error(generation_state).strip() or "no reason given").splitlines()[0]
        time.sleep(_FLUSH_SECONDS)
        say(f"the continuous-batching worker died ({reason}); exiting with status {WORKER_DIED_STATUS} so that a "
            "supervisor restarts the server")  # fmt: skip
        os._exit(WORKER_DIED_STATUS)

    thread = threading.Thread(target=watch, name="hf-alibi-cb-watch", daemon=True)
    thread.start()
    return thread


def guarded_build_server(build_server, tokenizer, cap: int, pinned: str):
    """transformers' ``build_server`` (replaced through ``serve.compat.wrap_server_builder``), its app given
    :class:`RequestGuard` and its generation state :func:`watch_worker`."""
    signature = inspect.signature(build_server)

    def build(*args, **kwargs):
        app = build_server(*args, **kwargs)
        app.add_middleware(RequestGuard, tokenizer=tokenizer, cap=cap, pinned=pinned)
        watch_worker(signature.bind(*args, **kwargs).arguments["generation_state"])
        return app

    return build


def start_lines(tokenizer, cap: int) -> list[str]:
    """What the server says at start about the requests it takes."""
    lines = [f"at most {cap} new tokens per request ({CAP_OPTION} to change it); a request naming no maximum gets "
             f"{cap}, one asking more is refused (400)"]  # fmt: skip
    if getattr(tokenizer, "chat_template", None) is None:
        lines.append(f"MODEL's tokenizer has no chat template: {CHAT} and /v1/responses answer 400, {COMPLETIONS} "
                     "takes plain prompts")  # fmt: skip
    return lines
