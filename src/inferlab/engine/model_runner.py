"""The model runner: every forward that writes KV and returns logits, over the paged pool or one contiguous slot.

The flat forward (`forward_flat`) is vLLM V1's shape of a step: every running sequence's decode token and other
sequences' prompt chunks are the N rows of one batch, each row with its own position and its sequence's block
table. Every linear layer is then one matrix product over all N rows; attention writes every row's k/v at its
block and offset first, then attends each sequence's rows over that sequence's keys, causally from its own start.
The fused C++ step takes the same rows (each row attends over its table up to its position, after every row's k/v
is written), so decode rows and prompt chunks mix in one call either way. The engine loop's steps, the batched
draft steps of speculation and the reference path's paged sequences all run through it.

`SlotRunner` is the one forward of a sequence held in a slot of the contiguous cache: the reference path's
contiguous sequences, and each sequence that needs a KV cache of its own outside any pool (a draft model's when
one request speculates alone, the target of `speculative_generate`, the load-time timing of steps).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from inferlab.engine.kv.contiguous import CachedAttend, KVCache
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.engine.runtime.step_stats import StepStats
from inferlab.kernels.attention import decode_attention
from inferlab.kernels.fused_decode import FusedDecode
from inferlab.model.transformer import PLAIN, AttentionSpan, Transformer, attend_over


@dataclass
class Segment:
    """One sequence's rows in a step: `tokens` at positions start.., its KV in `blocks`.

    The logits of its last `n_logits` rows are wanted: 0 for a prompt chunk with more to come, 1 for
    the next token, all of them for a prompt whose log-probabilities are asked.
    """

    tokens: list[int]
    start: int
    blocks: list[int]
    n_logits: int = 1


@dataclass
class FlatBatch:
    """S sequences' new tokens as N rows."""

    tokens: Tensor  # (N,) int64
    positions: Tensor  # (N,) int64, each row's position in its sequence
    block_tables: Tensor  # (S, width) int64, each sequence's blocks, padded with its first
    query_lens: list[int]  # (S,) rows of each sequence, in order
    logit_rows: Tensor  # (R,) int64, the rows whose logits a forward returns, in order

    @classmethod
    def pack(cls, segments: list[Segment], device: torch.device) -> FlatBatch:
        width = max(len(s.blocks) for s in segments)
        tables = [s.blocks + [s.blocks[0]] * (width - len(s.blocks)) for s in segments]
        positions = [p for s in segments for p in range(s.start, s.start + len(s.tokens))]
        ends = list(itertools.accumulate(len(s.tokens) for s in segments))
        rows = [r for s, end in zip(segments, ends) for r in range(end - s.n_logits, end)]
        return cls(
            torch.tensor([t for s in segments for t in s.tokens], device=device),
            torch.tensor(positions, device=device),
            torch.tensor(tables, device=device),
            [len(s.tokens) for s in segments],
            torch.tensor(rows, dtype=torch.long, device=device),
        )

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def row_tables(self) -> Tensor:
        """Each row's block table: (N, width). Indexed, not `repeat_interleave`d: that one starts a parallel region
        for any size, which on a busy machine waits for a core another process holds."""
        if len(self.query_lens) == self.num_rows:  # one row per sequence (a decode step): the tables themselves
            return self.block_tables
        sequence_of_row = [s for s, n in enumerate(self.query_lens) for _ in range(n)]
        return self.block_tables[torch.tensor(sequence_of_row, device=self.block_tables.device)]


