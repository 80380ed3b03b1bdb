"""kv_memory: KV bytes one request holds, from the calculator and as the engine actually holds them.

A contiguous slot is reserved for the longest sequence; paged blocks grow with the tokens written, so
the measured figure is what the block manager has handed out while the request is alive. How many such
requests the whole pool holds at once shows what a smaller KV element buys in the same budget (int8 KV:
codes plus one fp32 scale per row).
"""

from __future__ import annotations

from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import prompt_ids
from inferlab.engine.kv_cache import compute_kv_cache_bytes

MIB = 2**20


@register("kv_memory")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    kv_dtype = str(engine.config.cache_dtype).removeprefix("torch.")
    rows = []
    for tokens in sorted(int(n) for n in cfg.study.request_tokens):
        ids = prompt_ids(cfg, engine, tokens)
        _, sequence = engine.prefill(ids)
        try:
            stats = engine.stats()
        finally:
            sequence.release()
        held = stats["kv_blocks_used"] * stats["kv_bytes_per_block"]
        calculated = compute_kv_cache_bytes(engine.loaded.config, 1, tokens, engine.config.cache_dtype)
        rows.append(
            {
                "kv_dtype": kv_dtype,
                "request_tokens": tokens,
                "calculated_mb": calculated / MIB,
                "held_mb": held / MIB,
                "held_over_calculated": held / calculated,
                "pool_mb": stats["kv_blocks_total"] * stats["kv_bytes_per_block"] / MIB,
                "pool_blocks": stats["kv_blocks_total"],
                "requests_in_pool": stats["kv_blocks_total"] // stats["kv_blocks_used"],
            }
        )
    return rows
