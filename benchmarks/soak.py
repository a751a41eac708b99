"""Soak ``hf-alibi serve`` (or any OpenAI-compatible server on 127.0.0.1) under well-behaved and hostile clients.

Starts ``python -m hf_alibi serve FOLDER`` on 127.0.0.1 (``--continuous-batching``, ``--engine vllm`` passed on), or
drives a server already running (``--url``, with ``--pid`` and ``--log`` for its figures: ``transformers serve`` and
``vllm serve`` baselines). First every well-behaved request is answered alone, one at a time, by that fresh server:
the reference. Then for ``--minutes``, ``--clients`` threads each loop (bounded in count and time, stopping by
themselves; traffic only to 127.0.0.1) over:

- well-behaved: greedy completions and chat completions of the prompts (mixed lengths), streamed and not, through
  the official ``openai`` client; each finished answer compared with its reference;
- hostile: a stream dropped after its first chunks; a slow reader (one chunk a second); a 1-10 MB body; truncated or
  malformed JSON; ``max_tokens`` at the cap and past it; a body announced and never sent; idle connections held;
  and every ``--burst-every`` seconds a burst of ``--burst`` requests at once.

Every ``--report-every`` seconds and at the end it prints requests by outcome, p50 / p99 latency of the
well-behaved ones, the server's RSS, open file descriptors and threads, its ``/hf-alibi/load`` (requests in flight,
batching slots) and the tracebacks in its log; ``--json OUT`` writes the last report. Exit status 1 if a 5xx, a
mismatch or a traceback was seen::

    python benchmarks/soak.py ./smollm2-alibi --continuous-batching --minutes 15 --clients 16
    python benchmarks/soak.py ./smollm2 --url http://127.0.0.1:8000 --pid 12345 --log serve.log --minutes 15
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    "The history of the printing press begins with movable type, which let a printer set a page from single letters "
    "and use them again. Within decades, books that had been copied by hand for months were printed in days, and "
    "the number of readers grew with them. Libraries, schools and newspapers followed, and with them new ideas "
    "travelled faster than any messenger could carry them. "
)
WORDS = (TEXT * 40).split()
PROMPT_WORDS = (3, 12, 40, 120, 400)  # mixed prompt lengths
HOSTILE = ("dropped_stream", "slow_reader", "big_body", "bad_json", "at_cap", "past_cap", "no_body", "idle")


def prompts(text: str | None) -> list[str]:
    words = (Path(text).read_text() * 40).split() if text else WORDS
    return [" ".join(words[i : i + n]) for i, n in enumerate(PROMPT_WORDS)]


class Soak:
    def __init__(self, args, base: str, pid: int | None, log: str | None):
        self.args, self.base, self.pid, self.log = args, base, pid, log
        self.host, self.port = base.split("//")[1].split(":")[0], int(base.rsplit(":", 1)[1].split("/")[0])
        self.prompts, self.model = prompts(args.prompt_text), args.model or args.folder
        self.outcomes, self.latencies, self.lock = collections.Counter(), [], threading.Lock()
        self.reference: dict[tuple[str, int], str] = {}
        self.mismatches: list[dict] = []
        self.deadline = 0.0
        self.warm = None  # RSS and fds at the first report after --warmup seconds with no burst in flight
        self.bursting = False

    # ------------------------------------------------------------------ clients
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=self.args.timeout)

    def ask(self, client, endpoint: str, index: int, stream: bool, slow: float = 0.0, drop: int = 0) -> str | None:
        prompt, n = self.prompts[index], self.args.max_tokens
        common = dict(model=self.model, max_tokens=n, temperature=0, stream=stream)
        if endpoint == "chat":
            answer = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            pick = (lambda c: c.choices[0].delta.content) if stream else (lambda c: c.choices[0].message.content)
        else:
            answer = client.completions.create(prompt=prompt, **common)
            pick = lambda c: c.choices[0].text  # noqa: E731
        if not stream:
            return pick(answer) or ""
        parts = []
        for i, chunk in enumerate(answer):
            if chunk.choices:
                parts.append(pick(chunk) or "")
            if drop and i + 1 >= drop:
                answer.response.close()  # the client leaves mid-answer
                return None
            if slow:
                time.sleep(slow)
        return "".join(parts)

    def record(self, outcome: str, latency: float | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if latency is not None:
                self.latencies.append(latency)

    def well_behaved(self, client, pick: random.Random) -> None:
        endpoint, index, stream = (
            pick.choice(("completions", "chat")),
            pick.randrange(len(self.prompts)),
            pick.random() < 0.5,
        )
        started = time.monotonic()
        try:
            text = self.ask(client, endpoint, index, stream)
        except openai.APIStatusError as error:
            self.record(f"good_{error.status_code}")
            return
        except openai.APIError as error:
            self.record(f"good_{type(error).__name__}")
            return
        expected = self.reference[(endpoint, index)]
        if text == expected:
            self.record("good_ok", time.monotonic() - started)
        else:
            self.record("good_mismatch")
            with self.lock:
                self.mismatches.append({"endpoint": endpoint, "prompt": index, "stream": stream, "got": text,
                                        "expected": expected})  # fmt: skip

    def raw(self, payload: bytes, wait: float) -> str:
        """Send ``payload`` on a fresh connection; the status answered (or what happened) within ``wait`` s."""
        try:
            with socket.create_connection((self.host, self.port), timeout=wait) as sock:
                try:
                    sock.sendall(payload)
                except OSError:
                    pass  # the server may answer and stop reading before the whole body is sent
                data = b""
                while b"\r\n" not in data:
                    chunk = sock.recv(4096)
                    if not chunk:
                        return "closed"
                    data += chunk
                return data.split()[1].decode()
        except TimeoutError:
            return "no_answer"
        except OSError as error:
            return type(error).__name__

    def hostile(self, client, kind: str, pick: random.Random) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        try:
            if kind in ("dropped_stream", "slow_reader"):
                drop, slow = (pick.randint(1, 3), 0.0) if kind == "dropped_stream" else (0, 1.0)
                self.ask(client, pick.choice(("completions", "chat")), pick.randrange(len(self.prompts)), True, slow,
                         drop)  # fmt: skip
                outcome = "done"
            elif kind == "big_body":
                size = pick.randint(1, 10) << 20
                body = b'{"model": "m", "max_tokens": 3, "prompt": "' + b"a" * size + b'"}'
                outcome = self.raw(head + b"Content-Length: %d\r\n\r\n" % len(body) + body, 60)
            elif kind == "bad_json":
                body = pick.choice([b'{"prompt": "Hello", "max_tokens": ', b"{not json}", b'["prompt"]', b"\xff\xfe"])
                outcome = self.raw(head + b"Content-Length: %d\r\n\r\n" % len(body) + body, 60)
            elif kind in ("at_cap", "past_cap"):
                n = self.args.cap + (kind == "past_cap")
                try:
                    client.completions.create(model=self.model, prompt=self.prompts[0], max_tokens=n, temperature=0)
                    outcome = "200"
                except openai.APIStatusError as error:
                    outcome = str(error.status_code)
            elif kind == "no_body":
                outcome = self.raw(head + b"Content-Length: 1000\r\n\r\n", self.args.read_timeout + 30)
            else:  # idle: a connection opened and held; does the server close it?
                with socket.create_connection((self.host, self.port), timeout=self.args.idle_hold) as sock:
                    try:
                        outcome = "closed" if sock.recv(1) == b"" else "data"
                    except TimeoutError:
                        outcome = "held"
        except openai.APIStatusError as error:
            outcome = str(error.status_code)
        except openai.APIError as error:
            outcome = type(error).__name__
        self.record(f"{kind}_{outcome}")

    def worker(self, seed: int) -> None:
        pick, client = random.Random(seed), self.client()
        for _ in range(10**6):  # bounded: stops at the deadline long before
            if time.monotonic() > self.deadline:
                return
            if pick.random() < self.args.hostile:
                self.hostile(client, pick.choice(self.args.kinds), pick)
            else:
                self.well_behaved(client, pick)

    def bursts(self) -> None:
        """The first burst halfway through the warm-up (its memory is part of the figures compared after it), then
        one every ``--burst-every`` seconds."""
        wait = self.args.warmup / 2
        while time.monotonic() + wait < self.deadline:
            time.sleep(wait)
            self.bursting = True
            asyncio.run(self.burst())
            self.bursting = False
            wait = self.args.burst_every

    async def burst(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0,
                                    timeout=self.args.timeout)  # fmt: skip

        async def one(i: int):
            index = i % len(self.prompts)
            started = time.monotonic()
            try:
                answer = await client.completions.create(model=self.model, prompt=self.prompts[index],
                                                         max_tokens=self.args.max_tokens, temperature=0)  # fmt: skip
            except openai.APIStatusError as error:
                return self.record(f"burst_{error.status_code}")
            except openai.APIError as error:
                return self.record(f"burst_{type(error).__name__}")
            same = answer.choices[0].text == self.reference[("completions", index)]
            self.record("burst_ok" if same else "burst_mismatch", time.monotonic() - started if same else None)

        await asyncio.gather(*(one(i) for i in range(self.args.burst)))
        await client.close()

    # ------------------------------------------------------------------ figures
    def server_figures(self) -> dict:
        figures = {}
        if self.pid:
            try:
                figures = {"rss_mb": 0.0, "threads": 0, "fds": 0, "processes": 0}
                for pid in process_tree(self.pid):  # vLLM's engine runs in processes of its own
                    status = Path(f"/proc/{pid}/status").read_text()
                    pairs = (line.partition(":") for line in status.splitlines())
                    field = {k: v.split()[0] for k, _, v in pairs if v.split()}
                    figures["rss_mb"] = round(figures["rss_mb"] + int(field["VmRSS"]) / 1024, 1)
                    figures["threads"] += int(field["Threads"])
                    figures["fds"] += len(os.listdir(f"/proc/{pid}/fd"))
                    figures["processes"] += 1
            except (OSError, KeyError):
                figures = {"server": "gone"}
        try:
            with urllib.request.urlopen(self.base + "/hf-alibi/load", timeout=10) as response:
                figures["load"] = json.loads(response.read())
        except OSError:
            figures["load"] = None
        if self.log:
            figures["tracebacks"] = Path(self.log).read_text(errors="replace").count("Traceback")
        return figures

    def report(self, started: float) -> dict:
        with self.lock:
            outcomes, latencies = dict(sorted(self.outcomes.items())), sorted(self.latencies)

        def quantile(q: float):
            return round(latencies[min(int(q * len(latencies)), len(latencies) - 1)], 3) if latencies else None

        figures = {"minutes": round((time.monotonic() - started) / 60, 2), "outcomes": outcomes,
                   "p50_s": quantile(0.5), "p99_s": quantile(0.99), **self.server_figures()}  # fmt: skip
        figures["5xx"] = sum(n for k, n in outcomes.items() if k.rsplit("_", 1)[1].startswith("5"))
        figures["mismatches"] = sum(n for k, n in outcomes.items() if k.endswith("mismatch"))
        figures["bursting"] = self.bursting  # a burst's connections are open: descriptors not comparable
        if (
            self.warm is None
            and time.monotonic() - started >= self.args.warmup
            and "rss_mb" in figures
            and not self.bursting
        ):
            self.warm = {"rss_mb": figures["rss_mb"], "fds": figures["fds"]}
        figures["after_warmup"] = self.warm
        print(json.dumps(figures), flush=True)
        return figures

    def run(self) -> dict:
        client = self.client()
        for endpoint in ("completions", "chat"):  # each request alone, on the fresh server: the references
            for index in range(len(self.prompts)):
                self.reference[(endpoint, index)] = self.ask(client, endpoint, index, False)
        started = time.monotonic()
        self.deadline = started + self.args.minutes * 60
        threads = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(self.args.clients)]
        threads.append(threading.Thread(target=self.bursts, daemon=True))
        for thread in threads:
            thread.start()
        next_report = started + self.args.report_every
        # bounded: a client stuck past every timeout is reported, not awaited
        while any(t.is_alive() for t in threads) and time.monotonic() < self.deadline + 600:
            time.sleep(1.0)
            if time.monotonic() >= next_report:
                self.report(started)
                next_report += self.args.report_every
        time.sleep(1.0)  # the last dropped streams' slots: freed within 1 s
        final = self.report(started)
        final["mismatch_examples"] = self.mismatches[:5]
        final["reference_prompt_words"] = list(PROMPT_WORDS)
        return final


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[parent].append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    limits = ["--max-new-tokens-cap", str(args.cap), "--read-timeout", str(args.read_timeout)]
    command = [sys.executable, "-m", "hf_alibi", "serve", args.folder, "--host", "127.0.0.1", "--port", str(port),
               *limits, *args.serve]  # fmt: skip
    if args.engine == "transformers":
        command += ["--device", "cpu"] + (["--continuous-batching"] if args.continuous_batching else [])
    else:  # vLLM batches always
        command += ["--engine", "vllm"]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(args.start_timeout * 2):
        if server.poll() is not None:
            sys.exit(f"the server exited ({server.returncode}): see {log.name}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return server, base, log.name
        except OSError:
            time.sleep(0.5)
    server.kill()
    sys.exit(f"the server was not ready in {args.start_timeout} s: see {log.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the model folder (what the server serves; its name is the requests' model)")
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--clients", type=int, default=16, help="concurrent client threads (16 to 64)")
    parser.add_argument("--continuous-batching", action="store_true")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--serve", nargs=argparse.REMAINDER, default=[], help="more options for the server, last")
    parser.add_argument("--url", help="drive this running server instead (http://127.0.0.1:PORT)")
    parser.add_argument("--pid", type=int, help="with --url: its process, for RSS, fds and threads")
    parser.add_argument("--log", help="with --url: its log, for the tracebacks")
    parser.add_argument("--model", help="the requests' model name (default: FOLDER)")
    parser.add_argument("--prompt-text", help="a text file the prompts are cut from (default: a built-in paragraph)")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens of each well-behaved request")
    parser.add_argument("--cap", type=int, default=64, help="the server's --max-new-tokens-cap (at_cap / past_cap)")
    parser.add_argument("--read-timeout", type=float, default=10, help="the server's --read-timeout")
    parser.add_argument("--hostile", type=float, default=0.2, help="the share of hostile requests")
    parser.add_argument("--kinds", nargs="+", choices=HOSTILE, default=list(HOSTILE),
                        help="the hostile kinds (a baseline without a body limit: leave out big_body)")  # fmt: skip
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--burst-every", type=float, default=300, help="seconds between bursts")
    parser.add_argument("--idle-hold", type=float, default=30, help="seconds an idle connection is held")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a well-behaved request may take")
    parser.add_argument("--report-every", type=float, default=300)
    parser.add_argument("--warmup", type=float, default=300, help="RSS and fds are compared with their value here")
    parser.add_argument("--start-timeout", type=int, default=300)
    parser.add_argument("--json", help="write the final report here")
    args = parser.parse_args(argv)
    server = None
    if args.url:
        if not args.url.startswith("http://127.0.0.1:"):
            parser.error("--url must be http://127.0.0.1:PORT: the soak's traffic stays on this machine")
        base, log = args.url.rstrip("/"), args.log
    else:
        server, base, log = start_server(args)
        args.pid = server.pid
        print(f"server: pid {server.pid}, {base}, log {log}", flush=True)
    try:
        final = Soak(args, base, args.pid, log).run()
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    if args.json:
        Path(args.json).write_text(json.dumps(final, indent=1))
    bad = final["5xx"] or final["mismatches"] or final.get("tracebacks")
    print(f"{'FAILED' if bad else 'passed'}: {final['5xx']} 5xx, {final['mismatches']} mismatches, "
          f"{final.get('tracebacks')} tracebacks")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
