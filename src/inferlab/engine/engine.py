"""InferenceEngine: prompt -> prefill -> decode steps -> sampling -> text, with timings.

A single request's KV lives in a `Sequence`: a slot of the contiguous cache, blocks of the paged
pool, or (cache=none) just its token ids, recomputed in full at every step as the baseline the
KV-cache study measures against. Concurrent requests (`submit`, `generate_batch`) go through one
engine loop: a thread that owns the model and the KV memory and runs `step()` = schedule -> run ->
sample -> stream, every running request's decode token and prompt chunks in one flat forward.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from queue import SimpleQueue

import torch
from torch import Tensor

from inferlab.engine.batch import LeftPaddedBatch, run_static_batch
from inferlab.engine.block_manager import BlockManager, BlockTable
from inferlab.engine.flat import FlatBatch, Segment, forward_flat
from inferlab.engine.kv_cache import CachedAttend, KVCache, SlotPool, compute_kv_cache_bytes
from inferlab.engine.paged import PagedKVCache, forward_paged
from inferlab.engine.prefix_cache import PrefixCache
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.scheduler import Scheduler, SchedulerConfig
from inferlab.engine.sequence import Request, StreamEvent, Timings
from inferlab.engine.speculative import Speculation, stream_events
from inferlab.engine.stop import TextStream
from inferlab.errors import CapacityError, EngineFailedError, GenerationError, InvalidRequestError
from inferlab.kernels.attention import decode_attention_applies
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.loader import LoadedModel
from inferlab.model.transformer import Transformer, causal_attend

CONTEXT_MARGIN = 16  # a prompt must leave at least this many positions for generation

log = logging.getLogger(__name__)

# Tests inject a fault here: called with the stage ("forward", "sample") and the requests it covers;
# raising an Exception fails that work, raising a BaseException (SystemExit) stops the engine loop.
FaultHook = Callable[[str, "list[Request]"], None]


@dataclass
class EngineConfig:
    device: torch.device
    dtype: torch.dtype
    cache_mode: str  # "none" | "contiguous" | "paged"
    max_seq_len: int  # tokens one sequence may hold (prompt + generated)
    slots: int  # contiguous: sequences whose KV fits at once
    defaults: SamplingParams  # generation parameters a call does not set
    block_size: int  # paged: tokens per KV block
    kv_blocks: int  # paged: blocks in the pool; 0 = the memory `slots` contiguous slots would take
    prefix_cache: bool  # paged: reuse the KV of full blocks of earlier prompts
    scheduler: SchedulerConfig
    kernels: str  # "fast" | "portable": kernels/select.py (device.kernels)
    precision: str = ""  # the precision served and, for precision=auto, why (the startup line)
    kv_dtype: torch.dtype | None = None  # paged: the KV pool's element type; None = dtype, torch.int8 = codes + scales

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    timings: Timings


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
    def __init__(
        self, model: Transformer, device: torch.device, pool: SlotPool, n_tokens: int, fused: FusedDecode | None = None
    ) -> None:
        super().__init__(model, device)
        self.pool, self.slot, self.fused = pool, pool.allocate(n_tokens), fused
        self.block_table = torch.tensor([[self.slot]], device=device)  # the slot is one max_seq_len block

    def forward(self, token_ids: list[int]) -> Tensor:
        n = len(token_ids)
        if self.fused is not None and self.fused.covers(n):
            cache = self.pool.cache
            logits = self.fused.extend(token_ids, cache.k, cache.v, self.block_table, self.length)
            self.length += n
            return logits[-1]
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

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        cache: PagedKVCache,
        blocks: BlockManager,
        prompt_ids: list[int],
        fused: FusedDecode | None = None,
    ) -> None:
        super().__init__(model, device)
        self.cache, self.blocks, self.kv, self.token_ids, self.fused = cache, blocks, BlockTable(), [], fused
        if not blocks.allocate(self.kv, prompt_ids, len(prompt_ids)):
            raise CapacityError(f"the KV pool has no room for {len(prompt_ids)} prompt tokens now; retry later")
        self.length = self.kv.num_computed

    def forward(self, token_ids: list[int]) -> Tensor:
        self.token_ids += token_ids
        if not self.blocks.ensure_room(self.kv, len(self.token_ids)):
            raise CapacityError("the KV pool ran out of blocks; retry later or raise cache.kv_budget_mb")
        start = self.kv.num_computed
        logits = forward_paged(self.model, self.cache, [self.token_ids[start:]], [start], [self.kv.blocks], self.fused)
        self.blocks.advance(self.kv, self.token_ids, len(self.token_ids) - start)
        self.length = self.kv.num_computed
        return logits[0]

    def release(self) -> None:
        self.blocks.free(self.kv)


class InferenceEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, speculation: Speculation | None = None) -> None:
        self.loaded, self.config = loaded, config
        self.speculation = speculation  # spec=ngram|draft|self: requests run one at a time, drafted and verified
        self.model: Transformer = loaded.model
        self.tokenizer = loaded.tokenizer
        self.load_stats: dict[str, float] = {}  # the load's time and peak resident memory (api.engine_from_config)
        self.kv_cache: KVCache | None = None
        self.pool: SlotPool | None = None
        self.paged: PagedKVCache | None = None  # the KV memory the engine loop reads through block tables
        self.blocks: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        decode_kernel = decode_attention_applies(config.device, config.dtype, loaded.config.head_dim, config.kernels)
        # a cached decode step of at most FusedDecode.covers rows runs as one C++ call (None: the Python model)
        self.fused = (
            FusedDecode.build(self.model, config.device, config.dtype, config.kernels)
            if config.cache_mode != "none"
            else None
        )
        if speculation is not None:  # a draft model decodes through its own fused step too
            speculation.drafter.build_fused(config.device, config.dtype, config.kernels)
        if config.cache_mode == "contiguous":
            self.kv_cache = KVCache(loaded.config, config.slots, config.max_seq_len, config.dtype, config.device)
            self.kv_cache.decode_kernel = decode_kernel
            self.pool = SlotPool(self.kv_cache, loaded.config)
            self.paged = PagedKVCache.over_slots(self.kv_cache)
            slot_bytes = compute_kv_cache_bytes(loaded.config, 1, config.max_seq_len, config.dtype)
            self.blocks = BlockManager(config.slots, config.max_seq_len, slot_bytes, free_ids=self.pool.free)
        elif config.cache_mode == "paged":
            tokens = config.kv_blocks * config.block_size or config.slots * config.max_seq_len
            num_blocks = -(-tokens // config.block_size)
            self.paged = PagedKVCache.allocate(
                loaded.config, num_blocks, config.block_size, config.cache_dtype, config.device
            )
            self.paged.decode_kernel = decode_kernel
            block_bytes = compute_kv_cache_bytes(loaded.config, 1, config.block_size, config.cache_dtype)
            prefix = PrefixCache() if config.prefix_cache else None
            self.blocks = BlockManager(num_blocks, config.block_size, block_bytes, prefix)
        if self.blocks is not None:
            self.scheduler = Scheduler(self.blocks, config.scheduler)
        self._lock = threading.Lock()  # one forward at a time: the model and the KV memory have one owner
        self._wake = threading.Condition()  # the engine loop sleeps on it while there is nothing to do
        self._loop_thread: threading.Thread | None = None
        self._request_ids = itertools.count()
        self._single_running = 0  # requests on the one-at-a-time path (generate, stream_generate)
        self.failure: str | None = None  # why the engine loop stopped; set once, then every submit is refused
        self.fault_hook: FaultHook | None = None  # tests only

    # ---- the steps -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], reserve_tokens: int = 0) -> tuple[Tensor, Sequence]:
        """Run the prompt; return the logits for the next token (vocab,) and the sequence's KV state.

        `reserve_tokens` is how many generated tokens the KV slot must also hold.
        """
        self.check_prompt(prompt_ids)
        if self.config.cache_mode == "paged":
            self.blocks.check_fits(len(prompt_ids) + reserve_tokens)
            seq: Sequence = PagedSequence(
                self.model, self.config.device, self.paged, self.blocks, prompt_ids, self.fused
            )
        elif self.pool is None:
            seq = RecomputeSequence(self.model, self.config.device)
        else:
            seq = CachedSequence(
                self.model, self.config.device, self.pool, len(prompt_ids) + reserve_tokens, self.fused
            )
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

    def encode_prompt(
        self, prompt: str | list[int], chat: bool = False, messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        if messages is None and chat:
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            messages = [{"role": "user", "content": str(prompt)}]
        if messages is not None:
            if not messages:
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

    def check_supported(self, params: SamplingParams, loop: bool) -> None:
        """Refuse, by name, what this path cannot do: speculative decoding samples many positions per
        forward without a request's history; prompt log-probabilities come from the engine loop's prefill."""
        if self.speculation is not None and params.history_fields():
            raise InvalidRequestError(
                f"{', '.join(params.history_fields())}: not available with speculative decoding; serve with spec=off"
            )
        if params.prompt_logprobs is not None and not (loop and self.scheduler is not None):
            raise InvalidRequestError(
                "prompt logprobs (echo with logprobs) are computed in the engine loop's "
                "prefill: serve with cache=contiguous or cache=paged and spec=off"
            )

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty")
        limit = self.config.max_seq_len - CONTEXT_MARGIN
        if len(prompt_ids) > limit:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; the context allows at most {limit}")

    def iter_events(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """Generate token by token; the last event closes the request with its finish reason and timings."""
        self.check_supported(params, loop=False)
        if self.speculation is not None:
            yield from self._iter_speculative(prompt_ids, params)
            return
        request = self._new_request(prompt_ids, params, emit=lambda item: None)  # events are yielded, not emitted
        with self._lock:
            logits, seq = self.prefill(prompt_ids, reserve_tokens=request.max_new_tokens)
            self._single_running += 1
        try:
            while True:
                events = request.sample(logits)
                if request.finished:
                    break
                yield from events
                with self._lock:
                    logits = self.decode_step(request.output_ids[-1], seq)
        finally:
            with self._lock:
                seq.release()
                self._single_running -= 1
        yield from events  # the last ones after the memory is back

    def _iter_speculative(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """A drafter proposes, the target verifies K+1 positions per forward (engine/speculative.py)."""
        self.check_prompt(prompt_ids)
        request = self._new_request(prompt_ids, params, emit=lambda item: None)  # events are yielded, not emitted
        session = self.speculation.start(
            self.model, prompt_ids, params, request.max_new_tokens, request.generator, self.fused
        )
        with self._lock:
            self._single_running += 1
        try:
            yield from stream_events(session, request, self._lock)
        finally:
            with self._lock:
                self._single_running -= 1

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        chat: bool = False,
    ) -> Completion:
        """Complete `prompt` (raw text, or token ids); `chat=True` wraps it in the chat template first."""
        params = self.sampling_params(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop
        )
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

    def generate_batch(
        self, prompts: list[str | list[int]], max_new_tokens: int | None = None, **sampling
    ) -> list[Completion]:
        """Complete several raw prompts together; the completions come back in prompt order.

        contiguous: left-padded static batches of at most `slots` prompts; paged: the continuous-batching
        loop; none: one after another (the recompute baseline batches nothing).
        """
        params = self.sampling_params(max_new_tokens=max_new_tokens, **sampling)
        self.check_supported(params, loop=self.config.cache_mode == "paged")
        prompt_ids = [self.encode_prompt(p) for p in prompts]
        for ids in prompt_ids:
            self.check_prompt(ids)
        if self.config.cache_mode == "contiguous":
            waves = [prompt_ids[i : i + self.config.slots] for i in range(0, len(prompt_ids), self.config.slots)]
            return [c for wave in waves for c in self._generate_left_padded(wave, params)]
        if self.scheduler is not None:
            return self._generate_scheduled(prompt_ids, params)
        return [self._collect(self.iter_events(ids, params)) for ids in prompt_ids]

    def _generate_left_padded(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        width = max(len(ids) for ids in prompt_ids)
        max_new = min(params.max_new_tokens, self.config.max_seq_len - width)
        events: list[list[StreamEvent]] = [[] for _ in prompt_ids]
        requests = [self._new_request(ids, params, out.append, max_new) for ids, out in zip(prompt_ids, events)]
        with self._lock:
            slots = []
            try:
                for _ in prompt_ids:
                    slots.append(self.pool.allocate(width + max_new))
            except CapacityError:
                for slot in slots:
                    self.pool.release(slot)
                raise
            self._single_running += len(slots)
        try:
            run_static_batch(LeftPaddedBatch(self.model, self.kv_cache, slots, prompt_ids), requests, self._lock)
        finally:
            with self._lock:
                for slot in slots:
                    self.pool.release(slot)
                self._single_running -= len(slots)
        return [self._collect(iter(e)) for e in events]

    def _generate_scheduled(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """All prompts through the engine loop at once (not bounded by the wait queue: the caller waits)."""
        inbox: SimpleQueue = SimpleQueue()
        requests = [
            self._new_request(ids, params, lambda item, i=i: inbox.put((i, item))) for i, ids in enumerate(prompt_ids)
        ]
        events: list[list[StreamEvent]] = [[] for _ in prompt_ids]
        try:
            for request in requests:
                self._enqueue(request, bounded=False)
            open_requests = len(requests)
            while open_requests:
                i, item = inbox.get()
                if isinstance(item, BaseException):
                    raise item
                events[i].append(item)
                open_requests -= item.finish_reason is not None
        finally:
            for request in requests:
                self._cancel(request)
        return [self._collect(iter(e)) for e in events]

    def describe(self) -> str:
        """The serving choices in one line: precision, KV memory, how many sequences run at once."""
        c = self.config
        parts = [f"precision {c.precision or c.dtype}", f"cache={c.cache_mode}"]
        if c.cache_mode == "paged":
            parts.append(
                f"{self.blocks.num_blocks} KV blocks of {c.block_size} tokens in {str(c.cache_dtype).removeprefix('torch.')} "
                f"({self.paged.nbytes / 2**20:.0f} MiB), prefix cache {'on' if c.prefix_cache else 'off'}"
            )
        elif c.cache_mode == "contiguous":
            parts.append(f"{c.slots} KV slots of {c.max_seq_len} tokens ({self.kv_cache.nbytes / 2**20:.0f} MiB)")
        if self.scheduler is not None:
            parts.append(f"up to {c.scheduler.max_running} running sequences")
        return ", ".join(parts)

    def stats(self) -> dict[str, int]:
        """Counters the server exports on /v1/metrics; a contiguous slot counts as one KV block of max_seq_len."""
        blocks, prefix, scheduler = self.blocks, self.blocks and self.blocks.prefix, self.scheduler
        return {
            "requests_running": (len(scheduler.running) if scheduler else 0) + self._single_running,
            "requests_waiting": len(scheduler.waiting) if scheduler else 0,
            "kv_blocks_used": blocks.num_used if blocks else 0,
            "kv_blocks_total": blocks.num_blocks if blocks else 0,
            "kv_block_size": blocks.block_size if blocks else 0,  # tokens per block
            "kv_bytes_per_block": self.paged.nbytes // self.paged.num_blocks if self.paged else 0,  # measured
            "kv_tokens_computed": blocks.tokens_computed if blocks else 0,  # KV written: what prefix hits save
            "prefix_cache_hits": prefix.hits if prefix else 0,  # full prompt blocks found cached
            "prefix_cache_misses": prefix.misses if prefix else 0,
            "prefix_cache_evictions": prefix.evictions if prefix else 0,
            "prefix_cache_blocks": prefix.num_cached if prefix else 0,
            "preemptions": scheduler.preemptions if scheduler else 0,
            **(self.speculation.counters() if self.speculation else {}),  # spec_target_calls, spec_accepted, ...
        }

    def submit(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """The server's way in: an async iterator of events; closing it early cancels the request.

        Bad input (InvalidRequestError), a request the whole KV pool could never hold (CapacityError)
        and a full wait queue (OverloadedError) raise here, before any tensor work. Call it from the
        event loop. With cache=none requests run one at a time, recomputed (the baseline); with spec on,
        one at a time, drafted and verified.
        """
        self.check_supported(request.params, loop=self.speculation is None)
        if self.scheduler is None or self.speculation is not None:
            return self.stream_generate(request)
        prompt_ids = self.encode_prompt(request.prompt, request.chat, request.messages)
        self.check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        scheduled = self._new_request(
            prompt_ids,
            request.params,
            lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item),
            priority=request.priority,
        )
        self._enqueue(scheduled)
        return self._events(scheduled, inbox)

    async def _events(self, request: Request, inbox: asyncio.Queue) -> AsyncIterator[StreamEvent]:
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._cancel(request)

    # ---- the engine loop -------------------------------------------------------------------------
    def _new_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Callable[[StreamEvent | BaseException], None],
        max_new: int | None = None,
        priority: int = 0,
    ) -> Request:
        if max_new is None:
            max_new = min(params.max_new_tokens, self.config.max_seq_len - len(prompt_ids))
        stop_ids = (set() if params.ignore_eos else set(self.tokenizer.eos_ids)) | set(params.stop_token_ids)
        return Request(
            next(self._request_ids),
            list(prompt_ids),
            params,
            max_new,
            TextStream(self.tokenizer, params.stop),
            stop_ids,
            emit,
            params.make_generator(self.config.device),
            priority,
        )

    def _enqueue(self, request: Request, bounded: bool = True) -> None:
        if self.failure is None:
            self.scheduler.add(request, bounded)
        if self.failure is not None:  # checked again: the loop may have stopped (and drained) meanwhile
            self.scheduler.finish(request)
            raise EngineFailedError(self.failure)
        with self._wake:
            if self._loop_thread is None:
                self._loop_thread = threading.Thread(target=self._run_loop, name="inferlab-engine", daemon=True)
                self._loop_thread.start()
            self._wake.notify()

    def _cancel(self, request: Request) -> None:
        """Cancel (a no-op once it ended); the loop frees its blocks before its next forward."""
        if not request.finished:
            self.scheduler.cancel(request)
            with self._wake:
                self._wake.notify()

    def _run_loop(self) -> None:
        """Run steps while there is work. A failure of one request's work fails that request alone (`_run`);
        the scheduler failing fails the requests it held; anything that escapes stops the loop for good:
        `failure` says why (the server's /health turns 503 and the process exits), and every waiting
        request is told at once."""
        try:
            while True:
                with self._wake:
                    self._wake.wait_for(self.scheduler.has_work)
                with self._lock:
                    try:
                        progressed = self.step()
                    except Exception as error:  # the scheduler's own state is in doubt: start from empty
                        progressed = True
                        log.error("an engine step failed; its requests are dropped", exc_info=error)
                        for request in self.scheduler.drain():
                            self._deliver(request, GenerationError(f"the engine step failed ({type(error).__name__})"))
                if not progressed:  # waiting for memory another path holds: do not spin
                    with self._wake:
                        self._wake.wait(0.005)
        except BaseException as error:
            self.failure = f"the engine loop stopped: {type(error).__name__} {error}".strip()
            log.critical("%s; every request is refused from now on", self.failure, exc_info=error)
            for request in self.scheduler.drain():
                self._deliver(request, EngineFailedError(self.failure))

    @torch.inference_mode()
    def step(self) -> bool:
        """One turn of the loop: schedule -> run (one flat forward) -> sample -> stream.

        Call it with the engine lock held (the loop does). Returns whether any token was computed.
        """
        work = self.scheduler.schedule().work
        if work:
            self._run(work)
        return bool(work)

    def _run(self, work: list[tuple[Request, int]]) -> None:
        """Feed each request its next `n` uncomputed tokens, all in one forward; sample those whose tokens are all in.

        A forward that raises is run again request by request (rewriting the same KV positions), so only
        the request that caused it fails; a request whose sampling, stop check or text fails fails alone.
        """
        try:
            logits = self._forward(work)
        except Exception as error:
            if len(work) == 1:
                self._fail(work[0][0], "forward", error)
            else:
                for item in work:
                    self._run([item])
            return
        for (request, n), rows in zip(work, logits):
            try:
                events = self._sample(request, rows, n)
            except Exception as error:
                self._fail(request, "sample", error)
                continue
            if request.finished:  # free first: a client that saw the closing event finds the memory back
                self.scheduler.finish(request)
            for event in events:
                self._deliver(request, event)

    def _forward(self, work: list[tuple[Request, int]]) -> list[Tensor]:
        """The step's one forward: each request's logits rows (n_logits, vocab), as `_segment` asks."""
        if self.fault_hook is not None:
            self.fault_hook("forward", [r for r, _ in work])
        segments = [self._segment(r, n) for r, n in work]
        logits = forward_flat(self.model, self.paged, FlatBatch.pack(segments, self.config.device), self.fused)
        return list(logits.split([s.n_logits for s in segments]))

    @staticmethod
    def _segment(request: Request, n: int) -> Segment:
        """A request's next `n` tokens; the logits wanted: every row of a prompt whose log-probabilities are
        asked, the last row once its tokens are all in, none for a prompt chunk with more to come."""
        start = request.kv.num_computed
        n_logits = n if request.records_prompt_logits else int(start + n == request.num_tokens)
        return Segment(request.token_ids[start : start + n], start, request.kv.blocks, n_logits)

    def _sample(self, request: Request, rows: Tensor, n: int) -> list[StreamEvent]:
        """Record the `n` computed tokens; the events of the next token once the prompt is all in."""
        if request.records_prompt_logits:
            request.record_prompt_logits(request.kv.num_computed, rows)
        self.blocks.advance(request.kv, request.token_ids, n)
        if request.num_uncomputed:
            return []  # a prompt chunk: its next token comes after the last chunk
        if self.fault_hook is not None:
            self.fault_hook("sample", [request])
        return request.sample(rows[-1])

    def _fail(self, request: Request, stage: str, error: Exception) -> None:
        log.error("request %d failed in its %s; the others continue", request.request_id, stage, exc_info=error)
        request.finish_reason = "error"
        self.scheduler.finish(request)
        self._deliver(
            request,
            GenerationError(
                f"generation failed in this request's {stage} step "
                f"({type(error).__name__}); the server log has the details"
            ),
        )

    @staticmethod
    def _deliver(request: Request, item: StreamEvent | BaseException) -> None:
        try:
            request.emit(item)
        except RuntimeError:  # the client's event loop is gone: nobody is listening
            request.cancelled = True

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
