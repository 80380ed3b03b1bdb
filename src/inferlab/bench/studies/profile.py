"""profile: torch.profiler over decode steps; the top operators by self time and their share of the total.

The fused step's phases (decode_step.cpp names one profiler range per phase) also get the rate at which
they streamed their weights, next to the machine's read bandwidth probed right after: how far each
matrix-vector product is from the memory limit, phase by phase."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch.profiler import ProfilerActivity, profile

from inferlab.api import engine_from_config
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import decode_loop, prompt_ids, read_bandwidth_gb_s
from inferlab.model.transformer import Transformer
from inferlab.quant.apply import module_bytes

# phase range -> the projection of every layer whose weights the phase reads
LAYER_PHASES = {
    "decode_step: norm+wqkv": ("attention", "wqkv"),
    "decode_step: wo+residual": ("attention", "wo"),
    "decode_step: norm+w13": ("feed_forward", "w13"),
    "decode_step: swiglu+w2+residual": ("feed_forward", "w2"),
}


def phase_weight_bytes(model: Transformer) -> dict[str, int]:
    """Bytes of weights (with their scales, mins and biases) each phase of one decode step reads."""
    phases = {
        phase: sum(module_bytes(getattr(getattr(layer, block), name)) for layer in model.layers)
        for phase, (block, name) in LAYER_PHASES.items()
    }
    phases["decode_step: norm+lm_head"] = module_bytes(model.output)
    return phases


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
    bandwidth = read_bandwidth_gb_s(int(m.bandwidth_mb), engine.config.device)
    weight_bytes = phase_weight_bytes(engine.model)
    attr = "self_device_time_total" if on_cuda else "self_cpu_time_total"  # microseconds
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    rows = []
    for e in events[: int(cfg.study.top_ops)]:
        seconds_per_step = getattr(e, attr) / 1e6 / steps
        row = {
            "op": e.key,
            "share_pct": 100.0 * getattr(e, attr) / total,
            "self_ms_per_step": seconds_per_step * 1e3,
            "calls_per_step": e.count / steps,
            "bandwidth_gb_s": bandwidth,
            "timer": "device" if on_cuda else "cpu",
            "torch_threads": torch.get_num_threads(),
        }
        if e.key in weight_bytes:
            row["weights_gb_s"] = weight_bytes[e.key] / seconds_per_step / 1e9
            row["pct_bandwidth"] = 100.0 * row["weights_gb_s"] / bandwidth
        rows.append(row)
    return rows
