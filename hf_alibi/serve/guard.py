"""What ``hf-alibi serve`` adds around transformers' server, in the server process, without copying it:

- :class:`RequestGuard`, an ASGI middleware on the app transformers builds: every POST to a generation endpoint is
  checked (:func:`hf_alibi.serve.request_checks.check_body`) before a handler reads it; a bad one answers 400 in
  OpenAI's error shape, and transformers' own refusals (``{"detail": ...}``) are answered in that shape too.
- the cap on new tokens per request (``--max-new-tokens-cap``, read by the command line:
  :func:`hf_alibi.cli.checks.serve_options`; :data:`~hf_alibi.serve.request_checks.DEFAULT_CAP` by default), written
  into each request: one that names no maximum gets the cap, one that asks more is refused.
- the request's body bounded (``--max-body-bytes``: 413 from its Content-Length, or as soon as the bytes read pass
  it, chunked too; nothing more is read) and the time to read it (``--read-timeout``: 408), each in OpenAI's shape,
  the connection closed after the answer (:mod:`hf_alibi.serve.connections` bounds headers and idle connections);
- admission (:class:`Admission`): at most ``--max-concurrent-requests`` generation requests inside transformers'
  handlers at once; the others wait in arrival order (a waiting client that leaves leaves the queue), and past
  ``--max-queued-requests`` waiting, 429 with ``Retry-After``: a burst is answered in turn instead of all of it
  entering the batching scheduler at once;
- a non-streamed request in the batching worker whose client leaves before its answer is dropped from the batch
  (transformers frees a stream's slot itself, not this one's);
- ``GET /hf-alibi/load``: the generation requests in the server now (inside, waiting), and the continuous-batching
  scheduler's requests and cache blocks in use (:func:`load`), for a harness or a probe to read;
- :func:`watch_worker`: if the continuous-batching worker dies anyway (an input nobody foresaw: transformers answers
  every later request 503 until the process ends), the process says so in one line and exits with
  :data:`WORKER_DIED_STATUS`, for a supervisor (systemd, Kubernetes, a shell loop) to start it again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import json
import logging
import os
import sys
import threading
import time
import uuid

from .compat import cancel_cb_request, cb_requests
from .request_checks import (
    CAP_OPTION,
    CHAT,
    COMPLETIONS,
    GUARDED,
    PROMPT_OPTION,
    BadRequest,
    Limits,
    check_body,
    openai_error,
)

WORKER_DIED_STATUS = 3
_POLL_SECONDS = 0.2
_FLUSH_SECONDS = 1.0  # the failed requests' 503 answers go out before the process ends
LOAD_PATH = "/hf-alibi/load"
CLOSE = [(b"connection", b"close")]


def say(line: str) -> None:
    print(f"hf-alibi serve: {line}", file=sys.stderr, flush=True)


class RequestGuard:
    """ASGI middleware: the generation endpoints' requests bounded, checked and counted, and every 4xx / 5xx of those
    endpoints answered in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, app, tokenizer, limits: Limits, pinned: str, generation_state=None):
        self.app, self.tokenizer, self.limits, self.pinned = app, tokenizer, limits, pinned
        self.generation_state, self.admission = generation_state, Admission(limits.concurrent, limits.queued)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == LOAD_PATH:
            await answer_json(send, 200, load(self.admission, self.generation_state))
            return
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GUARDED:
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(scope, receive, self.limits)
        except BadRequest as error:
            await answer_json(send, error.status, error.payload(), CLOSE)
            return
        if raw is None:  # the client left
            return
        try:
            body = check_body(scope["path"], raw, self.tokenizer, self.limits.new_tokens, self.pinned,
                              self.limits.prompt_tokens)  # fmt: skip
        except BadRequest as error:
            await answer_json(send, error.status, error.payload())
            return
        batched = not body.get("stream") and cb_requests(self.generation_state) is not None
        request_id, made = dict(scope["headers"]).get(b"x-request-id"), []  # transformers' id: the client's, or ours
        if request_id is None:
            request_id = uuid.uuid4().hex.encode()
            made.append((b"x-request-id", request_id))
        scope, replay = replayed(scope, json.dumps(body).encode(), receive, made)
        sending = _OpenAIErrors(send)
        if not await admitted(self.admission, receive, send):
            return
        try:
            if batched:
                await self._unless_left(self.app(scope, replay, sending), receive, sending, request_id.decode())
            else:
                await self.app(scope, replay, sending)
        except Exception as error:  # noqa: BLE001 (a failure inside the server: 500 in OpenAI's shape, logged)
            if sending.started:
                raise
            logging.getLogger("hf_alibi.serve").exception("request to %s failed", scope["path"])
            await answer_json(send, 500, openai_error(f"the server failed on this request: {error}", 500))
        finally:
            self.admission.leave()

    async def _unless_left(self, answering, receive, sending, request_id: str) -> None:
        """Run ``answering`` (a non-streamed request in the batching worker), dropping it from the batch
        (:func:`cancel_cb_request`) if its client leaves before the answer begins: transformers' handler awaits the
        result and never sees the client go, so the request would hold its batch slot and cache to its last token.
        (A stream's own disconnect reaches transformers' handler, which cancels it.)"""
        task = asyncio.ensure_future(answering)
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() or sending.started:
                await task
                return
            cancel_cb_request(self.generation_state, request_id)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            watch.cancel()


def replayed(scope, body: bytes, receive, headers: list | None = None):
    """The request as the app is handed it once its body was read and checked here: ``scope`` with ``headers`` added
    and the Content-Length of ``body`` (the client's, or its chunked transfer, dropped), and an ASGI ``receive`` that
    gives ``body`` first, then the client's own messages (its disconnect ends a streamed answer)."""
    kept = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-length", b"transfer-encoding")]
    scope = {**scope, "headers": [*kept, *(headers or ()), (b"content-length", str(len(body)).encode())]}
    given = False

    async def replay():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return scope, replay


