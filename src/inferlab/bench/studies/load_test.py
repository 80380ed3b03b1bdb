"""batching, server_latency, prefix_cache: the load generator against the job's target, one row of metrics.

The three differ only in what their sweeps vary (concurrency, target=server, cache.prefix), so they share
this one measurement.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from inferlab.bench.loadgen import LoadSpec, measure
from inferlab.bench.prompts import load_tokenizer, make_prompts
from inferlab.bench.studies import Rows, register
from inferlab.bench.targets import open_job_target

STAT_KEYS = ("prefix_cache_hits", "prefix_cache_misses", "kv_blocks_total")


@register("batching", "server_latency", "prefix_cache")
def run(cfg: DictConfig) -> Rows:
    load = OmegaConf.to_container(cfg.load, resolve=True)
    prompts = make_prompts(load_tokenizer(OmegaConf.to_container(cfg.model, resolve=True)), load, seed=cfg.seed or 0)
    spec = LoadSpec(int(load["concurrency"]), float(load["rate"]), cfg.seed or 0, progress=True)
    with open_job_target(cfg, int(load["output_tokens"])) as target:
        metrics = measure(target, prompts, spec, warmup=int(cfg.measure.warmup))
        stats = target.stats()
    return [
        {
            "concurrency": spec.concurrency,
            "rate": None if math.isinf(spec.rate) else spec.rate,
            "dataset": load["dataset"],
            "prefix": str(cfg.cache.prefix).lower(),
            **metrics,
            **{k: stats[k] for k in STAT_KEYS if k in stats},
        }
    ]
