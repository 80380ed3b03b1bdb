"""KV memory as fixed-size blocks: allocate, free, reference counts, and reuse of cached prefix blocks.

The allocator only does bookkeeping (block ids, counts); the tensors live in `PagedKVCache`. Freed
blocks go back on a LIFO free list, or, when the prefix cache knows them, to its LRU where a later
request can still find them. Shared prefix blocks are referenced, never copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferlab.engine.kv.prefix_cache import PrefixCache, chain_hash
from inferlab.errors import CapacityError


@dataclass(eq=False)
class BlockTable:
    """Where one sequence's KV lives: its blocks in order, and how many of its tokens they hold."""

    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # prefix-cache keys of its leading full blocks
    num_computed: int = 0  # tokens whose KV is written
    num_cached: int = 0  # of those, found in the prefix cache at allocation


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        block_bytes: int,
        prefix_cache: PrefixCache | None = None,
        free_ids: list[int] | None = None,
    ) -> None:
        """`free_ids`, when given, is shared with another allocator of the same blocks (the contiguous SlotPool)."""
        if num_blocks < 1:
            raise CapacityError(f"the KV budget holds no block of {block_size} tokens; raise cache.kv_budget_mb")
        self.num_blocks, self.block_size, self.block_bytes = num_blocks, block_size, block_bytes
        self.prefix = prefix_cache
        self.free_ids = free_ids if free_ids is not None else list(range(num_blocks))[::-1]
        self.ref_counts = [0] * num_blocks
        self.tokens_computed = 0  # every token whose KV was written: what prefill skipping saves shows here

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def check_fits(self, n_tokens: int) -> None:
        """Refuse, once and clearly, a sequence the whole pool could never hold."""
        need = self.blocks_for(n_tokens)
        if need > self.num_blocks:
            raise CapacityError(
                f"request needs KV for {n_tokens} tokens ({need * self.block_bytes / 2**20:.1f} MiB) but the whole "
                f"pool holds {self.num_blocks * self.block_size} tokens ({self.num_blocks * self.block_bytes / 2**20:.1f}"
                f" MiB); shorten the prompt or max_new_tokens, or raise cache.kv_budget_mb"
            )

    def can_allocate(self, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) <= self.num_free

    def allocate(self, table: BlockTable, token_ids: list[int], n_tokens: int, reuse: bool = True) -> bool:
        """Blocks for `n_tokens` positions of a sequence starting with `token_ids`, prefix blocks reused
        unless `reuse` is off (a prompt whose every position's logits are wanted).

        At least the last token is always computed (its logits are needed), so a fully cached prompt
        still leaves its final block to recompute. False (and nothing held) when the pool is short.
        """
        assert not table.blocks, "allocate a table once; free it first"
        if self.prefix is not None and reuse:
            full = (len(token_ids) - 1) // self.block_size
            parent = None
            for i in range(full):
                ids = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                key = chain_hash(parent, ids)
                block = self.prefix.lookup(key, ids)
                if block is None:
                    self.prefix.misses += full - i - 1  # the chain is broken: the rest cannot hit either
                    break
                self._ref(block)
                table.blocks.append(block)
                table.keys.append(key)
                parent = key
        table.num_computed = table.num_cached = len(table.blocks) * self.block_size
        if not self.ensure_room(table, n_tokens):
            self.free(table)
            return False
        return True

    def ensure_room(self, table: BlockTable, n_tokens: int) -> bool:
        """Grow the table to hold `n_tokens` positions; False when the pool has no block left."""
        while len(table.blocks) * self.block_size < n_tokens:
            block = self.free_ids.pop() if self.free_ids else (self.prefix.evict() if self.prefix else None)
            if block is None:
                return False
            self.ref_counts[block] = 1
            table.blocks.append(block)
        return True

    def advance(self, table: BlockTable, token_ids: list[int], n: int) -> None:
        """`n` more tokens of `token_ids` have their KV written: count them, make newly full blocks findable."""
        table.num_computed += n
        self.tokens_computed += n
        if self.prefix is None:
            return
        parent = table.keys[-1] if table.keys else None
        for i in range(len(table.keys), table.num_computed // self.block_size):
            ids = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = chain_hash(parent, ids)
            self.prefix.register(table.blocks[i], parent, ids)
            table.keys.append(parent)

    def trim(self, table: BlockTable, n_tokens: int) -> None:
        """Give back the tail blocks past room for `n_tokens` positions (what rejected draft tokens used);
        they hold no computed token, so none is in the prefix cache."""
        keep = max(self.blocks_for(n_tokens), self.blocks_for(table.num_computed))
        for block in reversed(table.blocks[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids.append(block)
        del table.blocks[keep:]

    def free(self, table: BlockTable) -> None:
        """Drop the table's references; the tail goes first so the LRU evicts tails before shared heads."""
        for block in reversed(table.blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0 and not (self.prefix and self.prefix.park(block)):
                self.free_ids.append(block)
        table.blocks, table.keys, table.num_computed, table.num_cached = [], [], 0, 0

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0 and self.prefix:
            self.prefix.unpark(block)
        self.ref_counts[block] += 1
