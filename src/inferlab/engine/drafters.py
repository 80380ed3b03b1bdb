"""Drafters: cheap proposers of the next K tokens that speculative decoding verifies with the target.

Two kinds behind one interface: a draft model sharing the target's vocabulary (a small trained one,
spec=draft, or the target's own weights at int4/int8, spec=self; its own KV cache, rolled back by
resetting a length, and its own fused C++ decode step where the kernels apply), and n-gram prompt lookup
(no model: copy what followed the latest earlier occurrence of the context's last n tokens). A
`Drafter` holds what requests share (weights); `start()` gives one sequence's `DraftState`.
"""

from __future__ import annotations

import functools
import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inferlab.engine.adaptive_k import Calibration
from inferlab.engine.model_runner import SlotRunner
from inferlab.engine.sampling import SamplingParams, argmax_rows, draw, probabilities
from inferlab.errors import ModelLoadError
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import Transformer
from inferlab.paths import default_draft_dir
from inferlab.quant.apply import weight_bytes
from inferlab.quant.self_draft import self_draft

MEASURE_CONTEXT = 32  # tokens before the timed steps (measure_cost)
MEASURE_REPEATS = 8  # timed steps of each kind (measure_cost)


@dataclass
class Proposal:
    tokens: list[int]  # up to k draft tokens
    probs: Tensor | None  # (len(tokens), vocab) the distributions they were drawn from; None = deterministic


class DraftState(ABC):
    """One sequence's drafter. `calls` counts model forwards (0 for model-free drafters)."""

    calls: int = 0

    @abstractmethod
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to `k` tokens continuing `context` (prompt + generated so far)."""

    def rollback(self, length: int) -> None:
        """`context[:length]` is confirmed; forget anything cached beyond it."""


class Drafter(ABC):
    name: str
    calibration: Calibration | None = None  # the costs measure_cost timed, the engine loop's prior

    @abstractmethod
    def start(self, capacity: int) -> DraftState:
        """State for a new sequence of at most `capacity` tokens."""

    def models(self) -> list[Transformer]:
        """The models it runs (their kernels are chosen with the target's, kernels/select.py)."""
        return []

    def build_fused(self, device: torch.device, dtype: torch.dtype, kernels: str) -> None:
        """Once its models' kernels are chosen: their fused C++ decode steps, where they apply."""

    def step_cost(self, target: Transformer) -> float:
        """One draft step in target decode steps (engine/adaptive_k.py)."""
        return 0.0

    def measure_cost(self, target: Transformer, target_fused: FusedDecode | None, rows: int = 1) -> None:
        """Time target (and draft) steps of 1 and `rows` rows, for `step_cost` and `calibration`: the target's rows
        are what a verification costs; a drafter without a model drafts for nothing."""
        ((a, b),) = timed_lines([(target, target_fused)], rows)
        self.calibration = Calibration(a, b, 0.0, 0.0)


# ---- n-gram prompt lookup ------------------------------------------------------------------------


@dataclass
class NgramDrafter(Drafter, DraftState):
    """Propose the continuation of the latest earlier match of the context's last n tokens (n from max to min).

    Deterministic, so its proposals are point masses: the target accepts token d with probability p(d).
    """

    max_n: int = 3
    min_n: int = 1
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n}..{self.max_n}")

    def start(self, capacity: int) -> DraftState:
        return self  # stateless

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(lookup_continuation(context, k, self.min_n, self.max_n), None)


