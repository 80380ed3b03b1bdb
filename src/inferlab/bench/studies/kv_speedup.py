"""kv_speedup: decode tokens/s at growing context lengths, for this job's cache mode (none or contiguous)."""

from __future__ import annotations

from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.bench.progress import progress
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import decode_times, median_rate, prompt_ids


@register("kv_speedup")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    m = cfg.measure
    lengths = sorted(int(n) for n in m.context_lens)
    ids = prompt_ids(cfg, engine, lengths[-1])
    rows = []
    for n in progress(lengths, f"kv_speedup cache={cfg.cache.mode}"):
        times = decode_times(engine, ids[:n], int(m.warmup) + int(m.decode_steps))
        rows.append({"context_len": n, "decode_tok_s": median_rate(times, int(m.warmup))})
    return rows
