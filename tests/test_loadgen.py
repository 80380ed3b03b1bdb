"""The load generator: vLLM's metric definitions on a known timeline, the SSE client against a fake server on
loopback, and the in-process engine target."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from conftest import tiny_engine
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from inferlab.bench.loadgen import HTTPTarget, LoadSpec, measure, metrics_table, read_chunk, run_load
from inferlab.bench.metrics import SLO, RequestRecord, summarize
from inferlab.bench.prompts import Prompt
from inferlab.bench.targets import EngineTarget


def synthetic() -> list[RequestRecord]:
    # A: sent 0, tokens at 1, 2, 4 (end 4): TTFT 1, E2E 4, TPOT (4-1)/2 = 1.5, ITL 1, 2
    # B: sent 1, tokens at 3, 3.5 (end 4): TTFT 2, E2E 3, TPOT 1.0, ITL 0.5
    # C: sent 2, one token at 2.5: TTFT 0.5, E2E 0.5, no TPOT
    # D: failed; E: failed at the server's deadline (504)
    return [
        RequestRecord(0.0, [1.0, 2.0, 4.0], 4.0, prompt_tokens=10),
        RequestRecord(1.0, [3.0, 3.5], 4.0, prompt_tokens=20),
        RequestRecord(2.0, [2.5], 2.5, prompt_tokens=30),
        RequestRecord(0.0, [], 1.0, prompt_tokens=40, error="HTTP 503"),
        RequestRecord(0.0, [], 1.0, prompt_tokens=50, error="HTTP 504", timed_out=True),
    ]


def test_metrics_match_vllm_definitions_on_a_known_timeline():
    m = summarize(synthetic(), duration_s=5.0, slo=SLO(ttft_ms=1500, tpot_ms=1200))
    assert (m["completed"], m["failed"], m["timed_out"]) == (3, 2, 1)
    assert m["total_output_tokens"] == 6 and m["total_input_tokens"] == 60
    assert m["request_throughput"] == pytest.approx(3 / 5)
    assert m["output_throughput"] == pytest.approx(6 / 5)
    assert m["total_token_throughput"] == pytest.approx(66 / 5)
    assert m["mean_ttft_ms"] == pytest.approx(1000 * (1 + 2 + 0.5) / 3)
    assert m["median_ttft_ms"] == pytest.approx(1000.0)
    assert m["mean_tpot_ms"] == pytest.approx(1250.0)  # only requests with more than one token
    assert m["mean_itl_ms"] == pytest.approx(1000 * 3.5 / 3)  # pooled gaps: 1, 2, 0.5
    assert m["p99_itl_ms"] == pytest.approx(1000 * np.percentile([1, 2, 0.5], 99))
    assert m["p50_e2e_ms"] == pytest.approx(3000.0)
    # goodput: A fails TPOT (1.5 s), B fails TTFT (2 s), C passes (TPOT counts as 0 for one token)
    assert m["request_goodput"] == pytest.approx(1 / 5)
    assert "| TTFT |" in metrics_table(m)


def test_usage_overrides_the_chunk_count_and_errors_are_recorded():
    record = RequestRecord(0.0)
    read_chunk({"choices": [{"text": "a"}]}, record)
    read_chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}, record)
    assert len(record.chunk_times) == 1 and record.n_output == 3 and record.prompt_tokens == 7
    assert not record.timed_out
    read_chunk({"error": {"code": "timeout", "message": "too slow"}}, record)
    assert record.error == "too slow" and record.timed_out  # the server's deadline, after the first byte


TOKENS_PER_REQUEST = 5


async def fake_completions(request):
    body = await request.json()
    assert body["stream"] is True

    async def events():
        for i in range(TOKENS_PER_REQUEST):
            await asyncio.sleep(0.01)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
        usage = {"prompt_tokens": 3, "completion_tokens": TOKENS_PER_REQUEST}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Starlette(routes=[Route("/v1/completions", fake_completions, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


def test_http_target_times_every_sse_chunk(fake_server):
    prompts = [Prompt([1, 2, 3], "abc") for _ in range(6)]

    async def go():
        target = HTTPTarget(fake_server, max_tokens=TOKENS_PER_REQUEST)
        try:
            return await run_load(target, prompts, LoadSpec(concurrency=3))
        finally:
            await target.aclose()

    records, duration = asyncio.run(go())
    assert all(r.success for r in records), [r.error for r in records]
    for r in records:
        assert len(r.chunk_times) == TOKENS_PER_REQUEST and r.n_output == TOKENS_PER_REQUEST
        assert r.sent < r.chunk_times[0] <= r.chunk_times[-1] <= r.end
        assert len(r.itl) == TOKENS_PER_REQUEST - 1 and r.e2e >= TOKENS_PER_REQUEST * 0.01  # it sleeps 10 ms a token
    assert summarize(records, duration)["completed"] == 6


def test_http_target_records_refusals(fake_server):
    async def go():
        target = HTTPTarget(fake_server, api="chat")  # the fake serves no chat route: 404
        try:
            return await run_load(target, [Prompt([1], "a")], LoadSpec(concurrency=1))
        finally:
            await target.aclose()

    (record,), _ = asyncio.run(go())
    assert record.error.startswith("HTTP 404") and not record.success and not record.timed_out


class Refusing:
    """A target that refuses every request, at its deadline (504) or not."""

    def __init__(self, timed_out: bool) -> None:
        self.timed_out = timed_out

    async def send(self, prompt: Prompt, record: RequestRecord) -> None:
        record.error, record.timed_out = ("HTTP 504" if self.timed_out else "HTTP 500"), self.timed_out


def test_a_load_whose_every_request_met_the_deadline_is_a_result_any_other_failure_an_error():
    metrics = measure(Refusing(timed_out=True), [Prompt([1], "a")] * 2, LoadSpec(concurrency=1))
    assert (metrics["completed"], metrics["failed"], metrics["timed_out"], metrics["output_throughput"]) == (0, 2, 2, 0)
    with pytest.raises(RuntimeError, match="every request failed"):
        measure(Refusing(timed_out=False), [Prompt([1], "a")] * 2, LoadSpec(concurrency=1))


def test_engine_target_streams_the_same_tokens_as_generate(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, max_new_tokens=6)
    ids = tiny_tokenizer.encode("hello world")
    expected = engine.generate(ids, max_new_tokens=6, temperature=0.0)
    target = EngineTarget(engine, engine.sampling_params(max_new_tokens=6, temperature=0.0))
    records, _ = asyncio.run(run_load(target, [Prompt(ids, "hello world")] * 3, LoadSpec(concurrency=2)))
    for r in records:
        assert r.success and r.n_output == len(expected.token_ids) == len(r.chunk_times)
