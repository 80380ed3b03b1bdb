"""profile: torch.profiler over decode steps; the top operators by self time and their share of the total."""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch.profiler import ProfilerActivity, profile

from inferlab.api import engine_from_config
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import decode_loop, prompt_ids


@register("profile")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    m = cfg.measure
    steps = int(m.profile_steps)
    ids = prompt_ids(cfg, engine, int(m.prompt_tokens))
    warmup = max(int(m.warmup), 1)
    on_cuda = engine.config.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    logits, seq = engine.prefill(ids, reserve_tokens=warmup + steps)
    try:
        _, logits = decode_loop(engine, seq, logits, warmup)  # warm-up outside the profile
        with profile(activities=activities) as prof:
            decode_loop(engine, seq, logits, steps)
    finally:
        seq.release()
    attr = "self_device_time_total" if on_cuda else "self_cpu_time_total"  # microseconds
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [{"op": e.key, "share_pct": 100.0 * getattr(e, attr) / total,
             "self_ms_per_step": getattr(e, attr) / 1e3 / steps, "calls_per_step": e.count / steps,
             "timer": "device" if on_cuda else "cpu", "torch_threads": torch.get_num_threads()}
            for e in events[: int(cfg.study.top_ops)]]
