"""From a validated body to engine events, for every route.

`Dispatcher.prepare` does the checks that need the tokenizer (caps, prompt tokens vs context) without tensor work;
`Job.start` submits and waits for the first event under the deadline, so every refusal the engine makes
(overloaded, timeout) is still an HTTP status; after that the job is a stream whose errors become an SSE
error event. Closing a job (client gone, deadline, shutdown) closes the engine's iterator, which cancels
the request and frees its KV. One HTTP request may run several jobs (a batch of prompts, `n` choices):
`Jobs` starts them together and merges their events, each tagged with its choice index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from inferlab.engine.engine import GenerationRequest, InferenceEngine, StreamEvent
from inferlab.engine.sampling import SamplingParams
from inferlab.errors import InferlabError, InvalidRequestError, RequestTimeoutError
from inferlab.server.guards import envelope
from inferlab.server.metrics import RequestRecord
from inferlab.server.settings import ServerSettings

log = logging.getLogger("inferlab.server")

DONE = b"data: [DONE]\n\n"


@dataclasses.dataclass
class Dispatcher:
    engine: InferenceEngine
    settings: ServerSettings

    async def start(
        self,
        record: RequestRecord,
        sampling: dict[str, Any],
        max_new_tokens: int | None,
        prompt: str | list[int] = "",
        chat: bool = False,
        messages: list[dict[str, Any]] | None = None,
        tokens_field: str = "max_new_tokens",
    ) -> Job:
        prompt_ids, params = self.prepare(record, sampling, max_new_tokens, prompt, chat, messages, tokens_field)
        return await Job.start(self.engine, prompt_ids, params, record, self.settings.timeout_s)

    async def start_all(self, record: RequestRecord, prepared: list[tuple[list[int], SamplingParams]]) -> Jobs:
        """Submit every prepared request at once (their prefills batch); if any is refused, close the rest."""
        timeout = self.settings.timeout_s
        started = await asyncio.gather(
            *(Job.start(self.engine, ids, params, record, timeout) for ids, params in prepared), return_exceptions=True
        )
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            for job in started:
                if isinstance(job, Job):
                    await _close(job.events)
            raise failed[0]
        return Jobs(started, record)

    def prepare(
        self,
        record: RequestRecord,
        sampling: dict[str, Any],
        max_new_tokens: int | None,
        prompt: str | list[int],
        chat: bool = False,
        messages: list[dict[str, Any]] | None = None,
        tokens_field: str = "max_new_tokens",
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """Prompt token ids and sampling parameters, or InvalidRequestError (422) before any tensor work (a
        constraint's schema, regex or grammar checked too).

        `tokens_field` is what the route calls `max_new_tokens`, for the message."""
        settings, engine = self.settings, self.engine
        chars = (len(prompt) if isinstance(prompt, str) else 0) + sum(len(m["content"]) for m in messages or ())
        chars += len(json.dumps(tools)) if tools else 0
        if chars > settings.max_prompt_chars:
            raise InvalidRequestError(
                f"prompt: {chars} characters, more than this server's {settings.max_prompt_chars}"
            )
        self.check_cap(tokens_field, max_new_tokens)
        self.check_cap("min_tokens", min_tokens := sampling.get("min_tokens") or 0)
        params = engine.sampling_params(max_new_tokens=max_new_tokens, **{**sampling, "min_tokens": 0})
        limit = min(params.max_new_tokens, settings.max_new_tokens_cap)
        # min_tokens past the tokens that will be generated asks for all of them
        params = dataclasses.replace(params, max_new_tokens=limit, min_tokens=min(min_tokens, limit))
        if params.constraint is not None:
            engine.check_constraint(params.constraint)
        try:
            prompt_ids = engine.encode_prompt(prompt, chat, messages, tools)
        except ValueError as e:  # the chat template refused the messages
            raise InvalidRequestError(str(e).splitlines()[0]) from None
        engine.check_prompt(prompt_ids)
        record.prompt_tokens += len(prompt_ids)
        return prompt_ids, params

    def check_cap(self, field: str, max_new_tokens: int | None) -> None:
        cap = self.settings.max_new_tokens_cap
        if max_new_tokens is not None and max_new_tokens > cap:
            raise InvalidRequestError(f"{field}: {max_new_tokens} is more than this server's cap of {cap}")


@dataclasses.dataclass
class Job:
    """One submitted request: its engine events, the first one already in hand, and its deadline."""

    events: AsyncIterator[StreamEvent]
    first: StreamEvent
    record: RequestRecord
    timeout_s: float

    @classmethod
    async def start(
        cls,
        engine: InferenceEngine,
        prompt_ids: list[int],
        params: SamplingParams,
        record: RequestRecord,
        timeout_s: float,
    ) -> Job:
        events = engine.submit(GenerationRequest(prompt_ids, params))
        try:
            first = await _next(events, record, timeout_s)
        except BaseException:
            await _close(events)
            raise
        return cls(events, first, record, timeout_s)

    async def _events(self) -> AsyncIterator[StreamEvent]:
        """Every event, the closing one last; the deadline covers the whole request."""
        try:
            event = self.first
            while True:
                if event.token_id is not None:
                    self.record.token()
                yield event
                if event.finish_reason is not None:
                    return
                event = await _next(self.events, self.record, self.timeout_s)
        finally:
            await _close(self.events)

    async def collect(self) -> tuple[str, list[int], StreamEvent]:
        """Text, token ids and the closing event (non-streaming routes)."""
        parts, ids = [], []
        async with aclosing(self._events()) as events:
            async for event in events:
                parts.append(event.text)
                if event.token_id is not None:
                    ids.append(event.token_id)
                if event.finish_reason is not None:
                    return "".join(parts), ids, event
        raise RuntimeError("the engine ended a request without a closing event")

    async def sse(self, render: Callable[[StreamEvent], Iterable[dict[str, Any]]]) -> AsyncIterator[bytes]:
        """`data: {...}` per rendered payload, an error event if the stream breaks, then `data: [DONE]`."""
        async for chunk in Jobs([self], self.record).sse(lambda index, event: render(event)):
            yield chunk


@dataclasses.dataclass
class Jobs:
    """The jobs of one HTTP request; job i is choice i."""

    jobs: list[Job]
    record: RequestRecord

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """Every job's events as they come, tagged with the job's index; ends when every job has closed."""
        if len(self.jobs) == 1:
            async with aclosing(self.jobs[0]._events()) as events:
                async for event in events:
                    yield 0, event
            return
        inbox: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, job: Job) -> None:
            try:
                async with aclosing(job._events()) as events:
                    async for event in events:
                        inbox.put_nowait((index, event))
            except Exception as e:  # handed to the consumer, who re-raises it
                inbox.put_nowait((index, e))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(self.jobs)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await inbox.get()
                if isinstance(item, Exception):
                    raise item
                yield index, item
                remaining -= item.finish_reason is not None
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[tuple[list[StreamEvent], StreamEvent]]:
        """Per job, in order: its token events and its closing event (non-streaming routes)."""
        tokens: list[list[StreamEvent]] = [[] for _ in self.jobs]
        closing: list[StreamEvent | None] = [None] * len(self.jobs)
        async with aclosing(self.events()) as events:
            async for index, event in events:
                if event.finish_reason is None:
                    tokens[index].append(event)
                else:
                    closing[index] = event
        if any(c is None for c in closing):
            raise RuntimeError("the engine ended a request without a closing event")
        return list(zip(tokens, closing))

    async def sse(self, render: Callable[[int, StreamEvent], Iterable[dict[str, Any]]]) -> AsyncIterator[bytes]:
        """`data: {...}` per rendered payload, an error event if the stream breaks, then `data: [DONE]`."""
        try:
            async with aclosing(self.events()) as events:
                async for index, event in events:
                    for payload in render(index, event):
                        yield sse_data(payload)
        except InferlabError as e:
            self.record.error = e.code
            yield sse_data(envelope(e.code, str(e), e.param))
        except asyncio.CancelledError:  # the client went away (or shutdown's grace ran out)
            self.record.error = "cancelled"
            raise
        except Exception as e:  # a bug mid-stream: the trace stays in the server log
            self.record.error = "internal_error"
            log.error("request %s failed mid-stream", self.record.id, exc_info=e)
            yield sse_data(envelope("internal_error", f"internal error (request {self.record.id})"))
        yield DONE


def sse_data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """text/event-stream that always closes its body iterator, at once, however the response ends.

    (Starlette cancels a body iterator suspended in `send` without closing it; garbage collection would
    close it later, and the request's KV would stay allocated until then.)
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]  # an async generator


async def _next(events: AsyncIterator[StreamEvent], record: RequestRecord, timeout_s: float) -> StreamEvent:
    remaining = record.start + timeout_s - time.perf_counter()
    try:
        async with asyncio.timeout(max(remaining, 0.0)):
            return await anext(events)
    except TimeoutError:
        raise RequestTimeoutError(f"the request did not finish within its {timeout_s:g} s deadline") from None


async def _close(events: AsyncIterator[StreamEvent]) -> None:
    with anyio.CancelScope(shield=True):
        await events.aclose()  # type: ignore[attr-defined]  # an async generator
