"""A real server process (tiny-random, `scheduler.max_waiting=8`) under 64 concurrent clients, then with its
engine loop killed: every request completes or is refused in the envelope, none hangs, no KV is left
held; a dead engine turns /health 503 with the reason and the process exits non-zero.

Runs in file order: the last test stops the server."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_with_fault import STOP_PROMPT

from inferlab.bench.targets import ServerProcess

pytestmark = pytest.mark.slow

CLIENTS, PROMPT = 64, "Once upon a time"
ERROR_FIELDS = {"code", "message", "type", "param"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("overload") / "server.log"
    overrides = [
        "model=tiny-random",
        "scheduler.max_waiting=8",
        "server.rate_limit=1000000/second",
        "server.max_new_tokens_cap=1024",
        "server.shutdown_grace_s=3",
    ]
    script = str(Path(__file__).with_name("serve_with_fault.py"))
    process = ServerProcess([sys.executable, script], overrides, "127.0.0.1", 300, log)
    with process:
        yield process


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/metrics").json()


def wait_idle(url: str, within_s: float = 10.0) -> dict:
    deadline = time.perf_counter() + within_s
    while (s := stats(url))["requests_running"] + s["requests_waiting"] + s[
        "kv_blocks_used"
    ] and time.perf_counter() < deadline:
        time.sleep(0.05)
    return s


async def one_client(client: httpx.AsyncClient, i: int) -> tuple[int, object]:
    """(status, the parsed outcome): a stream's data payloads, or a refusal's envelope."""
    stream = i % 2 == 0
    body = {"prompt": PROMPT, "max_new_tokens": 32, "temperature": 0.8, "seed": i}
    async with client.stream("POST", "/v1/generate/stream" if stream else "/v1/generate", json=body) as r:
        raw = await r.aread()
    if r.status_code != 200:
        return r.status_code, json.loads(raw)
    if not stream:
        return 200, json.loads(raw)
    return 200, [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]


def test_64_clients_against_8_waiting_each_complete_or_refused_none_hang_no_leak(server):
    async def storm():
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one_client(client, i) for i in range(CLIENTS))), 150)

    outcomes = asyncio.run(storm())
    completed = refused = 0
    for status, outcome in outcomes:
        if status == 200:
            completed += 1
            if isinstance(outcome, list):  # tokens, the summary, [DONE]; never an error event
                assert outcome[-1] == "[DONE]" and json.loads(outcome[-2])["finish_reason"] in ("length", "stop")
                assert all("error" not in json.loads(p) for p in outcome[:-1])
            else:
                assert outcome["finish_reason"] in ("length", "stop")
        else:
            refused += 1
            assert status in (429, 503) and set(outcome) == {"error"} and set(outcome["error"]) == ERROR_FIELDS
            assert outcome["error"]["code"] in ("overloaded", "rate_limited")
    assert completed + refused == CLIENTS and completed >= 8 and refused > 0  # the queue bound was reached
    s = wait_idle(server.url)
    assert s["requests_running"] == s["requests_waiting"] == s["kv_blocks_used"] == 0, s


def test_a_killed_engine_loop_turns_health_503_and_the_process_exits_non_zero(server):
    """Runs last. A stream is running when a request makes the engine loop raise SystemExit."""
    assert httpx.get(f"{server.url}/health").status_code == 200
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = {"prompt": PROMPT, "max_new_tokens": 1000}  # far longer than the test takes
        with httpx.stream("POST", f"{server.url}/v1/generate/stream", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    stopper = httpx.post(f"{server.url}/v1/generate", json={"prompt": STOP_PROMPT, "max_new_tokens": 4}, timeout=30)
    reader.join(30)
    assert not reader.is_alive()  # the running stream was told, not left hanging
    assert stopper.status_code == 503 and stopper.json()["error"]["code"] == "engine_failed"
    assert json.loads(events[-2])["error"]["code"] == "engine_failed" and events[-1] == "[DONE]"
    assert len(events) < 1000

    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
    assert "SystemExit" in health.json()["error"]["message"]
    refused = httpx.post(f"{server.url}/v1/generate", json={"prompt": PROMPT}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"

    assert server.process.wait(30) == 1  # after shutdown_grace_s (3 s) and draining
    assert "the server exits in" in server.log_path.read_text()
