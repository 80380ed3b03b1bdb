"""create_app: the FastAPI app over one engine. Native routes here; OpenAI-compatible ones in openai.py.

Handlers validate, submit and relay; they never touch tensors. The engine's own loop (or worker
thread) owns the model and the KV memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from inferlab.engine.engine import CONTEXT_MARGIN, InferenceEngine, StreamEvent
from inferlab.errors import NotFoundError, ShuttingDownError
from inferlab.server import openai, tokenize
from inferlab.server.guards import BodySizeLimit, Gate, Guards, install_error_handlers
from inferlab.server.metrics import RequestLog, ServerMetrics
from inferlab.server.openapi import errors, install
from inferlab.server.schemas import GenerateRequest, GenerateResponse, Usage
from inferlab.server.settings import ServerSettings
from inferlab.server.streams import Dispatcher, EventStreamResponse

GENERATION_ERRORS = (400, 401, 413, 422, 429, 500, 503, 504)
TOKENIZE_ERRORS = (400, 401, 413, 422, 429, 503)
PLAYGROUND = Path(__file__).with_name("static") / "playground.html"


log = logging.getLogger(__name__)


def create_app(engine: InferenceEngine, settings: ServerSettings, model_name: str) -> FastAPI:
    app = FastAPI(
        title="inferlab", summary="LLM inference server: SSE streaming and OpenAI-compatible routes", version="0.1.0"
    )
    settings = settings.for_context(engine.config.max_seq_len)
    if settings.limits == "context":
        log.info(
            "server.limits=context: prompts up to %d characters, max_tokens up to %d",
            settings.max_prompt_chars,
            settings.max_new_tokens_cap,
        )
    guards = Guards(settings)
    metrics = ServerMetrics(settings.metrics_window)
    dispatcher = Dispatcher(engine, settings)
    generation_errors = errors(settings, *GENERATION_ERRORS)
    app.state.guards = guards  # serve.py sets guards.draining when shutdown starts
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(Gate, guards=guards)  # outside the size limit: who may call comes before what they sent
    app.add_middleware(RequestLog, metrics=metrics)  # outermost: it sees every response, 413s included

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def playground() -> HTMLResponse:
        """A chat page over this server's own SSE API (static/playground.html: no CDN, no build step)."""
        return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))

    @app.get("/health", responses=errors(settings, 503))
    def health(request: Request) -> dict[str, str]:
        # a stopped engine raises EngineFailedError: the process exits soon (serve.py), the reason is what to read
        answer = engine.health()
        request.state.record.replica = answer.get("replica")
        if guards.draining:
            raise ShuttingDownError("the server is shutting down")
        return {**answer, "model": model_name}

    @app.get(
        "/metrics",
        response_class=Response,
        summary="Prometheus text format",
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    def prometheus(request: Request) -> Response:
        return Response(metrics.prometheus(engine_stats(request)), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/metrics", responses=errors(settings, 401))
    def json_metrics(request: Request) -> dict[str, Any]:
        return metrics.snapshot(engine_stats(request))

    def engine_stats(request: Request) -> dict[str, Any]:
        """The engine's counters, once per scrape; a replica's carry its name, which the response's header gives."""
        stats = engine.stats()
        request.state.record.replica = stats.get("replica")
        return stats

    card = {
        "id": model_name,
        "object": "model",
        "created": 0,
        "owned_by": "inferlab",
        "root": model_name,
        "max_model_len": engine.config.max_seq_len,
    }

    @app.get("/v1/models", responses=errors(settings, 401))
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", responses=errors(settings, 401, 404))
    def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise NotFoundError(
                f"model {model_id!r} is not served here; this server serves {model_name!r}", param="model"
            )
        return card

    @app.post("/v1/generate", responses=generation_errors)
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
        record = request.state.record
        job = await dispatcher.start(record, body.sampling_overrides(), body.max_new_tokens, body.prompt, body.chat)
        text, token_ids, last = await job.collect()
        t = last.timings
        return GenerateResponse(
            id=record.id,
            text=text,
            token_ids=token_ids,
            finish_reason=last.finish_reason,
            usage=Usage(
                prompt_tokens=t.prompt_tokens,
                completion_tokens=t.completion_tokens,
                total_tokens=t.prompt_tokens + t.completion_tokens,
            ),
            ttft_ms=t.ttft_ms,
            tpot_ms=t.tpot_ms,
            tokens_per_sec=t.tokens_per_sec,
            total_ms=t.total_ms,
        )

    @app.post(
        "/v1/generate/stream",
        response_class=EventStreamResponse,
        status_code=200,
        responses={200: {"content": {"text/event-stream": {}}}, **generation_errors},
    )
    async def generate_stream(body: GenerateRequest, request: Request) -> EventStreamResponse:
        job = await dispatcher.start(
            request.state.record, body.sampling_overrides(), body.max_new_tokens, body.prompt, body.chat
        )
        return EventStreamResponse(job.sse(native_chunks))

    app.include_router(openai.router(dispatcher, model_name, generation_errors))
    app.include_router(tokenize.router(engine, errors(settings, *TOKENIZE_ERRORS), settings.max_prompt_chars))
    install(app, settings, engine.loaded.config.vocab_size, engine.config.max_seq_len - CONTEXT_MARGIN)
    return app


def native_chunks(event: StreamEvent) -> Iterable[dict[str, Any]]:
    """One chunk per token (the first carries `ttft_ms`); the closing one carries the summary."""
    if event.finish_reason is None:
        chunk: dict[str, Any] = {"index": event.index, "text": event.text, "token_id": event.token_id}
        if event.ttft_ms is not None:
            chunk["ttft_ms"] = event.ttft_ms
        yield chunk
        return
    t = event.timings
    yield {
        "index": event.index,
        "text": event.text,
        "finish_reason": event.finish_reason,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "ttft_ms": t.ttft_ms,
        "tpot_ms": t.tpot_ms,
        "tokens_per_sec": t.tokens_per_sec,
        "total_ms": t.total_ms,
    }