def gather_keys(pool: Tensor, tables: Tensor, length: int) -> Tensor:
    """Positions 0..length-1 of each table's sequence, in order: pool (num_blocks, H, bs, D),
    tables (B, width) -> (B, H, length, D); an int8 cache's scales (num_blocks, H, bs) -> (B, H, length)."""
    bs = pool.shape[2]
    if length <= bs:  # one block (always, on the contiguous cache): slice it instead of copying the whole block
        return pool[tables[:, 0], :, :length]
    blocks = pool[tables[:, : -(-length // bs)]]  # (B, nb, H, bs, ...)
    B, nb, H = blocks.shape[:3]
    return blocks.transpose(1, 2).reshape(B, H, nb * bs, *blocks.shape[4:])[:, :, :length]


class FlatAttend:
    """The `attend` for one flat batch (the model runs it as tokens (1, N)).

    Single-row sequences (decodes) attend together: through kernels.decode_attention where the cache
    takes it and the layer's span is plain (the kernel writes their k/v itself), else over their
    gathered keys with a per-row mask. Each longer sequence (a prompt chunk) attends over its own
    gathered keys, causally from its start.
    """

    def __init__(self, cache: PagedKVCache, batch: FlatBatch, stats: StepStats | None = None) -> None:
        self.cache, self.batch, self.stats = cache, batch, stats
        bs, device = cache.block_size, batch.tokens.device
        self.write_blocks = batch.row_tables().gather(1, (batch.positions // bs)[:, None])[:, 0]  # (N,)
        self.write_offsets = batch.positions % bs  # (N,)
        starts = [0, *itertools.accumulate(batch.query_lens)][:-1]
        single = [s for s, n in enumerate(batch.query_lens) if n == 1]
        self.single_rows = torch.tensor([starts[s] for s in single], dtype=torch.long, device=device)
        self.single_tables = batch.block_tables[single]  # (B, width)
        self.single_positions = batch.positions[self.single_rows]  # (B,)
        self.single_length = int(self.single_positions.max()) + 1 if single else 0
        # each prompt chunk: its rows, its table (1, width), and how many keys it sees (its last position + 1)
        self.chunks = [
            (
                slice(starts[s], starts[s] + n),
                batch.block_tables[s : s + 1],
                int(batch.positions[starts[s] + n - 1]) + 1,
            )
            for s, n in enumerate(batch.query_lens)
            if n > 1
        ]
        chunk_rows = [r for rows, _, _ in self.chunks for r in range(rows.start, rows.stop)]
        self.chunk_rows = torch.tensor(chunk_rows, dtype=torch.long, device=device)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan = PLAIN) -> Tensor:
        # q: (1, H, N, D); k, v: (1, H_kv, N, D) -> (1, H, N, D)
        if self.stats is None:
            return self._attend(layer_idx, q, k, v, span)
        with self.stats.timed("attention"):
            return self._attend(layer_idx, q, k, v, span)

    def _attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan) -> Tensor:
        kernel = self.cache.decode_kernel and span.plain and self.single_length > 0
        self._write(layer_idx, k, v, self.chunk_rows if kernel else None)
        if not self.chunks:
            return self._attend_single(layer_idx, q, k, v, span, kernel)
        out = torch.empty_like(q)
        if self.single_length:
            out[0, :, self.single_rows] = self._attend_single(layer_idx, q, k, v, span, kernel)[0]
        for rows, table, length in self.chunks:
            keys, values = self.cache.read(
                layer_idx, functools.partial(gather_keys, tables=table, length=length), q.dtype
            )
            out[:, :, rows] = attend_over(q[:, :, rows], keys, values, self.batch.positions[rows], span)
        return out

    def _write(self, layer_idx: int, k: Tensor, v: Tensor, rows: Tensor | None) -> None:
        """Every row's k/v (or those of `rows`) at its block and offset."""
        blocks, offsets = self.write_blocks, self.write_offsets
        k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, H_kv, D)
        if rows is not None:
            if not rows.numel():
                return
            blocks, offsets, k, v = blocks[rows], offsets[rows], k[rows], v[rows]
        self.cache.write(layer_idx, blocks, offsets, k, v)

    def _attend_single(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, span: AttentionSpan, kernel: bool
    ) -> Tensor:
        """The single-row sequences' attention: (1, H, B, D)."""
        rows = self.single_rows
        q1 = q[0, :, rows].transpose(0, 1).unsqueeze(2)  # (B, H, 1, D)
        cache = self.cache
        if kernel:
            k1, v1 = (t[0, :, rows].transpose(0, 1).unsqueeze(2) for t in (k, v))
            k_pool, v_pool = cache.k[layer_idx], cache.v[layer_idx]  # (num_blocks, H_kv, bs, D)
            tables, positions = self.single_tables, self.single_positions
            out = decode_attention(q1, k1, v1, k_pool, v_pool, tables, positions, *cache.scales(layer_idx))
        else:
            gather = functools.partial(gather_keys, tables=self.single_tables, length=self.single_length)
            keys, values = cache.read(layer_idx, gather, q.dtype)
            out = attend_over(q1, keys, values, self.single_positions[:, None], span)
        return out[:, :, 0].transpose(0, 1).unsqueeze(0)


def runs_fused(fused: FusedDecode | None, batch: FlatBatch) -> bool:
    """Whether `forward_flat` runs `batch` as one C++ call: the engine built a fused step covering its rows."""
    return fused is not None and fused.covers(batch.num_rows, len(batch.query_lens))


def forward_flat(
    model: Transformer,
    cache: PagedKVCache,
    batch: FlatBatch,
    fused: FusedDecode | None = None,
    stats: StepStats | None = None,
) -> Tensor:
    """Run every row of `batch` in one forward, writing its KV; the logits of `batch.logit_rows` (R, vocab).

    Through the `fused` C++ step where the engine built one and it covers this many rows, else the model
    (its attention timed into `stats`). `logit_rows` may be empty (a step of prompt chunks with more to
    come): then the result is (0, vocab).
    """
    if runs_fused(fused, batch):
        k_scales, v_scales = cache.scales()
        tables, positions = batch.row_tables(), batch.positions
        return fused(batch.tokens, cache.k, cache.v, tables, positions, k_scales, v_scales, batch.logit_rows)
    attend = FlatAttend(cache, batch, stats)
    return model(batch.tokens[None], batch.positions[None], attend, rows=batch.logit_rows)[0]


def forward_paged(
    model: Transformer,
    cache: PagedKVCache,
    new_tokens: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    fused: FusedDecode | None = None,
) -> Tensor:
    """B sequences, each feeding its new tokens after its `starts` cached ones, in one flat forward: each one's
    last logits (B, vocab)."""
    segments = [Segment(t, s, b) for t, s, b in zip(new_tokens, starts, block_tables)]
    return forward_flat(model, cache, FlatBatch.pack(segments, cache.k.device), fused)


class SlotRunner:
    """One sequence's forwards over one slot of a contiguous KVCache: the KV of new tokens written at `length` on.

    Rollback = lowering `length`: entries past it are stale and the next forward overwrites them; nothing is copied.
    With `fused` (a C++ step of the model), forwards of as many tokens as it covers run as one call of it.
    """

    def __init__(self, model: Transformer, cache: KVCache, slot: int = 0, fused: FusedDecode | None = None) -> None:
        self.model, self.cache, self.slot, self.fused = model, cache, slot, fused
        self.device = cache.k.device
        self.length = 0  # tokens whose KV is valid
        self.block_table = torch.tensor([[slot]], device=self.device)  # the slot is one max_seq_len block

    @classmethod
    def alone(cls, model: Transformer, capacity: int, fused: FusedDecode | None = None) -> SlotRunner:
        """A runner over a one-slot cache of its own, `capacity` tokens long, in the model's dtype."""
        if capacity > model.config.max_seq_len:
            raise ValueError(f"sequence of {capacity} tokens exceeds the model's context {model.config.max_seq_len}")
        device, dtype = model.rope_cos.device, model.rope_cos.dtype
        return cls(model, KVCache(model.config, 1, capacity, dtype, device), 0, fused)

    def forward(self, token_ids: list[int], last_only: bool = False) -> Tensor:
        """Append `token_ids` at `length`; logits (T, vocab), or (1, vocab) with `last_only` (the Python model then
        runs the head on that row alone)."""
        logits = self._write(token_ids, last_only)
        self.length += len(token_ids)
        return logits

    def verify_rows(self, token_ids: list[int]) -> Tensor:
        """As a speculative target (spec/session.py's TargetSequence): every row's logits, none kept until `keep`."""
        return self._write(token_ids, last_only=False)

    def keep(self, n: int) -> None:
        self.length += n

    @torch.inference_mode()
    def _write(self, token_ids: list[int], last_only: bool) -> Tensor:
        """The KV of `token_ids` written at `length`..; their logits."""
        n = len(token_ids)
        if self.fused is not None and self.fused.covers(n):
            return self.fused.extend(token_ids, self.cache.k, self.cache.v, self.block_table, self.length, last_only)
        tokens = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(self.length, self.length + n, device=self.device).unsqueeze(0)
        attend = CachedAttend(self.cache, self.length, n, slice(self.slot, self.slot + 1))
        return self.model(tokens, positions, attend, last_only=last_only)[0]