async def admitted(admission: Admission, receive, send) -> bool:
    """Wait for a place (:meth:`Admission.enter`): True once inside (then ``admission.leave()`` once); False when the
    client left while it waited, or the queue was full (429 with ``Retry-After`` answered here)."""
    try:
        return await admission.enter(receive)
    except BadRequest as error:
        await answer_json(send, error.status, error.payload(), [(b"retry-after", b"1")])
        return False


class Admission:
    """At most ``limit`` requests inside at once; the others wait in arrival order, at most ``queued`` of them (one
    more: :class:`BadRequest` 429). One event loop's (the server's); ``inside`` and ``waiting`` are the counts."""

    def __init__(self, limit: int, queued: int):
        self.limit, self.queued, self.inside = limit, queued, 0
        self.queue: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self.queue)

    async def enter(self, receive) -> bool:
        """Wait for a place: True once inside (then :meth:`leave` once), False if the client left first (reading
        ``receive`` for its disconnect: only once the request's body is read)."""
        if self.inside < self.limit and not self.queue:
            self.inside += 1
            return True
        if len(self.queue) >= self.queued:
            raise BadRequest(
                f"this server is busy: {self.inside} requests are being answered and {len(self.queue)} wait "
                f"(--max-concurrent-requests {self.limit}, --max-queued-requests {self.queued}); retry later",
                code="server_busy", status=429,
            )  # fmt: skip
        turn = asyncio.get_running_loop().create_future()
        self.queue.append(turn)
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({turn, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task cancelled (the server stopping): its turn, or its place, given up
            left = True
            raise
        else:
            left = watch.done()
        finally:
            watch.cancel()
            if not turn.done():  # out of the queue
                self.queue.remove(turn)
                turn.cancel()
            elif left:  # the place came as the client left: it goes to the next
                self.leave()
        return not left

    def leave(self) -> None:
        """A request inside is done: its place goes to the first still waiting, or is freed."""
        while self.queue:
            turn = self.queue.popleft()
            if not turn.done():
                turn.set_result(None)  # handed over: ``inside`` unchanged
                return
        self.inside -= 1


async def read_body(scope, receive, limits: Limits) -> bytes | None:
    """The request's body, at most ``limits.body_bytes`` of it read, within ``limits.read_timeout`` seconds;
    raises :class:`BadRequest` (413, 408); None: the client disconnected."""
    limit, timeout = limits.body_bytes, limits.read_timeout
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    parts, size, more = [], 0, True
    while more:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
        except TimeoutError:
            raise BadRequest(
                f"the request's body did not arrive within {timeout:g} s (--read-timeout; {size} bytes came)",
                code="request_timeout", status=408,
            ) from None  # fmt: skip
        if message["type"] == "http.disconnect":
            return None
        part, more = message.get("body", b""), message.get("more_body", False)
        size += len(part)
        if size > limit:
            raise _too_large(size, limit, more)
        parts.append(part)
    return b"".join(parts)


def _too_large(size: int, limit: int, more: bool = True) -> BadRequest:
    read = "at least " if more else ""
    return BadRequest(
        f"the request body is {read}{size} bytes, over this server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large", status=413,
    )  # fmt: skip


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def load(admission: Admission, generation_state) -> dict:
    """``GET /hf-alibi/load``'s answer: ``in_flight``, the generation requests inside transformers' handlers now (a
    stream counts until its generation has stopped); ``queued``, those waiting for a place (:class:`Admission`); and
    ``continuous_batching`` (:func:`cb_requests`)."""
    return {"in_flight": admission.inside, "queued": admission.waiting,
            "continuous_batching": cb_requests(generation_state)}  # fmt: skip


async def answer_json(send, status: int, payload: dict, extra: list | None = None) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
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
            await answer_json(self.send, status, given)
            return
        detail = given.get("detail", given.get("error", given)) if isinstance(given, dict) else given
        await answer_json(self.send, status, openai_error(_detail_text(detail), status))


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


def guarded_build_server(build_server, tokenizer, limits: Limits, pinned: str):
    """transformers' ``build_server`` (replaced through ``serve.compat.wrap_server_builder``), its app given
    :class:`RequestGuard` and its generation state :func:`watch_worker`."""
    signature = inspect.signature(build_server)

    def build(*args, **kwargs):
        app = build_server(*args, **kwargs)
        state = signature.bind(*args, **kwargs).arguments["generation_state"]
        app.add_middleware(RequestGuard, tokenizer=tokenizer, limits=limits, pinned=pinned, generation_state=state)
        watch_worker(state)
        return app

    return build


def start_lines(tokenizer, limits: Limits) -> list[str]:
    """What the server says at start about the requests it takes."""
    cap = limits.new_tokens
    lines = [f"at most {cap} new tokens per request ({CAP_OPTION} to change it); a request naming no maximum gets "
             f"{cap}, one asking more is refused (400)",
             f"at most {limits.prompt_tokens} prompt tokens ({PROMPT_OPTION}; 400), {limits.body_bytes} body bytes "
             f"(--max-body-bytes; 413); headers, then the body, within {limits.read_timeout:g} s (--read-timeout; "
             f"408); idle connections closed after {limits.idle_timeout:g} s (--idle-timeout)"]  # fmt: skip
    if getattr(tokenizer, "chat_template", None) is None:
        lines.append(f"MODEL's tokenizer has no chat template: {CHAT} and /v1/responses answer 400, {COMPLETIONS} "
                     "takes plain prompts")  # fmt: skip
    return lines
