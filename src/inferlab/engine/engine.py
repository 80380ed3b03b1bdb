"""InferenceEngine: prompt -> prefill -> decode steps -> sampling -> text, with timings.

A single request's KV lives in a `Sequence`: a slot of the contiguous cache, blocks of the paged
pool, or (cache=none) just its token ids, recomputed in full at every step as the baseline the
KV-cache study measures against. Concurrent requests (`submit`, `generate_batch`) go through one
engine loop: a thread that owns the model and the KV memory and runs `step()` = schedule -> run ->
sample -> stream, batching every running request's decode into one forward.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
from abc import ABC, abstractmethod
from contextlib import closing
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import torch
from torch import Tensor

from inferlab.engine.batch import LeftPaddedBatch, run_static_batch
from inferlab.engine.block_manager import BlockManager, BlockTable
from inferlab.engine.kv_cache import CachedAttend, KVCache, SlotPool, compute_kv_cache_bytes
from inferlab.engine.paged import PagedKVCache, forward_paged
from inferlab.engine.prefix_cache import PrefixCache
from inferlab.engine.sampling import SamplingParams, sample
from inferlab.engine.scheduler import Scheduler, SchedulerConfig
from inferlab.engine.sequence import Request, StreamEvent, Timings
from inferlab.engine.stop import TextStream
from inferlab.errors import CapacityError, InvalidRequestError
from inferlab.model.loader import LoadedModel
from inferlab.model.transformer import Transformer, causal_attend

CONTEXT_MARGIN = 16  # a prompt must leave at least this many positions for generation


@dataclass
class EngineConfig:
    device: torch.device
    dtype: torch.dtype
    cache_mode: str  # "none" | "contiguous" | "paged"
    max_seq_len: int  # tokens one sequence may hold (prompt + generated)
    slots: int  # contiguous: sequences whose KV fits at once
    defaults: SamplingParams  # generation parameters a call does not set
    # The values below come from conf/ (cache/*.yaml, scheduler:); these defaults only serve tests
    # that build an engine by hand.
    block_size: int = 16  # paged: tokens per KV block
    kv_blocks: int = 0  # paged: blocks in the pool; 0 = the memory `slots` contiguous slots would take
    prefix_cache: bool = False  # paged: reuse the KV of full blocks of earlier prompts
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(16, 64, 256))


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    timings: Timings


@dataclass
class StreamEvent:
    """One generated token (`token_id` set), or the closing event (`finish_reason` and `timings` set)."""

    index: int
    text: str
    token_id: int | None = None
    ttft_ms: float | None = None  # on the first token only
    finish_reason: str | None = None
    timings: Timings | None = None


@dataclass
class GenerationRequest:
    prompt: str | list[int]
    params: SamplingParams
    chat: bool = False  # render `prompt` (a user message) with the model's chat template
    messages: list[dict[str, str]] | None = None
    priority: int = 0  # lower is admitted sooner; equal priorities go first-come first-served


class Sequence(ABC):
    """One request's KV state. `forward(new_ids)` appends tokens and returns the last position's logits."""

    def __init__(self, model: Transformer, device: torch.device) -> None:
        self.model, self.device, self.length = model, device, 0

    @abstractmethod
    def forward(self, token_ids: list[int]) -> Tensor: ...

    def release(self) -> None:
        """Give the KV memory back (idempotent)."""


class CachedSequence(Sequence):
    def __init__(self, model: Transformer, device: torch.device, pool: SlotPool, n_tokens: int) -> None:
        super().__init__(model, device)
        self.pool, self.slot = pool, pool.allocate(n_tokens)

    def forward(self, token_ids: list[int]) -> Tensor:
        n = len(token_ids)
        tokens = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(self.length, self.length + n, device=self.device).unsqueeze(0)
        attend = CachedAttend(self.pool.cache, self.length, n, slice(self.slot, self.slot + 1))
        logits = self.model(tokens, positions, attend, last_only=True)
        self.length += n
        return logits[0, -1]

    def release(self) -> None:
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None


class RecomputeSequence(Sequence):
    def __init__(self, model: Transformer, device: torch.device) -> None:
        super().__init__(model, device)
        self.token_ids: list[int] = []

    def forward(self, token_ids: list[int]) -> Tensor:
        self.token_ids += token_ids
        self.length = len(self.token_ids)
        tokens = torch.tensor([self.token_ids], device=self.device)
        positions = torch.arange(self.length, device=self.device).unsqueeze(0)
        return self.model(tokens, positions, causal_attend, last_only=True)[0, -1]


class PagedSequence(Sequence):
    """A single request's KV in blocks of the paged pool, its prompt's cached prefix blocks reused."""

    def __init__(self, model: Transformer, device: torch.device, cache: PagedKVCache, blocks: BlockManager,
                 prompt_ids: list[int]) -> None:
        super().__init__(model, device)
        self.cache, self.blocks, self.kv, self.token_ids = cache, blocks, BlockTable(), []
        if not blocks.allocate(self.kv, prompt_ids, len(prompt_ids)):
            raise CapacityError(f"the KV pool has no room for {len(prompt_ids)} prompt tokens now; retry later")
        self.length = self.kv.num_computed

    def forward(self, token_ids: list[int]) -> Tensor:
        self.token_ids += token_ids
        if not self.blocks.ensure_room(self.kv, len(self.token_ids)):
            raise CapacityError("the KV pool ran out of blocks; retry later or raise cache.kv_budget_mb")
        start = self.kv.num_computed
        logits = forward_paged(self.model, self.cache, [self.token_ids[start:]], [start], [self.kv.blocks])
        self.blocks.advance(self.kv, self.token_ids, len(self.token_ids) - start)
        self.length = self.kv.num_computed
        return logits[0]

    def release(self) -> None:
        self.blocks.free(self.kv)


class InferenceEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded, self.config = loaded, config
        self.model: Transformer = loaded.model
        self.tokenizer = loaded.tokenizer
        self.kv_cache: KVCache | None = None
        self.pool: SlotPool | None = None
        self.paged: PagedKVCache | None = None  # the KV memory the engine loop reads through block tables
        self.blocks: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        if config.cache_mode == "contiguous":
            self.kv_cache = KVCache(loaded.config, config.slots, config.max_seq_len, config.dtype, config.device)
            self.pool = SlotPool(self.kv_cache, loaded.config)
            self.paged = PagedKVCache.over_slots(self.kv_cache)
            slot_bytes = compute_kv_cache_bytes(loaded.config, 1, config.max_seq_len, config.dtype)
            self.blocks = BlockManager(config.slots, config.max_seq_len, slot_bytes, free_ids=self.pool.free)
        elif config.cache_mode == "paged":
            tokens = config.kv_blocks * config.block_size or config.slots * config.max_seq_len
            num_blocks = -(-tokens // config.block_size)
            self.paged = PagedKVCache.allocate(loaded.config, num_blocks, config.block_size, config.dtype, config.device)
            block_bytes = compute_kv_cache_bytes(loaded.config, 1, config.block_size, config.dtype)
            prefix = PrefixCache() if config.prefix_cache else None
            self.blocks = BlockManager(num_blocks, config.block_size, block_bytes, prefix)
        if self.blocks is not None:
            self.scheduler = Scheduler(self.blocks, config.scheduler)
        self._lock = threading.Lock()  # one forward at a time: the model and the KV memory have one owner
        self._wake = threading.Condition()  # the engine loop sleeps on it while there is nothing to do
        self._loop_thread: threading.Thread | None = None
        self._request_ids = itertools.count()
        self._single_running = 0  # requests on the one-at-a-time path (generate, stream_generate)

    # ---- the steps -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], reserve_tokens: int = 0) -> tuple[Tensor, Sequence]:
        """Run the prompt; return the logits for the next token (vocab,) and the sequence's KV state.

        `reserve_tokens` is how many generated tokens the KV slot must also hold.
        """
        self.check_prompt(prompt_ids)
        if self.config.cache_mode == "paged":
            self.blocks.check_fits(len(prompt_ids) + reserve_tokens)
            seq: Sequence = PagedSequence(self.model, self.config.device, self.paged, self.blocks, prompt_ids)
        elif self.pool is None:
            seq = RecomputeSequence(self.model, self.config.device)
        else:
            seq = CachedSequence(self.model, self.config.device, self.pool, len(prompt_ids) + reserve_tokens)
        try:
            return seq.forward(list(prompt_ids)), seq
        except BaseException:
            seq.release()
            raise

    @torch.inference_mode()
    def decode_step(self, last_token_id: int, kv_cache: Sequence) -> Tensor:
        """Feed one token; return the logits for the next one (vocab,)."""
        return kv_cache.forward([last_token_id])

    # ---- generation ------------------------------------------------------------------------------
    def sampling_params(self, **overrides) -> SamplingParams:
        """The engine's defaults (from conf/) with the caller's non-None values on top."""
        d = self.config.defaults
        values = {k: getattr(d, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)

    def encode_prompt(self, prompt: str | list[int], chat: bool = False,
                      messages: list[dict[str, str]] | None = None) -> list[int]:
        if messages is None and chat:
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            messages = [{"role": "user", "content": str(prompt)}]
        if messages is not None:
            if not any(m.get("content") for m in messages):
                raise InvalidRequestError("messages must not be empty")
            return self.tokenizer.encode(self.tokenizer.render_chat(messages))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty")
        limit = self.config.max_seq_len - CONTEXT_MARGIN
        if len(prompt_ids) > limit:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; the context allows at most {limit}")

    def iter_events(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """Generate token by token; the last event closes the request with its finish reason and timings."""
        start = time.perf_counter()
        max_new = min(params.max_new_tokens, self.config.max_seq_len - len(prompt_ids))
        with self._lock:
            logits, seq = self.prefill(prompt_ids, reserve_tokens=max_new)
        generator = params.make_generator(self.config.device)
        text = TextStream(self.tokenizer, params.stop)
        token_ids: list[int] = []
        first = start
        finish = "length"
        try:
            while True:
                token = sample(logits, params, generator)
                if not token_ids:
                    first = time.perf_counter()
                if token in self.tokenizer.eos_ids:
                    finish = "stop"
                    break
                token_ids.append(token)
                delta, stopped = text.push(token)
                yield StreamEvent(len(token_ids) - 1, delta, token, (first - start) * 1e3 if len(token_ids) == 1 else None)
                if stopped:
                    finish = "stop"
                    break
                if len(token_ids) >= max_new:
                    break
                with self._lock:
                    logits = self.decode_step(token, seq)
        finally:
            seq.release()
        timings = Timings.measure(start, first, time.perf_counter(), len(prompt_ids), len(token_ids))
        yield StreamEvent(len(token_ids), text.flush(), finish_reason=finish, timings=timings)

    def generate(self, prompt: str | list[int], max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                 stop: list[str] | str | None = None, chat: bool = False) -> Completion:
        """Complete `prompt` (raw text, or token ids); `chat=True` wraps it in the chat template first."""
        params = self.sampling_params(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, seed=seed, stop=stop)
        return self._collect(self.iter_events(self.encode_prompt(prompt, chat), params))

    def chat(self, messages: list[dict[str, str]], **kwargs) -> Completion:
        """Generate the assistant's reply to `messages` with the model's chat template."""
        params = self.sampling_params(**kwargs)
        return self._collect(self.iter_events(self.encode_prompt("", messages=messages), params))

    @staticmethod
    def _collect(events: Iterator[StreamEvent]) -> Completion:
        token_ids, parts = [], []
        for event in events:
            parts.append(event.text)
            if event.token_id is not None:
                token_ids.append(event.token_id)
            else:
                return Completion("".join(parts), token_ids, event.finish_reason, event.timings)
        raise RuntimeError("generation ended without a closing event")

    def stats(self) -> dict[str, int]:
        """Counters the server exports on /v1/metrics; a contiguous slot counts as one KV block."""
        used = self.pool.used if self.pool else 0
        return {"requests_running": used, "requests_waiting": 0, "kv_blocks_used": used,
                "kv_blocks_total": self.config.slots if self.pool else 0,
                "prefix_cache_hits": 0, "prefix_cache_misses": 0}

    def submit(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """The server's way in: an async iterator of events; closing it early cancels the request."""
        return self.stream_generate(request)

    async def stream_generate(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """Async view of `iter_events`: the tensor work runs in a worker thread, never on the event loop."""
        prompt_ids = self.encode_prompt(request.prompt, request.chat, request.messages)
        self.check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        done = object()

        def produce() -> None:
            try:
                with closing(self.iter_events(prompt_ids, request.params)) as events:
                    for event in events:
                        loop.call_soon_threadsafe(queue.put_nowait, event)
                        if cancelled.is_set():
                            break
            except BaseException as e:  # handed to the consumer, who re-raises it
                loop.call_soon_threadsafe(queue.put_nowait, e)
            loop.call_soon_threadsafe(queue.put_nowait, done)

        worker = threading.Thread(target=produce, daemon=True)
        worker.start()
        try:
            while (item := await queue.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
