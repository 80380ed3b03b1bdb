"""threads: batch-1 decode tokens/s and the machine's read bandwidth with 1, 2, ... threads.

A memory-bound decode step speeds up with threads as much as the read bandwidth does; a step limited by
the kernel's arithmetic speeds up as much as there are free cores to compute on. Side by side, per thread
count, in rounds (each round probes the bandwidth and decodes once per thread count; medians over rounds).
"""

from __future__ import annotations

import statistics

import torch
from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.bench.progress import progress
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import decode_rate, inferlab_runner, prompt_ids, read_bandwidth_gb_s


@register("threads")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    m = cfg.measure
    ids = prompt_ids(cfg, engine, int(m.prompt_tokens))
    generate = inferlab_runner(engine)
    all_threads = torch.get_num_threads()
    counts = sorted({1, all_threads} | {t for t in cfg.study.thread_counts if t <= all_threads})

    def one_round() -> dict[int, tuple[float, float]]:
        rates = {}
        for threads in counts:
            torch.set_num_threads(threads)
            bandwidth = read_bandwidth_gb_s(int(m.bandwidth_mb), engine.config.device)
            rates[threads] = bandwidth, decode_rate(generate(ids, int(m.new_tokens)))
        return rates

    try:
        for _ in range(int(m.warmup)):
            one_round()
        rounds = [one_round() for _ in progress(range(int(m.repeats)), f"threads {cfg.precision.name} rounds")]
    finally:
        torch.set_num_threads(all_threads)
    rows = []
    for threads in counts:
        bandwidth = statistics.median(r[threads][0] for r in rounds)
        rate = statistics.median(r[threads][1] for r in rounds)
        rows.append(
            {
                "threads": threads,
                "decode_tok_s": rate,
                "bandwidth_gb_s": bandwidth,
                "prompt_tokens": len(ids),
                "new_tokens": int(m.new_tokens),
            }
        )
    one = rows[0]
    for row in rows:
        row["decode_speedup"] = row["decode_tok_s"] / one["decode_tok_s"]
        row["bandwidth_speedup"] = row["bandwidth_gb_s"] / one["bandwidth_gb_s"]
    return rows
