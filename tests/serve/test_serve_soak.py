"""benchmarks/soak.py for 2 minutes (slow tier): ``hf-alibi serve --continuous-batching`` on a tiny converted Llama
trained here (tests/serve/test_serve_guard.py's: its greedy choices win by a wide margin, so batching cannot flip
them), 16 clients, every hostile kind mixed in and bursts of 100 requests. Each finished greedy answer must equal the
same request answered alone by the fresh server, which answers its first requests as greedy ``generate()`` does
(tests/serve/test_serve_guard.py); no 5xx, no traceback in the server's log; every oversized body 413, every never-sent
body 408, every request past the cap 400, every idle connection closed by the server; after the load, no request
in flight and no batching slot or cache block held; RSS and open descriptors no higher than at the first report
after the first minute with no burst in flight (the first burst included): RSS at most 5% more, descriptors at most
8 more."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import test_serve
from test_serve_guard import TEXTS, folder  # noqa: F401 (the fixture)

pytestmark = [*test_serve.pytestmark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_two_minutes_of_mixed_load(folder, tmp_path):  # noqa: F811
    text, report = tmp_path / "prompts.txt", tmp_path / "soak.json"
    text.write_text(" ".join(TEXTS) + " ")
    command = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), str(folder), "--continuous-batching",
               "--minutes", "2", "--clients", "16", "--burst", "100", "--burst-every", "45", "--report-every", "20",
               "--warmup", "60", "--read-timeout", "5", "--idle-hold", "20", "--cap", "6", "--max-tokens", "5",
               "--prompt-text", str(text), "--json", str(report)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    final = json.loads(report.read_text())
    outcomes = final["outcomes"]
    assert final["5xx"] == 0 and final["mismatches"] == 0 and final["tracebacks"] == 0
    bursts = sum(n for k, n in outcomes.items() if k.startswith("burst"))
    goods = sum(n for k, n in outcomes.items() if k.startswith("good"))
    assert outcomes["good_ok"] == goods > 200  # every well-behaved request answered, with its own answer
    assert outcomes["burst_ok"] == bursts >= 100
    for kind, status in [("big_body", "413"), ("no_body", "408"), ("past_cap", "400"), ("at_cap", "200"),
                         ("bad_json", "400"), ("idle", "closed")]:  # fmt: skip
        assert outcomes.get(f"{kind}_{status}", 0) > 0 and sum(n for k, n in outcomes.items() if k.startswith(kind)) \
            == outcomes[f"{kind}_{status}"], (kind, outcomes)  # fmt: skip
    assert final["load"] == {"in_flight": 0, "queued": 0, "continuous_batching": {"active": 0, "waiting": 0,
                             "cancelling": 0, "cache_blocks_held": 0}}  # fmt: skip
    warm = final["after_warmup"]
    # no growth: at the end the load has stopped, so descriptors fall to the server's own (about 7 of 35 under load)
    assert final["rss_mb"] <= warm["rss_mb"] * 1.05 and final["fds"] <= warm["fds"] + 8, final
