"""One request's state inside the scheduler (vLLM's `Sequence`), and the events it streams out.

The scheduler moves a `Request` between waiting and running; the engine loop feeds its uncomputed
tokens and hands the logits to `sample` (the request's own sampling state: params, generator, token
history), whose `accept` turns a token into the events the client sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferlab.engine.grammar import TokenGrammar
from inferlab.engine.kv.block_manager import BlockTable
from inferlab.engine.logits import TokenLogprob, changes_logits, log_probs, process_logits, token_logprob
from inferlab.engine.sampling import SamplingParams, sample
from inferlab.engine.stop import TextStream


@dataclass
class Timings:
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float  # start of the request -> first token sampled
    total_ms: float
    tpot_ms: float  # (total - ttft) / (completion_tokens - 1)
    tokens_per_sec: float  # decode rate: 1000 / tpot_ms

    @classmethod
    def measure(cls, start: float, first: float, end: float, prompt_tokens: int, completion_tokens: int) -> Timings:
        ttft, total = (first - start) * 1e3, (end - start) * 1e3
        tpot = (total - ttft) / (completion_tokens - 1) if completion_tokens > 1 else 0.0
        return cls(prompt_tokens, completion_tokens, ttft, total, tpot, 1e3 / tpot if tpot > 0 else 0.0)


@dataclass
class StreamEvent:
    """One generated token (`token_id` set), or the closing event (`finish_reason` and `timings` set)."""

    index: int
    text: str
    token_id: int | None = None
    ttft_ms: float | None = None  # on the first token only
    finish_reason: str | None = None
    timings: Timings | None = None
    logprob: TokenLogprob | None = None  # the token's (closing: the stop token's), when logprobs were asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the request's first event, when asked (echo)


@dataclass(eq=False)
class Request:
    request_id: int  # arrival order: ties in priority go first-come first-served
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # the params' value, capped by the context
    text: TextStream
    eos_ids: set[int]  # the tokens that end it: EOS (unless ignore_eos) and stop_token_ids
    emit: Callable[[StreamEvent | BaseException], None]  # called on the engine loop's thread
    generator: torch.Generator | None = None
    priority: int = 0  # lower runs sooner
    start: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    kv: BlockTable = field(default_factory=BlockTable)
    cancelled: bool = False
    finish_reason: str | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # filled by the prefill
    grammar: TokenGrammar | None = None  # what its output must match (params.constraint), advanced by `accept`

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prefill must return every position's logits (and must not skip cached prefix blocks)."""
        return self.params.prompt_logprobs is not None

    @property
    def records_prompt_logits(self) -> bool:
        """The next forward needs every row's logits: prompt log-probabilities are asked and the prompt is not
        all in."""
        return self.wants_prompt_logprobs and self.kv.num_computed < len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed: the rest of the prompt (or all of it after a preemption), else the last sample."""
        return self.num_tokens - self.kv.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def record_prompt_logits(self, start: int, logits: Tensor) -> None:
        """(T, vocab) logits of positions start.. -> the log-probabilities of the prompt tokens they predict.

        Positions already recorded (a prefill recomputed after a preemption) are kept as they are.
        """
        for i in range(logits.shape[0]):
            target = start + i + 1
            if target == len(self.prompt_logprobs) and target < len(self.prompt_ids):
                entry = token_logprob(log_probs(logits[i]), self.prompt_ids[target], self.params.prompt_logprobs)
                self.prompt_logprobs.append(entry)

    def sample(self, logits: Tensor, argmax: int | None = None) -> list[StreamEvent]:
        """The next token from the last position's (vocab,) logits, through this request's own history and
        generator, accepted; a request that generates nothing (max_new_tokens=0, echo only) just closes.

        `argmax` is the logits' argmax where the caller took every request's at once (the engine loop): a
        greedy request whose history changes nothing takes it as its token, where its grammar (if any) allows it."""
        if self.max_new_tokens == 0:
            return [self._close("length")]
        takes_argmax = argmax is not None and self.params.greedy and not changes_logits(self.params)
        if takes_argmax and (self.grammar is None or self.grammar.allows(argmax)):
            token = argmax
        else:
            processed = process_logits(logits, self.params, self.prompt_ids, self.output_ids, self.eos_ids)
            if self.grammar is not None:
                processed = self.grammar.mask(processed)
            token = sample(processed, self.params, self.generator)
        top = self.params.logprobs
        return self.accept(token, token_logprob(log_probs(logits), token, top) if top is not None else None)

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> list[StreamEvent]:
        """A sampled token -> the events to stream: the token's, and the closing one when it ends the request (EOS,
        a stop string, max_new_tokens, or a grammar that nothing but EOS may follow)."""
        now = time.perf_counter()
        first = not self.output_ids
        if first:
            self.first_token_time = now
        if token in self.eos_ids:
            return [self._close("stop", logprob)]
        if self.grammar is not None:
            self.grammar.advance(token)
        self.output_ids.append(token)
        delta, stopped = self.text.push(token)
        n = len(self.output_ids)
        events = [
            StreamEvent(
                n - 1,
                delta,
                token,
                (now - self.start) * 1e3 if n == 1 else None,
                logprob=logprob,
                prompt_logprobs=self._prompt_logprobs() if first else None,
            )
        ]
        stopped = stopped or (self.grammar is not None and self.grammar.complete)
        if stopped or n >= self.max_new_tokens:
            events.append(self._close("stop" if stopped else "length"))
        return events

    def _close(self, reason: str, logprob: TokenLogprob | None = None) -> StreamEvent:
        """The closing event; `logprob` is the stop token's (EOS or a stop_token_id), which is not part of the
        text but is of the logprobs (as vLLM lists it; lm-eval's echo scoring counts on it)."""
        self.finish_reason = reason
        end = time.perf_counter()
        first = self.first_token_time or end
        timings = Timings.measure(self.start, first, end, len(self.prompt_ids), len(self.output_ids))
        return StreamEvent(
            len(self.output_ids),
            self.text.flush(),
            finish_reason=reason,
            timings=timings,
            logprob=logprob,
            prompt_logprobs=None if self.output_ids else self._prompt_logprobs(),
        )

    def _prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        return self.prompt_logprobs if self.wants_prompt_logprobs else None
