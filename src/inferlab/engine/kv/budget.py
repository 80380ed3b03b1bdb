"""How large the KV pool is: the tokens a user names, the MiB a user names, or by default a share of the memory
still available once the weights are in place (the way vLLM takes a share of an accelerator's memory and llama.cpp a
context of the model's length), never more than every running sequence at the longest context could use.

The pool's pages are committed as blocks are first written (kernels/huge_pages.py), so a generous pool costs
memory only as far as sequences and the prefix cache fill it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from inferlab.errors import InvalidRequestError

CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


@dataclass(frozen=True)
class KVPool:
    tokens: int  # positions the pool holds, over all sequences
    mib: float
    why: str  # how it was sized, for the startup line

    def describe(self) -> str:
        return f"KV pool of {self.tokens:,} tokens ({self.mib:,.0f} MiB: {self.why})"


def memory_available_mib() -> float:
    """What this process could still take: the system's available memory, or less where a cgroup limits it."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max" (v2) or a huge number (v1): unlimited
            available = min(available, max(0, int(limit) - usage))
        break
    return available / 2**20


def size_kv_pool(
    token_bytes: int,
    block_size: int,
    kv_tokens: int | None,
    kv_budget_mb: float | None,
    memory_share: float,
    max_tokens: int,
) -> KVPool:
    """The pool for KV rows of `token_bytes` a position (all layers, keys and values): `kv_tokens`, else
    `kv_budget_mb`, else `memory_share` of the memory available now, at most `max_tokens` (every running sequence
    at the longest context); whole blocks, at least one."""
    if kv_tokens is not None and kv_budget_mb is not None:
        raise InvalidRequestError("set cache.kv_tokens or cache.kv_budget_mb, not both")
    if kv_tokens is not None:
        if kv_tokens < 1:
            raise InvalidRequestError(f"cache.kv_tokens must be >= 1 (got {kv_tokens})")
        blocks = -(-kv_tokens // block_size)
        return KVPool(blocks * block_size, blocks * block_size * token_bytes / 2**20, "cache.kv_tokens")
    if kv_budget_mb is not None:
        if kv_budget_mb <= 0:
            raise InvalidRequestError(f"cache.kv_budget_mb must be > 0 (got {kv_budget_mb})")
        tokens, why = int(kv_budget_mb * 2**20) // token_bytes, "cache.kv_budget_mb"
    else:
        if not 0 < memory_share <= 1:
            raise InvalidRequestError(f"cache.kv_memory_share must be in (0, 1] (got {memory_share})")
        available = memory_available_mib()
        tokens = int(memory_share * available * 2**20) // token_bytes
        why = f"{memory_share:.0%} of the {available:,.0f} MiB available after the weights"
        if tokens > max_tokens:
            tokens, why = max_tokens, f"every running sequence at the full context; {why} would hold more"
    blocks = max(1, tokens // block_size)
    return KVPool(blocks * block_size, blocks * block_size * token_bytes / 2**20, why)
