"""Block-level prefix cache: full KV blocks found again by a chained hash of the tokens they hold.

A block's key is hash(parent block's key, this block's token ids), so a key names the whole prefix up
to the end of the block; a hit is confirmed by comparing the ids (a hash collision can never hand out
another prompt's KV). Cached blocks that no sequence references stay in the pool, oldest-unused first
in an LRU, until the allocator needs their memory: reuse costs nothing, eviction is lazy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


@dataclass
class PrefixCache:
    by_hash: dict[int, int] = field(default_factory=dict)  # key -> block id
    entries: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # block id -> (key, ids)
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # unreferenced cached blocks, oldest first
    hits: int = 0  # full prompt blocks found cached
    misses: int = 0  # full prompt blocks that had to be computed
    evictions: int = 0  # cached blocks whose memory was taken for new tokens

    def lookup(self, key: int, token_ids: tuple[int, ...]) -> int | None:
        block = self.by_hash.get(key)
        if block is not None and self.entries[block][1] == token_ids:
            self.hits += 1
            return block
        self.misses += 1
        return None

    def register(self, block: int, key: int, token_ids: tuple[int, ...]) -> None:
        """Make a full, computed block findable; a prefix already cached in another block keeps that one."""
        if key not in self.by_hash and block not in self.entries:
            self.by_hash[key] = block
            self.entries[block] = (key, token_ids)

    def park(self, block: int) -> bool:
        """The last reference to `block` went away: keep it for reuse if it is cached (then True)."""
        if block in self.entries:
            self.lru[block] = None
            return True
        return False

    def unpark(self, block: int) -> None:
        """A hit on an unreferenced block: it is in use again, no longer evictable."""
        self.lru.pop(block, None)

    def evict(self) -> int | None:
        """Forget the least recently used unreferenced block and hand its memory back (None if none)."""
        if not self.lru:
            return None
        block, _ = self.lru.popitem(last=False)
        key, _ = self.entries.pop(block)
        del self.by_hash[key]
        self.evictions += 1
        return block

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    @property
    def num_cached(self) -> int:
        return len(self.entries)
