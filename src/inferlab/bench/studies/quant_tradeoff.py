"""quant_tradeoff: for this job's precision, weight MB, resident memory (peak while loading, after loading, after
generating), generation tokens/s per batch size
and strided-window perplexity on held-out Shakespeare. Each job measures in a process of its own, so a multirun's
memory columns are each precision's alone."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.bench.perplexity import evaluate_perplexity
from inferlab.bench.progress import progress
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import in_fresh_process, median_of, prompt_ids
from inferlab.engine.engine import InferenceEngine
from inferlab.quant.apply import weight_bytes
from inferlab.train.corpus import load_tokens


@register("quant_tradeoff")
def run(cfg: DictConfig) -> Rows:
    return in_fresh_process(measure, cfg)


def measure(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    m = cfg.measure
    ids = prompt_ids(cfg, engine, int(m.prompt_tokens))
    held_out = load_tokens(engine.tokenizer, "shakespeare", "val", max_tokens=int(m.perplexity_tokens))
    common = {
        "weight_mb": weight_bytes(engine.model) / 2**20,
        "load_peak_rss_mb": engine.load_stats["load_peak_rss_mb"],
        "load_rss_mb": engine.load_stats["load_rss_mb"],
        "perplexity": evaluate_perplexity(engine.model, held_out, int(m.perplexity_window), int(m.perplexity_stride)),
    }
    rows = []
    runs = progress(
        desc=f"quant_tradeoff {cfg.precision.name} generations",
        total=len(cfg.study.batch_sizes) * (int(m.warmup) + int(m.repeats)),
    )

    def timed(batch: int) -> float:
        rate = generation_rate(engine, [ids] * batch, int(m.new_tokens))
        runs.update()
        return rate

    with runs:
        for batch in cfg.study.batch_sizes:
            rate = median_of(lambda: timed(int(batch)), int(m.warmup), int(m.repeats))
            rows.append({"batch_size": int(batch), "gen_tok_s": rate, "rss_mb": resident_mb(), **common})
    return rows


def generation_rate(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tokens per wall second for the batch (prefill included), greedy."""
    start = time.perf_counter()
    if len(prompts) == 1:
        done = [engine.generate(prompts[0], max_new_tokens=new_tokens, temperature=0.0)]
    else:
        done = engine.generate_batch(prompts, max_new_tokens=new_tokens)
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)


def resident_mb() -> float:
    """This process's resident memory now (Linux /proc), after loading and generating."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20
