"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`, streamed or not, with the
request shapes vLLM accepts, so the `openai` client, vLLM's benchmark, guidellm and lm-eval work unchanged.

One HTTP request becomes `len(prompts) * n` engine requests; choice `p * n + j` is sample j of prompt p
(sample j seeded with seed + j, so the choices of one prompt differ and each is reproducible).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from inferlab.engine.engine import StreamEvent, Timings
from inferlab.engine.logits import TokenLogprob
from inferlab.errors import InvalidRequestError
from inferlab.model.tokenizer import Tokenizer
from inferlab.server.schemas import (
    MAX_CHOICES,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    LogprobsBlock,
    OpenAIRequest,
    ToolCall,
    TopLogprob,
    Usage,
)
from inferlab.server.streams import Dispatcher, EventStreamResponse
from inferlab.server.structured import requested_constraint
from inferlab.server.tools import ToolUse, template_tools, tool_use


def router(dispatcher: Dispatcher, model_name: str, errors: dict[int, Any]) -> APIRouter:
    routes = APIRouter()
    responses = {200: {"content": {"application/json": {}, "text/event-stream": {}}}, **errors}
    tokenizer = dispatcher.engine.tokenizer

    @routes.post("/v1/completions", responses=responses, response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.max_tokens == 0 and not body.echo:
            raise InvalidRequestError("max_tokens=0 is allowed only with echo=true", param="max_tokens")
        record, prompts = request.state.record, body.prompts
        # echo with max_tokens=0 still runs the prefill: its prompt logprobs are computed, then not shown
        prompt_logprobs = (body.logprobs if body.logprobs is not None else 0) if body.echo else None
        sampling = {
            **body.sampling_overrides(),
            "logprobs": body.logprobs,
            "prompt_logprobs": prompt_logprobs,
            "constraint": requested_constraint(body),
        }
        prepared = [
            dispatcher.prepare(record, s, body.max_tokens, prompt=p, tokens_field="max_tokens")
            for p in prompts
            for s in choice_sampling(body, sampling, dispatcher, len(prompts))
        ]
        jobs = await dispatcher.start_all(record, prepared)
        echoes = [
            Echo.of(p, ids, tokenizer) if body.echo else None
            for p, (ids, _) in zip([p for p in prompts for _ in range(body.n)], prepared)
        ]
        chunks = Chunks(
            f"cmpl-{record.id}",
            model_name,
            False,
            body.include_usage,
            body.n,
            tokenizer,
            echoes,
            body.logprobs is not None,
        )
        if body.stream:
            return EventStreamResponse(jobs.sse(chunks))
        choices, closing = [], []
        for index, (tokens, last) in enumerate(await jobs.collect()):
            block = LogprobsBlock(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
            echo = echoes[index]
            text = echo.text if echo else ""
            if echo:
                chunks.extend_block(block, echo.prompt_entries(tokens[0] if tokens else last), 0, echo.ids)
            chunks.extend_block(block, [e.logprob for e in [*tokens, last] if e.logprob], len(text))
            text += "".join(e.text for e in tokens) + last.text
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    finish_reason=last.finish_reason,
                    logprobs=block if body.logprobs is not None else None,
                )
            )
            closing.append(last.timings)
        return CompletionResponse(
            id=chunks.id, created=chunks.created, model=model_name, choices=choices, usage=chunks.usage(closing)
        )

    @routes.post("/v1/chat/completions", responses=responses, response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        record = request.state.record
        messages = [m.as_template_input() for m in body.messages]
        tools = tool_use(body, tokenizer.chat_template)
        constraint = requested_constraint(body)
        forced = tools.constraint() if tools is not None else None
        if constraint is not None and forced is not None:
            raise InvalidRequestError(
                f"tool_choice: a required or named tool call is its own structured output; drop {constraint.param}",
                param="tool_choice",
            )
        sampling = {
            **body.sampling_overrides(),
            "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
            "constraint": constraint or forced,
        }
        dispatcher.check_cap("max_tokens", body.max_tokens)  # refused even where max_completion_tokens wins
        max_tokens = body.max_completion_tokens or body.max_tokens
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        prepared = [
            dispatcher.prepare(
                record, s, max_tokens, "", messages=messages, tokens_field=field, tools=template_tools(body)
            )
            for s in choice_sampling(body, sampling, dispatcher, 1)
        ]
        jobs = await dispatcher.start_all(record, prepared)
        chunks = Chunks(
            f"chatcmpl-{record.id}",
            model_name,
            True,
            body.include_usage,
            body.n,
            tokenizer,
            [None] * body.n,
            body.logprobs,
            tools=tools,
        )
        if body.stream:
            return EventStreamResponse(jobs.sse(chunks))
        choices, closing = [], []
        for index, (tokens, last) in enumerate(await jobs.collect()):
            text = "".join(e.text for e in tokens) + last.text
            logprobs = (
                ChatLogprobs(content=[chunks.chat_entry(e.logprob) for e in [*tokens, last] if e.logprob])
                if body.logprobs
                else None
            )
            content, calls = tools.parse(text) if tools is not None else (text, [])
            choices.append(
                ChatChoice(
                    index=index,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    finish_reason=finish_reason(last.finish_reason, calls),
                    logprobs=logprobs,
                )
            )
            closing.append(last.timings)
        return ChatCompletionResponse(
            id=chunks.id, created=chunks.created, model=model_name, choices=choices, usage=chunks.usage(closing)
        )

    return routes


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """A reply that ended as the model chose to, with tool calls in it, finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def choice_sampling(
    body: OpenAIRequest, sampling: dict[str, Any], dispatcher: Dispatcher, prompts: int
) -> list[dict[str, Any]]:
    """The sampling overrides of a prompt's `n` choices: sample j seeded with seed + j (the engine's default
    seed when the request gives none; null stays fresh entropy for each)."""
    if prompts * body.n > MAX_CHOICES:
        raise InvalidRequestError(
            f"prompts x n is {prompts * body.n}; at most {MAX_CHOICES} choices per request", param="n"
        )
    seed = body.seed if body.seed is not None else dispatcher.engine.config.defaults.seed
    return [{**sampling, "seed": None if seed is None else seed + j} for j in range(body.n)]


@dataclass
class Echo:
    """A prompt shown before its completion (echo=true): its text and token ids."""

    text: str
    ids: list[int]

    @classmethod
    def of(cls, prompt: str | list[int], ids: list[int], tokenizer: Tokenizer) -> Echo:
        return cls(prompt if isinstance(prompt, str) else tokenizer.decode(ids), ids)

    def prompt_entries(self, first: StreamEvent) -> list[TokenLogprob | None]:
        """The prompt's entries, the first token's (which nothing predicts) None."""
        return first.prompt_logprobs or [None] * len(self.ids)


@dataclass
class Chunks:
    """Renders engine events as OpenAI stream chunks, per choice: (chat: a role delta first; echo: the prompt
    first), one chunk per token, the finish reason on the last; then, once every choice has closed, a usage
    chunk when `stream_options.include_usage` asked for it. Also builds the logprobs blocks of both routes."""

    id: str
    model: str
    chat: bool
    include_usage: bool
    n: int  # choices per prompt (usage counts each prompt once)
    tokenizer: Tokenizer
    echoes: list[Echo | None]
    logprobs: bool
    tools: ToolUse | None = None  # chat with tools: each choice's text is held back and parsed when it closes
    created: int = field(default_factory=lambda: int(time.time()))
    started: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters shown so far (text_offset)
    closed: dict[int, Timings] = field(default_factory=dict)
    held: dict[int, str] = field(default_factory=dict)  # choice -> text held back (tools)

    def __call__(self, index: int, event: StreamEvent) -> Iterable[dict[str, Any]]:
        if index not in self.started:
            self.started.add(index)
            yield from self._opening(index, event)
        if self.tools is not None:
            yield from self._tool_deltas(index, event)
        else:
            yield self._chunk(index, {**self._delta(index, event), "finish_reason": event.finish_reason})
        if event.finish_reason is not None:
            self.closed[index] = event.timings
            if self.include_usage and len(self.closed) == len(self.echoes):
                timings = [self.closed[i] for i in sorted(self.closed)]
                yield {**self._head(), "choices": [], "usage": self.usage(timings).model_dump()}

    def _delta(self, index: int, event: StreamEvent) -> dict[str, Any]:
        """An event's part of its chunk: chat's delta or completions' text, and its logprobs when asked."""
        if self.chat:  # the closing chunk's delta is empty unless it flushes held-back text
            body: dict[str, Any] = {
                "delta": {"content": event.text} if event.text or event.finish_reason is None else {}
            }
            if self.logprobs and event.logprob:
                body["logprobs"] = {"content": [self.chat_entry(event.logprob).model_dump()]}
        else:
            body = {"text": event.text}
            if self.logprobs and event.logprob:
                block = LogprobsBlock(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
                self.offsets[index] = self.extend_block(block, [event.logprob], self.offsets.get(index, 0))
                body["logprobs"] = block.model_dump()
        return body

    def _tool_deltas(self, index: int, event: StreamEvent) -> Iterable[dict[str, Any]]:
        """A choice that may call tools: its text whole when it closes, as content or as one tool-call delta per
        call (each with its id, name and whole arguments), then the finish reason."""
        self.held[index] = self.held.get(index, "") + event.text
        if event.finish_reason is None or self.tools is None:
            return
        content, calls = self.tools.parse(self.held.pop(index))
        if content:
            yield self._chunk(index, {"delta": {"content": content}, "finish_reason": None})
        for i, call in enumerate(calls):
            yield self._chunk(
                index, {"delta": {"tool_calls": [{"index": i, **call.model_dump()}]}, "finish_reason": None}
            )
        yield self._chunk(index, {"delta": {}, "finish_reason": finish_reason(event.finish_reason, calls)})

    def _opening(self, index: int, event: StreamEvent) -> Iterable[dict[str, Any]]:
        if self.chat:
            yield self._chunk(index, {"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            return
        echo = self.echoes[index]
        if echo is None:
            return
        block = LogprobsBlock(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        self.extend_block(block, echo.prompt_entries(event), 0, echo.ids)
        self.offsets[index] = len(echo.text)
        yield self._chunk(
            index, {"text": echo.text, "logprobs": block.model_dump() if self.logprobs else None, "finish_reason": None}
        )

    def extend_block(
        self, block: LogprobsBlock, entries: list[TokenLogprob | None], offset: int, ids: list[int] | None = None
    ) -> int:
        """Append entries (None: the prompt's first token, `ids` says which) to a completions logprobs block;
        returns the text offset after them."""
        for i, entry in enumerate(entries):
            token = self._text(entry.token_id if entry else ids[i] if ids else 0)
            block.tokens.append(token)
            block.token_logprobs.append(entry.logprob if entry else None)
            block.top_logprobs.append(self._top_dict(entry, token) if entry else None)
            block.text_offset.append(offset)
            offset += len(token)
        return offset

    def _top_dict(self, entry: TokenLogprob, token: str) -> dict[str, float]:
        """The top tokens and the token itself, as vLLM lists them; of tokens with the same text (byte pieces),
        the likelier one's value stays."""
        top: dict[str, float] = {}
        for token_id, logprob in [*entry.top, (entry.token_id, entry.logprob)]:
            top.setdefault(self._text(token_id) if token_id != entry.token_id else token, logprob)
        return top

    def chat_entry(self, entry: TokenLogprob) -> ChatTokenLogprob:
        token = self._text(entry.token_id)
        return ChatTokenLogprob(
            token=token,
            logprob=entry.logprob,
            bytes=list(token.encode()),
            top_logprobs=[
                TopLogprob(token=(t := self._text(i)), logprob=lp, bytes=list(t.encode())) for i, lp in entry.top
            ],
        )

    def usage(self, timings: list[Timings]) -> Usage:
        prompt = sum(t.prompt_tokens for i, t in enumerate(timings) if i % self.n == 0)
        completion = sum(t.completion_tokens for t in timings)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)

    def _head(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, index: int, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(), "choices": [{"index": index, "logprobs": None, **choice}]}
