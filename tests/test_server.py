"""The HTTP server in-process (Starlette TestClient, raw ASGI) over a tiny random-init engine: milliseconds.

References: the engine called directly (same prompt, greedy) for every generation route; the error
envelope and status table of server/guards.py for every refusal.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

import httpx
import pytest
from conftest import running_server, tiny_engine
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from inferlab.api import compose
from inferlab.errors import OverloadedError
from inferlab.server import ServerSettings, create_app

PROMPT = "The quick brown fox"


@functools.cache
def base_server_config():
    return compose("serve").server


def make_settings(**overrides) -> ServerSettings:
    values = {"rate_limit": "1000/second", "max_new_tokens_cap": 64, **overrides}
    return ServerSettings.from_config(base_server_config(), **values)


class SlowEngine:
    """The tiny engine with pauses: before its first event, and before each later one."""

    def __init__(self, engine, first_delay_s: float = 0.0, delay_s: float = 0.0) -> None:
        self.engine, self.first_delay_s, self.delay_s = engine, first_delay_s, delay_s

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def submit(self, request):
        events = self.engine.submit(request)
        try:
            await asyncio.sleep(self.first_delay_s)
            async for event in events:
                yield event
                await asyncio.sleep(self.delay_s)
        finally:
            await events.aclose()


class FailingEngine(SlowEngine):
    """submit() raises `error` (the engine refusing, or a bug)."""

    def __init__(self, engine, error: Exception) -> None:
        super().__init__(engine)
        self.error = error

    def submit(self, request):
        raise self.error


@pytest.fixture
def engine(tiny_tokenizer):
    return tiny_engine(tiny_tokenizer, slots=2, max_new_tokens=16)


def client_for(engine, raise_server_exceptions: bool = True, **settings) -> TestClient:
    return TestClient(
        create_app(engine, make_settings(**settings), "tiny"), raise_server_exceptions=raise_server_exceptions
    )


def sse_payloads(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded, `[DONE]` kept as the string."""
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def assert_envelope(response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "type", "param"}
    assert body["error"]["code"] == code
    message = body["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in message and ".py" not in message
    assert not any(internal in message for internal in ("0x", "function-", "functools", "constrained-", "body."))


def assert_idle_soon(engine, within_s: float = 1.5) -> None:
    """A cancelled request leaves the engine at its next step: no running request, no KV held."""
    deadline = time.perf_counter() + within_s
    while ((stats := engine.stats())["requests_running"] or stats["kv_blocks_used"]) and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert stats["requests_running"] == 0 and stats["kv_blocks_used"] == 0, stats


# ---- generation matches the engine ---------------------------------------------------------------


def test_generate_matches_engine(engine):
    reference = engine.generate(PROMPT, max_new_tokens=8)
    r = client_for(engine).post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == reference.text and body["token_ids"] == reference.token_ids
    assert body["finish_reason"] == reference.finish_reason
    assert body["usage"] == {
        "prompt_tokens": reference.timings.prompt_tokens,
        "completion_tokens": 8,
        "total_tokens": reference.timings.prompt_tokens + 8,
    }
    assert r.headers["x-request-id"] == body["id"]


def test_stream_sends_one_chunk_per_token_then_summary_then_done(engine):
    reference = engine.generate(PROMPT, max_new_tokens=8)
    r = client_for(engine).post("/v1/generate/stream", json={"prompt": PROMPT, "max_new_tokens": 8})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *chunks, summary, done = sse_payloads(r.text)
    assert done == "[DONE]"
    assert [c["token_id"] for c in chunks] == reference.token_ids
    assert "ttft_ms" in chunks[0] and all("ttft_ms" not in c for c in chunks[1:])
    assert "".join(c["text"] for c in chunks) + summary["text"] == reference.text
    assert summary["finish_reason"] == reference.finish_reason and summary["completion_tokens"] == 8
    assert {"tpot_ms", "tokens_per_sec", "prompt_tokens", "ttft_ms", "total_ms"} <= set(summary)


def test_openai_completion_and_chat_match_engine(engine):
    client = client_for(engine)
    reference = engine.generate(PROMPT, max_new_tokens=6)
    r = client.post("/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 6, "user": "ignored"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == reference.text
    assert body["usage"]["completion_tokens"] == 6

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reference = engine.chat(messages, max_new_tokens=6)
    r = client.post("/v1/chat/completions", json={"model": "x", "messages": messages, "max_completion_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": reference.text}
    assert body["usage"]["prompt_tokens"] == reference.timings.prompt_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_openai_stream_with_usage(engine, chat):
    messages = [{"role": "user", "content": PROMPT}]
    reference = engine.chat(messages, max_new_tokens=5) if chat else engine.generate(PROMPT, max_new_tokens=5)
    route, body = ("/v1/chat/completions", {"messages": messages}) if chat else ("/v1/completions", {"prompt": PROMPT})
    body |= {"max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    payloads = sse_payloads(client_for(engine).post(route, json=body).text)
    assert payloads[-1] == "[DONE]"
    usage_chunk, chunks = payloads[-2], payloads[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
    texts = [c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == reference.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + [reference.finish_reason]


def test_tiny_temperature_samples_like_greedy(engine):
    """Found by the fuzz: temperature 5e-324 once turned the softmax into nan (a 500)."""
    reference = engine.generate(PROMPT, max_new_tokens=6)
    r = client_for(engine).post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 5e-324})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference.text


# ---- guardrails ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/generate", {"prompt": PROMPT, "max_new_tokens": 99999}),
        ("/v1/generate", {"prompt": PROMPT, "max_new_tokens": 65}),  # above the configured cap (64)
        ("/v1/generate", {"prompt": PROMPT, "max_new_tokens": 0}),
        ("/v1/generate", {"prompt": ""}),
        ("/v1/generate", {"prompt": "a" * 4097}),
        ("/v1/generate", {"prompt": "a" * 300}),  # 300 byte tokens > the tiny model's context (256) - 16
        ("/v1/generate", {"prompt": PROMPT, "temperature": 3}),
        ("/v1/generate", {"prompt": PROMPT, "top_p": 0}),
        ("/v1/generate", {"prompt": PROMPT, "top_k": -1}),
        ("/v1/generate", {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}),
        ("/v1/generate", {"prompt": PROMPT, "unknown": 1}),
        ("/v1/generate", b'{"prompt": "\\ud800"}'),  # a lone surrogate, as JSON may carry it
        ("/v1/generate/stream", {"prompt": PROMPT, "max_new_tokens": 99999}),
        ("/v1/completions", {"prompt": "", "max_tokens": 4}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 99999}),
        ("/v1/completions", {"prompt": PROMPT, "n": 17}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 4097}]}),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3, "stream": True}),
    ],
)
def test_invalid_input_is_422_in_the_envelope(engine, route, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client_for(engine).post(route, content=content, headers={"content-type": "application/json"})
    assert_envelope(r, 422, "invalid_request")


@pytest.mark.parametrize(
    "route,body,message",
    [
        ("/v1/generate", {"prompt": PROMPT, "stop": ["a"] * 100}, "stop: list should have at most 4 items, not 100"),
        ("/v1/generate", {"prompt": PROMPT, "stop": "a" * 65}, "stop: string should have at most 64 characters"),
        (
            "/v1/generate",
            {"prompt": PROMPT, "max_new_tokens": 65},
            "max_new_tokens: 65 is more than this server's cap of 64",
        ),
        ("/v1/generate", {"prompt": 5}, "prompt: should be a valid string"),
        ("/v1/generate", {"prompt": PROMPT, "top_p": 0}, "top_p: should be greater than 0"),
        ("/v1/generate", {}, "prompt: required"),
        ("/v1/generate", [PROMPT], "body: must be a JSON object"),
        ("/v1/generate", {"prompt": PROMPT, "unknown": 1}, "unknown: not a field this route accepts"),
        ("/v1/completions", {"prompt": 5}, "prompt: should be a valid string or a valid list"),
        (
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 100},
            "max_tokens: 100 is more than this server's cap of 64",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "hi"}]},
            "messages[0].role: should be 'system', 'user', 'assistant' or 'tool'",
        ),
    ],
)
def test_invalid_input_says_which_field_and_what_is_wrong(engine, route, body, message):
    """Found from outside: 422s quoted validator internals and a memory address."""
    r = client_for(engine).post(route, json=body)
    assert_envelope(r, 422, "invalid_request")
    assert r.json()["error"]["message"] == message


