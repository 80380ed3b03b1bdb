"""InferenceEngine, the front door: prompt -> tokens -> the path that runs them -> text.

Which path runs a request depends only on how it came in and on the cache mode (`ROUTES`, below):

    way in                                 cache=paged    cache=contiguous    cache=none
    submit (the server)                    loop           loop                single
    generate, chat, stream_generate        loop           single              single
    generate_batch                         loop           static batch        single, one by one
    prefill, decode_step (the contract)    single         single              single

loop: the engine loop (engine/loop.py: schedule -> one flat forward -> sample -> stream), batched with whatever else
runs; with spec on, every decoding sequence drafts and the step's forward verifies (engine/spec/in_loop.py).
single: the single-sequence reference (engine/reference/single.py), one request's prefill and decode steps under
the engine lock; cache=none recomputes the whole prefix at every step (the baseline the KV-cache study measures
against); with spec on, the request speculates alone (engine/spec/session.py). static batch: the seed's left-padded
static batch over the contiguous slots (engine/reference/static_batch.py), in waves of at most `slots` prompts.
`speculative_generate` (the contract) runs a target and a draft outside any engine.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

import torch
from torch import Tensor

from inferlab.engine.grammar import Constraint, GrammarCompiler
from inferlab.engine.kv.block_manager import BlockManager
from inferlab.engine.kv.budget import KVPool
from inferlab.engine.kv.contiguous import KVCache, SlotPool, compute_kv_cache_bytes
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.engine.kv.prefix_cache import PrefixCache
from inferlab.engine.loop import EngineLoop, FaultHook
from inferlab.engine.reference.single import CachedSequence, PagedSequence, RecomputeSequence, SingleSequence
from inferlab.engine.reference.static_batch import LeftPaddedBatch, run_static_batch
from inferlab.engine.request import Request, StreamEvent, Timings
from inferlab.engine.runtime.cpus import CpuGrant
from inferlab.engine.runtime.mailbox import mailbox
from inferlab.engine.runtime.threads import StepThreads, on_own_thread
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.scheduler import Scheduler, SchedulerConfig
from inferlab.engine.spec.draft_model import loop_drafts
from inferlab.engine.spec.in_loop import LoopSpeculation
from inferlab.engine.spec.session import Speculation, stream_events
from inferlab.engine.stop import TextStream
from inferlab.errors import CapacityError, EngineFailedError, InvalidRequestError
from inferlab.kernels.attention import decode_attention_applies
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.loader import LoadedModel
from inferlab.model.transformer import Transformer

CONTEXT_MARGIN = 16  # a prompt must leave at least this many positions for generation

# The routing table of the module docstring: way in -> cache mode -> the path that serves it
LOOP, SINGLE, STATIC_BATCH = "loop", "single", "static batch"
ROUTES = {
    "submit": {"paged": LOOP, "contiguous": LOOP, "none": SINGLE},
    "generate": {"paged": LOOP, "contiguous": SINGLE, "none": SINGLE},  # also chat and stream_generate
    "generate_batch": {"paged": LOOP, "contiguous": STATIC_BATCH, "none": SINGLE},
}


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
    int8_activations: bool = False  # the fused step's int4 products take int8 codes per block (precision.activations)
    small_steps: StepThreads = StepThreads()  # the engine loop's intra-op threads per step (engine/runtime/threads.py)
    threads: int = 0  # a step's intra-op threads at most (device.threads, else the grant's); 0 = torch's count
    cpus: CpuGrant | None = None  # what the OS grants the process (the startup line)
    kv_pool: KVPool | None = None  # how the KV memory was sized (engine/kv/budget.py; the startup line)

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


class InferenceEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, speculation: Speculation | None = None) -> None:
        self.loaded, self.config = loaded, config
        self.model: Transformer = loaded.model
        self.tokenizer = loaded.tokenizer
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)  # constrained requests' matchers
        self.load_stats: dict[str, float] = {}  # the load's time and peak resident memory (api.engine_from_config)
        self.kv_cache: KVCache | None = None
        self.pool: SlotPool | None = None
        self.paged: PagedKVCache | None = None  # the KV memory the engine loop reads through block tables
        self.blocks: BlockManager | None = None
        self.loop: EngineLoop | None = None  # the engine loop over `paged` (both cache layouts)
        self.team = config.small_steps.team()  # each forward's intra-op threads, the loop's and the caller's alike
        decode_kernel = decode_attention_applies(config.device, config.dtype, loaded.config.head_dim, config.kernels)
        # a cached forward of up to FusedDecode.covers rows runs as one C++ call (None: the Python model)
        self.fused = (
            FusedDecode.build(
                self.model, config.device, config.dtype, config.kernels, 1 if config.int8_activations else 0
            )
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
        self._lock = threading.Lock()  # one forward at a time: the model and the KV memory have one owner
        if self.blocks is not None:
            self.loop = EngineLoop(self.model, self.paged, self.blocks, config.scheduler, self.fused, self._lock)
            self.loop.threads = self.team
            weakref.finalize(self, self.loop.stop)  # an engine dropped without close(): its loop thread ends too
        self.scheduler: Scheduler | None = self.loop.scheduler if self.loop else None
        self.speculation = speculation  # spec=ngram|draft|self: drafted and verified, in the loop where it runs
        self._request_ids = itertools.count()
        self._single_running = 0  # requests on a one-at-a-time path (single sequences, static batches, spec)

    @property
    def speculation(self) -> Speculation | None:
        return self._speculation

    @speculation.setter
    def speculation(self, speculation: Speculation | None) -> None:
        """The drafter for every way in; the engine loop's sequences draft in a pool of their own, allocated on a thread
        that ends (on_own_thread): a draft model's KV pool zero-filled on the caller's thread would leave that thread
        an OpenMP team beside the loop's, more threads than cores, and every later step would wait on it."""
        self._speculation = speculation
        if self.loop is not None:
            loop_speculation = on_own_thread(lambda: self._loop_speculation(speculation)) if speculation else None
            with self._lock:
                self.loop.set_speculation(loop_speculation)

    def _loop_speculation(self, speculation: Speculation) -> LoopSpeculation:
        drafts = loop_drafts(speculation.drafter, self.paged, self.config.device)
        return LoopSpeculation(speculation, drafts, self.blocks, self.model)

    def close(self) -> None:
        """End the engine loop's thread, and the OpenMP team of worker threads it keeps; later requests are refused.
        Also done when the engine is garbage-collected. A loop left idle beside another engine's keeps its team: more
        OpenMP threads than cores, and libgomp then ends every wait at a parallel region's barrier with a futex sleep
        (engine/runtime/threads.py): the next engine built in the same process (a sweep's next job) would run every step
        slower beside a dropped engine's idle loop."""
        if self.loop is not None:
            self.loop.stop()

    @property
    def failure(self) -> str | None:
        """Why the engine loop stopped; set once, then every request is refused."""
        return self.loop.failure if self.loop else None

    def health(self) -> dict[str, str]:
        """What /health says of the engine; EngineFailedError (with the reason) once its loop has stopped."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        return {"status": "ok"}

    @property
    def fault_hook(self) -> FaultHook | None:
        return self.loop.fault_hook if self.loop else None

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:  # tests only
        if self.loop is not None:
            self.loop.fault_hook = hook

    def route(self, way_in: str) -> str:
        """The path that serves a request coming in by `way_in` (ROUTES): LOOP, SINGLE or STATIC_BATCH."""
        return ROUTES[way_in][self.config.cache_mode]

    # ---- the steps -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], reserve_tokens: int = 0) -> tuple[Tensor, SingleSequence]:
        """Run the prompt; return the logits for the next token (vocab,) and the sequence's KV state.

        `reserve_tokens` is how many generated tokens the KV slot must also hold.
        """
        self.check_prompt(prompt_ids)
        if self.config.cache_mode == "paged":
            self.blocks.check_fits(len(prompt_ids) + reserve_tokens)
            seq: SingleSequence = PagedSequence(
                self.model, self.config.device, self.paged, self.blocks, prompt_ids, self.fused
            )
        elif self.pool is None:
            seq = RecomputeSequence(self.model, self.config.device)
        else:
            seq = CachedSequence(
                self.model, self.config.device, self.pool, len(prompt_ids) + reserve_tokens, self.fused
            )
        try:
            with self.team.step(len(prompt_ids)):
                return seq.forward(list(prompt_ids)), seq
        except BaseException:
            seq.release()
            raise

    @torch.inference_mode()
    def decode_step(self, last_token_id: int, kv_cache: SingleSequence) -> Tensor:
        """Feed one token; return the logits for the next one (vocab,)."""
        with self.team.step(1):
            return kv_cache.forward([last_token_id])

    # ---- generation ------------------------------------------------------------------------------
    def sampling_params(self, **overrides) -> SamplingParams:
        """The engine's defaults (from conf/) with the caller's non-None values on top."""
        d = self.config.defaults
        values = {k: getattr(d, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)

    def encode_prompt(
        self,
        prompt: str | list[int],
        chat: bool = False,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a raw prompt, or of `messages` (and `tools`) through the model's chat template."""
        if messages is None and chat:
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            messages = [{"role": "user", "content": str(prompt)}]
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages must not be empty")
            return self.tokenizer.encode(self.tokenizer.render_chat(messages, tools=tools))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def check_constraint(self, constraint: Constraint) -> None:
        """InvalidRequestError naming the constraint's field if its schema, regex or grammar is invalid."""
        self.grammars.check(constraint)

    def check_supported(self, params: SamplingParams, loop: bool) -> None:
        """Refuse, by name, what this path cannot do: speculative decoding samples many positions per
        forward without a request's history, and verifies a grammar's drafts only in the engine loop; prompt
        log-probabilities come from the engine loop's prefill."""
        if self.speculation is not None and params.constraint is not None and not (loop and self.loop is not None):
            raise InvalidRequestError(
                f"{params.constraint.param}: constrained output with speculative decoding runs in the engine loop "
                "only; serve with cache=paged or cache=contiguous, or spec=off",
                param=params.constraint.param,
            )
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
        through_loop = self.route("generate") == LOOP
        self.check_supported(params, loop=through_loop)
        if through_loop:
            yield from self._iter_loop(prompt_ids, params)
        elif self.speculation is not None:
            yield from self._iter_speculative(prompt_ids, params)
        else:
            yield from self._iter_single(prompt_ids, params)

    def _iter_loop(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """Through the engine loop, with the caller waiting (not bounded by the wait queue); closing cancels."""
        self.check_prompt(prompt_ids)
        inbox: SimpleQueue = SimpleQueue()
        request = self._new_request(prompt_ids, params, inbox.put)
        self.loop.add(request, bounded=False)
        try:
            yield from drain(inbox)
        finally:
            self.loop.cancel(request)

    def _iter_single(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """One sequence's prefill then decode steps (engine/reference/single.py), the engine lock taken per forward."""
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
        """A drafter proposes, the target verifies K+1 positions per forward (engine/spec/session.py)."""
        self.check_prompt(prompt_ids)
        request = self._new_request(prompt_ids, params, emit=lambda item: None)  # events are yielded, not emitted
        with self._lock:  # the prompt runs exactly as without speculation: the verified rows continue its KV
            logits, seq = self.prefill(prompt_ids, reserve_tokens=request.max_new_tokens)
            self._single_running += 1
        try:
            session = self.speculation.start(
                self.model, prompt_ids, params, request.max_new_tokens, request.generator, prefilled=(logits, seq)
            )
            yield from stream_events(session, request, self._lock)
        finally:
            with self._lock:
                seq.release()
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

        contiguous: left-padded static batches of at most `slots` prompts (the seed's reference path);
        paged: the engine loop; none: one after another (the recompute baseline batches nothing).
        """
        params = self.sampling_params(max_new_tokens=max_new_tokens, **sampling)
        path = self.route("generate_batch")
        self.check_supported(params, loop=path == LOOP)
        prompt_ids = [self.encode_prompt(p) for p in prompts]
        for ids in prompt_ids:
            self.check_prompt(ids)
        if path == STATIC_BATCH:
            waves = [prompt_ids[i : i + self.config.slots] for i in range(0, len(prompt_ids), self.config.slots)]
            return [c for wave in waves for c in self._generate_left_padded(wave, params)]
        if path == LOOP:
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
        inboxes: list[SimpleQueue] = [SimpleQueue() for _ in prompt_ids]
        requests = [self._new_request(ids, params, inbox.put) for ids, inbox in zip(prompt_ids, inboxes)]
        try:
            for request in requests:
                self.loop.add(request, bounded=False)
            return [self._collect(drain(inbox)) for inbox in inboxes]
        finally:
            for request in requests:
                self.loop.cancel(request)

    def describe(self) -> str:
        """The serving choices in one line: precision, KV memory, how many sequences run at once."""
        c = self.config
        parts = [f"precision {c.precision or c.dtype}", f"cache={c.cache_mode}"]
        if c.int8_activations and self.fused is not None:
            parts.insert(1, "int8 activation codes on the fused step")
        sized = f"; {c.kv_pool.describe()}" if c.kv_pool else ""
        if c.cache_mode == "paged":
            parts.append(
                f"{self.blocks.num_blocks} KV blocks of {c.block_size} tokens in {str(c.cache_dtype).removeprefix('torch.')} "
                f"({self.paged.nbytes / 2**20:.0f} MiB{sized}), prefix cache {'on' if c.prefix_cache else 'off'}"
            )
        elif c.cache_mode == "contiguous":
            parts.append(
                f"{c.slots} KV slots of {c.max_seq_len} tokens ({self.kv_cache.nbytes / 2**20:.0f} MiB{sized})"
            )
        parts.append(f"context {c.max_seq_len:,} tokens a sequence")
        if self.scheduler is not None:
            parts.append(f"up to {c.scheduler.max_running} running sequences")
        if c.device.type == "cpu":
            share = ", fewer while other processes keep those busy" if c.small_steps.share else ""
            grant = f" ({c.cpus.describe()}{share})" if c.cpus else ""
            threads = c.threads or torch.get_num_threads()
            parts.append(f"{threads} thread{'s' * (threads != 1)}{grant}")
        if self.speculation is not None:
            s = self.speculation
            parts.append(
                f"spec={s.drafter.name} (K <= {s.k}{', adaptive' if s.adaptive else ''}; "
                f"a draft token costs {s.drafter.step_cost(self.model):.2f} target steps)"
            )
        return ", ".join(parts)

    def stats(self) -> dict[str, float]:
        """Counters the server exports on /v1/metrics; a contiguous slot counts as one KV block of max_seq_len."""
        blocks, prefix, scheduler = self.blocks, self.blocks and self.blocks.prefix, self.scheduler
        return {
            "requests_running": (len(scheduler.running) if scheduler else 0) + self._single_running,
            "requests_waiting": len(scheduler.waiting) if scheduler else 0,
            "kv_blocks_used": blocks.num_used if blocks else 0,
            "kv_blocks_total": blocks.num_blocks if blocks else 0,
            # the share of the pool held by requests (cached blocks no request holds are free to take): the
            # KV-cache utilization a cluster router (the Gateway API Inference Extension) weighs, from 0 to 1
            "kv_cache_usage_perc": blocks.num_used / blocks.num_blocks if blocks else 0.0,
            "kv_block_size": blocks.block_size if blocks else 0,  # tokens per block
            "kv_bytes_per_block": self.paged.nbytes // self.paged.num_blocks if self.paged else 0,  # of the tensors
            "kv_tokens_computed": blocks.tokens_computed if blocks else 0,  # KV written: what prefix hits save
            "prefix_cache_hits": prefix.hits if prefix else 0,  # full prompt blocks found cached
            "prefix_cache_misses": prefix.misses if prefix else 0,
            "prefix_cache_evictions": prefix.evictions if prefix else 0,
            "prefix_cache_blocks": prefix.num_cached if prefix else 0,
            "preemptions": scheduler.preemptions if scheduler else 0,
            **(self.speculation.counters() if self.speculation else {}),  # spec_target_calls, spec_accepted, ...
            **(self.loop.stats.snapshot() if self.loop else {}),  # engine_steps, engine_forward_s, ...
        }

    def submit(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """The server's way in: an async iterator of events; closing it early cancels the request.

        Bad input (InvalidRequestError), a request the whole KV pool could never hold (CapacityError)
        and a full wait queue (OverloadedError) raise here, before any tensor work. Call it from the
        event loop. With cache=none requests run one at a time, recomputed (the baseline).
        """
        self.check_supported(request.params, loop=True)
        if self.route("submit") != LOOP:
            return self.stream_generate(request)
        return self._submit(request, bounded=True)

    def _submit(self, request: GenerationRequest, bounded: bool) -> AsyncIterator[StreamEvent]:
        """Queue `request` on the engine loop now; its events arrive on this event loop."""
        prompt_ids = self.encode_prompt(request.prompt, request.chat, request.messages)
        self.check_prompt(prompt_ids)
        box = mailbox()  # the engine thread's events reach this event loop batched, one wakeup per step
        inbox: asyncio.Queue = asyncio.Queue()
        scheduled = self._new_request(
            prompt_ids,
            request.params,
            lambda item: box.post(inbox, item),
            priority=request.priority,
        )
        self.loop.add(scheduled, bounded)
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
            self.loop.cancel(request)

    # ---- requests ----------------------------------------------------------------------------------
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
        grammar = self.grammars.start(params.constraint) if params.constraint is not None else None
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
            grammar=grammar,
        )

    async def stream_generate(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """Async view of `iter_events`: through the engine loop on the paged cache (not bounded by the wait queue),
        else in a worker thread; the tensor work never runs on the event loop."""
        through_loop = self.route("generate") == LOOP
        self.check_supported(request.params, loop=through_loop)
        if through_loop:
            async for event in self._submit(request, bounded=False):
                yield event
            return
        prompt_ids = self.encode_prompt(request.prompt, request.chat, request.messages)
        self.check_prompt(prompt_ids)
        box = mailbox()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        done = object()

        def produce() -> None:
            try:
                with closing(self.iter_events(prompt_ids, request.params)) as events:
                    for event in events:
                        box.post(queue, event)
                        if cancelled.is_set():
                            break
            except BaseException as e:  # handed to the consumer, who re-raises it
                box.post(queue, e)
            box.post(queue, done)

        worker = threading.Thread(target=produce, daemon=True)
        worker.start()
        try:
            while (item := await queue.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()


def drain(inbox: SimpleQueue) -> Iterator[StreamEvent]:
    """A request's events as the engine loop emits them, up to its closing one; an error it ended with is raised."""
    while True:
        item = inbox.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finish_reason is not None:
            return
