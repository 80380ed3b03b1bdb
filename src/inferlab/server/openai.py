"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`, streamed or not, so the
`openai` client and existing load tools work unchanged."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from fastapi import APIRouter, Request

from inferlab.engine.engine import StreamEvent, Timings
from inferlab.server.schemas import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                     CompletionChoice, CompletionRequest, CompletionResponse, Usage)
from inferlab.server.streams import Dispatcher, EventStreamResponse


def router(dispatcher: Dispatcher, model_name: str, errors: dict[int, Any]) -> APIRouter:
    routes = APIRouter()
    responses = {200: {"content": {"application/json": {}, "text/event-stream": {}}}, **errors}

    @routes.post("/v1/completions", responses=responses, response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        record = request.state.record
        job = await dispatcher.start(record, body.sampling_overrides(), body.max_tokens, prompt=body.text,
                                     tokens_field="max_tokens")
        chunks = Chunks(f"cmpl-{record.id}", model_name, chat=False, include_usage=body.include_usage)
        if body.stream:
            return EventStreamResponse(job.sse(chunks))
        text, _, last = await job.collect()
        return CompletionResponse(id=chunks.id, created=chunks.created, model=model_name,
                                  choices=[CompletionChoice(index=0, text=text, finish_reason=last.finish_reason)],
                                  usage=usage(last.timings))

    @routes.post("/v1/chat/completions", responses=responses, response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        record = request.state.record
        messages = [m.model_dump() for m in body.messages]
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        job = await dispatcher.start(record, body.sampling_overrides(), body.max_completion_tokens or body.max_tokens,
                                     messages=messages, tokens_field=field)
        chunks = Chunks(f"chatcmpl-{record.id}", model_name, chat=True, include_usage=body.include_usage)
        if body.stream:
            return EventStreamResponse(job.sse(chunks))
        text, _, last = await job.collect()
        choice = ChatChoice(index=0, message=AssistantMessage(content=text), finish_reason=last.finish_reason)
        return ChatCompletionResponse(id=chunks.id, created=chunks.created, model=model_name, choices=[choice],
                                      usage=usage(last.timings))

    return routes


@dataclass
class Chunks:
    """Renders engine events as OpenAI stream chunks: (chat: a role delta first), one chunk per token,
    the finish reason on the last, then a usage chunk when `stream_options.include_usage` asked for it."""

    id: str
    model: str
    chat: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    started: bool = False

    def __call__(self, event: StreamEvent) -> Iterable[dict[str, Any]]:
        if self.chat and not self.started:
            yield self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        self.started = True
        if self.chat:  # the closing chunk's delta is empty unless it flushes held-back text
            body = {"delta": {"content": event.text} if event.text or event.finish_reason is None else {}}
        else:
            body = {"text": event.text}
        yield self._chunk({**body, "finish_reason": event.finish_reason})
        if event.finish_reason is not None and self.include_usage:
            yield {**self._head(), "choices": [], "usage": usage(event.timings).model_dump()}

    def _head(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(), "choices": [{"index": 0, "logprobs": None, **choice}]}


def usage(timings: Timings) -> Usage:
    return Usage(prompt_tokens=timings.prompt_tokens, completion_tokens=timings.completion_tokens,
                 total_tokens=timings.prompt_tokens + timings.completion_tokens)