def test_malformed_json_is_422(engine):
    r = client_for(engine).post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert_envelope(r, 422, "invalid_request")


def test_rate_limit_is_429_with_retry_after(engine):
    client = client_for(engine, rate_limit="3/minute")
    statuses = [client.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 1}).status_code for _ in range(3)]
    assert statuses == [200] * 3
    r = client.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 1})
    assert_envelope(r, 429, "rate_limited")
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert client.get("/v1/metrics").status_code == 200  # only generation routes are limited
    made_up = {"Authorization": "Bearer another-token"}  # no keys configured: the bucket is the address
    assert_envelope(client.post("/v1/generate", json={"prompt": PROMPT}, headers=made_up), 429, "rate_limited")


def test_rate_limit_buckets_are_per_api_key(engine):
    client = client_for(engine, rate_limit="1/minute", api_keys=["a", "b"])
    body = {"prompt": PROMPT, "max_new_tokens": 1}
    for key in ("a", "b"):
        assert client.post("/v1/generate", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert_envelope(client.post("/v1/generate", json=body, headers={"Authorization": "Bearer a"}), 429, "rate_limited")


def test_api_key_is_required_when_configured(engine):
    client = client_for(engine, api_keys=["secret"])
    body = {"prompt": PROMPT, "max_new_tokens": 1}
    assert_envelope(r := client.post("/v1/generate", json=body), 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_envelope(
        client.post("/v1/generate", json=body, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized"
    )
    assert_envelope(client.get("/v1/metrics"), 401, "unauthorized")
    assert client.post("/v1/generate", json=body, headers={"Authorization": "Bearer secret"}).status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("body", [b"{not json", b'{"prompt": 5}', b"\xff\xfe", b'{"prompt": "%s"}' % (b"a" * 2000)])
def test_authentication_comes_before_reading_the_body(engine, body):
    """Found from outside: a malformed body from a client without a key got 422, telling it about the API."""
    client = client_for(engine, api_keys=["secret"], max_body_bytes=1000)
    for route in ("/v1/generate", "/v1/generate/stream", "/v1/completions", "/v1/chat/completions"):
        r = client.post(route, content=body, headers={"content-type": "application/json"})
        assert_envelope(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
    r = client.post(
        "/v1/generate", content=body, headers={"content-type": "application/json", "Authorization": "Bearer secret"}
    )
    assert r.status_code in (413, 422)


def test_slow_generation_is_504_before_the_first_byte(engine):
    client = client_for(SlowEngine(engine, first_delay_s=5.0), timeout_s=0.05)
    for route in ("/v1/generate", "/v1/generate/stream"):
        started = time.perf_counter()
        assert_envelope(client.post(route, json={"prompt": PROMPT}), 504, "timeout")
        assert time.perf_counter() - started < 4.0  # the deadline answered, not the slow engine
    assert_idle_soon(engine)


def test_deadline_mid_stream_sends_an_error_event_then_done(engine):
    client = client_for(SlowEngine(engine, delay_s=5.0), timeout_s=0.3)
    r = client.post("/v1/generate/stream", json={"prompt": PROMPT, "max_new_tokens": 8})
    assert r.status_code == 200
    first, error, done = sse_payloads(r.text)
    assert first["index"] == 0 and error["error"]["code"] == "timeout" and done == "[DONE]"


def test_body_over_the_limit_is_413(engine):
    r = client_for(engine, max_body_bytes=1000).post("/v1/generate", json={"prompt": "a" * 2000})
    assert_envelope(r, 413, "payload_too_large")


def test_engine_overloaded_is_503(engine):
    client = client_for(FailingEngine(engine, OverloadedError("the wait queue is full; retry later")))
    assert_envelope(client.post("/v1/generate/stream", json={"prompt": PROMPT}), 503, "overloaded")


def test_a_bug_is_500_without_trace_or_paths(engine, caplog):
    client = client_for(
        FailingEngine(engine, RuntimeError("boom in /secret/path/engine.py")), raise_server_exceptions=False
    )
    with caplog.at_level(logging.ERROR, "inferlab.server"):
        r = client.post("/v1/generate", json={"prompt": PROMPT})
    assert_envelope(r, 500, "internal_error")
    assert "secret" not in r.text
    assert "boom in /secret/path/engine.py" in caplog.text  # the trace stays in the server log


def test_unknown_route_and_method_use_the_envelope(engine):
    client = client_for(engine)
    assert_envelope(client.get("/nope"), 404, "not_found")
    assert_envelope(client.get("/v1/generate"), 405, "method_not_allowed")


def test_draining_refuses_new_work(engine):
    client = client_for(engine)
    client.app.state.guards.draining = True
    assert_envelope(client.post("/v1/generate", json={"prompt": PROMPT}), 503, "shutting_down")
    assert_envelope(client.get("/health"), 503, "shutting_down")


# ---- observability ---------------------------------------------------------------------------------


def test_metrics_and_request_log(engine, caplog):
    client = client_for(engine)
    with caplog.at_level(logging.INFO, "inferlab.server"):
        r = client.post("/v1/generate/stream", json={"prompt": PROMPT, "max_new_tokens": 4})
    summary = sse_payloads(r.text)[-2]
    line = next(m for m in caplog.messages if r.headers["x-request-id"] in m)
    assert "POST /v1/generate/stream status=200" in line
    assert f"prompt_tokens={summary['prompt_tokens']} completion_tokens=4 ttft_ms=" in line and "total_ms=" in line

    stats = client.get("/v1/metrics").json()
    assert set(engine.stats()) <= set(stats)
    assert stats["requests_completed"] == 1 and stats["requests_running"] == 0 and stats["kv_blocks_used"] == 0
    assert set(stats["ttft_ms"]) == {"p50", "p90", "p95", "p99"} and stats["tpot_ms"]["p50"] >= 0
    text = client.get("/metrics").text
    assert 'inferlab_requests_total{route="/v1/generate/stream",status="200"} 1.0' in text
    assert 'inferlab_tokens_total{kind="completion"} 4.0' in text and "inferlab_kv_blocks_used" in text


def gauges(text: str) -> dict[str, tuple[dict[str, str], float]]:
    """Each Prometheus sample of a /metrics body by name: its labels and value (the last one of a name)."""
    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples}


def test_cluster_router_gauges_while_a_request_holds_kv_and_after(tiny_tokenizer):
    """The Gateway API Inference Extension's three gauges (queue, running, KV-cache utilization as blocks held over
    the pool) and the KV layout it reads, scraped mid-stream and after: against the engine's own block count, and
    a prompt's blocks left in the prefix cache count as free (a new request may take them)."""
    engine = tiny_engine(tiny_tokenizer, cache_mode="paged", prefix_cache=True, max_new_tokens=64)
    prompt = PROMPT * 3  # 57 byte tokens: 3 full blocks of 16 and a partial one
    with running_server(create_app(SlowEngine(engine, delay_s=0.05), make_settings(), "tiny")) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            body = {"prompt": prompt, "max_new_tokens": 32}
            with client.stream("POST", "/v1/generate/stream", json=body) as stream:
                lines = stream.iter_lines()
                while not next(lines).startswith("data: "):  # a token streamed: its KV is held
                    pass
                held = gauges(client.get("/metrics").text)
                for _ in lines:  # to the end
                    pass
            after = gauges(client.get("/metrics").text)
    total = engine.blocks.num_blocks
    used = held["inferlab_kv_blocks_used"][1]
    assert held["inferlab_requests_running"][1] == 1 and held["inferlab_requests_waiting"][1] == 0
    assert -(-len(prompt) // 16) <= used <= -(-(len(prompt) + 32) // 16)  # the prompt's blocks, at most all 32 tokens'
    assert held["inferlab_kv_cache_usage_perc"] == ({}, used / total) and held["inferlab_kv_blocks_total"][1] == total
    assert held["inferlab_cache_config_info"] == ({"block_size": "16", "num_gpu_blocks": str(total)}, 1.0)
    assert after["inferlab_requests_running"][1] == 0 and after["inferlab_kv_cache_usage_perc"][1] == 0.0
    assert after["inferlab_prefix_cache_blocks"][1] >= 3 and after["inferlab_kv_blocks_used"][1] == 0


class NamedReplica(SlowEngine):
    """The engine as one replica of several answers: its health and counters carry the replica's name."""

    def health(self):
        return {**self.engine.health(), "replica": "replica-a"}

    def stats(self):
        return {**self.engine.stats(), "replica": "replica-a"}


def test_health_and_metrics_say_which_replica_answered(engine):
    client = client_for(NamedReplica(engine))
    health = client.get("/health")
    assert health.json() == {"status": "ok", "replica": "replica-a", "model": "tiny"}
    metrics, snapshot = client.get("/metrics"), client.get("/v1/metrics")
    for r in (health, metrics, snapshot):
        assert r.headers["x-inferlab-replica"] == "replica-a"
    assert gauges(metrics.text)["inferlab_kv_cache_usage_perc"] == ({"replica": "replica-a"}, 0.0)
    assert snapshot.json()["replica"] == "replica-a"
    assert "x-inferlab-replica" not in client_for(engine).get("/health").headers  # one server: no replica named


async def stream_then_disconnect(app, body: dict, after_tokens: int) -> list[bytes]:
    """Drive the ASGI app like a client that hangs up after `after_tokens` token chunks."""
    payload = json.dumps(body).encode()
    hang_up = asyncio.Event()
    chunks: list[bytes] = []
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if len(chunks) >= after_tokens:
                hang_up.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/generate/stream",
        "raw_path": b"/v1/generate/stream",
        "root_path": "",
        "query_string": b"",
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    return chunks


def test_client_disconnect_cancels_the_request_and_frees_its_kv(tiny_tokenizer, caplog):
    engine = tiny_engine(tiny_tokenizer, slots=2, max_seq_len=2048)
    app = create_app(engine, make_settings(max_new_tokens_cap=1024), "tiny")
    with caplog.at_level(logging.INFO, "inferlab.server"):
        chunks = asyncio.run(stream_then_disconnect(app, {"prompt": PROMPT, "max_new_tokens": 1000}, 3))
    assert all(c.startswith(b"data: {") for c in chunks) and len(chunks) < 1000
    assert_idle_soon(engine)  # within a decode step or two; all 1000 tokens would take far longer
    assert "error=cancelled" in caplog.text