def lookup_continuation(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest matching suffix (at most k tokens)."""
    if k < 1:
        return []
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # latest match first, never the suffix itself
            if context[start + n - 1] == suffix[-1] and context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


# ---- draft model ---------------------------------------------------------------------------------


@dataclass
class ModelDrafter(Drafter):
    """Drafts token by token with a model; stops a round early at a proposal it gives less than
    `min_confidence` probability (its argmax's softmax when greedy): the tokens after an unsure one are
    rarely accepted, and each costs a draft step and a verified row."""

    model: Transformer
    name: str = "draft"
    min_confidence: float = 0.0
    fused: FusedDecode | None = None  # the draft's own fused decode step (build_fused); None: the Python model
    # the target's own weights (spec=self): in the engine loop it drafts over the target's KV (engine/draft_pool.py)
    target_kv: bool = False
    calibration: Calibration | None = None  # measure_cost's, which step_cost and the engine loop's prior are
    int8_from_rows: int = 0  # its fused steps of this many rows or more take int8 activation codes (FusedDecode.build)

    def start(self, capacity: int) -> DraftState:
        return ModelDraftState(SlotRunner.alone(self.model, capacity, self.fused), self.min_confidence)

    def models(self) -> list[Transformer]:
        return [self.model]

    def build_fused(self, device: torch.device, dtype: torch.dtype, kernels: str) -> None:
        self.fused = FusedDecode.build(self.model, device, dtype, kernels, self.int8_from_rows)

    def step_cost(self, target: Transformer) -> float:
        """As measured (a draft token: its draft step and its verified row), else what decoding reads every step:
        the draft's bytes over the target's."""
        if self.calibration is not None:
            return self.calibration.token_cost()
        return weight_bytes(self.model) / weight_bytes(target)

    def measure_cost(self, target: Transformer, target_fused: FusedDecode | None, rows: int = 1) -> None:
        (a, b), (draft_a, draft_b) = timed_lines([(target, target_fused), (self.model, self.fused)], rows)
        self.calibration = Calibration(a, b, draft_a, draft_b)


@torch.inference_mode()
def timed_lines(models: list[tuple[Transformer, FusedDecode | None]], rows: int) -> list[tuple[float, float]]:
    """Each model's steps as seconds = a + b * rows: steps of one row and of `rows` rows, after a short context, taken
    in turn MEASURE_REPEATS times; the first model's fastest one-row step, the others as the median of their ratios to
    the one-row step of their turn (timed one model after the other, a burst of load on the machine while the draft's
    steps ran read as a draft step costing 1.05 fp32 target steps one load and 0.15 the next; the fastest of each,
    0.1-0.6 on a busy machine). Bytes are not the whole cost: SmolLM2's int4 self draft reads 0.8x an int8 target's
    bytes but measured 1.03x its step (AVX-512)."""
    runners = [SlotRunner.alone(model, MEASURE_CONTEXT + rows, fused) for model, fused in models]
    for runner in runners:
        runner.forward(list(range(MEASURE_CONTEXT)), last_only=True)
    runs = [functools.partial(runner.verify_rows, [1] * n) for runner in runners for n in (1, rows)]
    turns = []
    for _ in range(MEASURE_REPEATS):
        turn = []
        for run in runs:
            start = time.perf_counter()
            logits = run()
            if logits.is_cuda:  # a step's kernels run after the call returns
                torch.cuda.synchronize(logits.device)
            turn.append(time.perf_counter() - start)
        turns.append(turn)
    one = min(t[0] for t in turns)
    seconds = [one] + [one * statistics.median(t[i] / t[0] for t in turns) for i in range(1, len(runs))]
    return [line(seconds[i], seconds[i + 1], rows) for i in range(0, len(runs), 2)]


def line(one: float, many: float, rows: int) -> tuple[float, float]:
    """(a, b) of seconds = a + b * rows through a step of one row and one of `rows` rows (b in 0..one)."""
    b = min(max(0.0, (many - one) / (rows - 1)), one) if rows > 1 else 0.0
    return one - b, b


@dataclass
class ModelDraftState(DraftState):
    runner: SlotRunner
    min_confidence: float = 0.0
    calls: int = field(default=0)

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        tokens: list[int] = []
        dists: list[Tensor] = []
        pending = context[self.runner.length :]  # what the draft has not seen yet (after a rollback: >= 1)
        vocab = self.runner.model.config.vocab_size
        for _ in range(k):
            logits = self.runner.forward(pending, last_only=True)[-1]  # (vocab,)
            self.calls += 1
            token, confidence = pick_draft_token(logits, params, generator, vocab, self.min_confidence, dists)
            tokens.append(token)
            if confidence < self.min_confidence:
                break
            pending = [token]
        return Proposal(tokens, torch.stack(dists) if dists else None)

    def rollback(self, length: int) -> None:
        self.runner.length = min(self.runner.length, length)


def pick_draft_token(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab: int,
    min_confidence: float,
    dists: list[Tensor],
) -> tuple[int, float]:
    """The draft token from its (vocab,) logits, and the draft's probability of it; at T > 0 the distribution it
    was drawn from goes to `dists` (the acceptance rule needs it). Greedy: the argmax, by argmax_rows (torch's
    argmax over SmolLM2's 49k bf16 logits takes ~180 us, 1/20 of an int4 draft step), its softmax only when
    `min_confidence` asks for it."""
    if params.greedy:
        row = logits.float()  # widened once, for the argmax and the confidence
        token = argmax_rows(row[None])[0]
        return token, float(torch.softmax(row, -1)[token]) if min_confidence else 1.0
    q = draft_distribution(logits, params, vocab)
    token = draw(q, generator)
    dists.append(q)
    return token, float(q[token])


def draft_distribution(logits: Tensor, params: SamplingParams, vocab: int) -> Tensor:
    """What a draft samples its proposal from, over the whole vocabulary: (vocab,) from the logits of its head,
    zero past them where the head holds only the first ids (spec.draft_vocab)."""
    q = probabilities(logits, params)
    return q if q.shape[-1] == vocab else torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


# ---- from config ---------------------------------------------------------------------------------


def build_drafter(
    spec: dict[str, Any],
    model_name: str,
    target: Transformer,
    dtype: torch.dtype,
    device: torch.device,
    gguf_path: Path | None = None,
) -> Drafter | None:
    """The resolved `spec` config group -> a Drafter (None for spec=none or off). `gguf_path`: the target's file,
    whose Q4_1 blocks a spec=self int4 draft imports as they are."""
    name = spec["name"]
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(max_n=int(spec["ngram_max"]), min_n=int(spec["ngram_min"]))
    if name == "draft":
        path = Path(str(spec["draft_model"])).expanduser() if spec.get("draft_model") else default_draft_dir(model_name)
        return ModelDrafter(
            load_draft_model(path, target, dtype, device, build_hint=str(spec["build"])),
            min_confidence=float(spec["min_confidence"]),
        )
    if name == "self":
        return ModelDrafter(
            self_draft(target, str(spec["draft_precision"]), gguf_path, int(spec["draft_vocab"])),
            "self",
            float(spec["min_confidence"]),
            target_kv=True,
            int8_from_rows=int(spec["draft_int8_from_rows"]),
        )
    raise ModelLoadError(f"unknown spec {name!r}: use spec=none (or off), spec=ngram, spec=draft or spec=self")


def load_draft_model(
    path: Path, target: Transformer, dtype: torch.dtype, device: torch.device, build_hint: str = ""
) -> Transformer:
    """A draft checkpoint (HF directory, as inferlab-train writes them) that must share the target's vocabulary."""
    from inferlab.model.loader import load_model

    if not (path / "config.json").is_file():
        hint = f"; build it with {build_hint}" if build_hint else ""
        raise ModelLoadError(f"draft model not found at {path}{hint}")
    draft = load_model({"path": str(path)}, dtype, device, target.config.max_seq_len).model
    if draft.config.vocab_size != target.config.vocab_size:
        raise ModelLoadError(
            f"draft model {path} has vocabulary {draft.config.vocab_size}, "
            f"the target {target.config.vocab_size}: they must share one tokenizer"
        )
    return draft
