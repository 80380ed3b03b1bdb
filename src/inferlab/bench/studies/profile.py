"""profile: torch.profiler over decode steps of 1 and of more sequences decoding together (`study.sequences`);
the top operators by self time and their share of the total.

The fused step's phases (decode_step.cpp names one profiler range per phase) also get the rate at which
they streamed their weights, as a share of the read bandwidth the step's working set gets (below): how far each
matrix-vector product is from the memory limit, phase by phase. A step of B sequences is one flat forward
of B rows, as the engine loop runs it (engine/single.py: forward_together); against the one-sequence step
of the same job, `vs_one_sequence` is what each phase's step costs more, and `speedup_ceiling` = B x the
one-sequence step's ms over the B-sequence step's: the most tokens/s that B streams decoding together can
bring over one stream on this machine, whatever the server around the step does.

What memory allows each step: its working set (the weights its phases read and its sequences' KV, at their mean
length over the profiled steps) and the read bandwidth over a buffer of that size (a set that fits the last-level
cache reads much faster than one that does not), hence `memory_floor_ms`, the step's ms at that bandwidth, and
`memory_ceiling` = B x the one-sequence floor over the B-sequence floor: what B streams could bring over one if
every step ran at the pace of the memory its working set lives in."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from inferlab.api import engine_from_config
from inferlab.bench.studies import Rows, StudyUnavailable, register
from inferlab.bench.studies.common import decode_loop, prompt_ids, read_bandwidth_gb_s, sync
from inferlab.engine.engine import InferenceEngine
from inferlab.engine.kv_cache import compute_kv_cache_bytes
from inferlab.engine.sampling import argmax_rows
from inferlab.engine.single import PagedSequence, Sequence, forward_together
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
    sequences = sorted(int(b) for b in cfg.study.sequences)
    if max(sequences) > 1 and engine.config.cache_mode != "paged":
        raise StudyUnavailable("several sequences decode together on the paged cache: use cache=paged")
    rows: Rows = []
    one_sequence: dict[str, float] = {}  # op -> its ms per step with one sequence (and "" -> the whole step's)
    one_floor_ms = 0.0  # the one-sequence step's memory floor
    for batch in sequences:
        prof, steps = profile_steps(cfg, engine, batch)
        memory = memory_floor(cfg, engine, batch)
        ops, step_ms = profile_rows(cfg, engine, prof, steps, memory["working_set_gb_s"])
        if batch == 1:
            one_sequence = {row["op"]: row["self_ms_per_step"] for row in ops} | {"": step_ms}
            one_floor_ms = memory["memory_floor_ms"]
        for row in ops:
            row |= {"sequences": batch, "step_ms": step_ms, **memory}
            if one_sequence:
                row["speedup_ceiling"] = batch * one_sequence[""] / step_ms
                row["memory_ceiling"] = batch * one_floor_ms / memory["memory_floor_ms"]
                if row["op"] in one_sequence:
                    row["vs_one_sequence"] = row["self_ms_per_step"] / one_sequence[row["op"]]
        rows += ops
    return rows


def memory_floor(cfg: DictConfig, engine: InferenceEngine, batch: int) -> dict[str, float]:
    """A step of `batch` sequences' working set (its phases' weights and the sequences' KV at their mean length over
    the profiled steps), the read bandwidth over a buffer of that size, and the step's ms at that bandwidth."""
    m = cfg.measure
    mean_length = int(m.prompt_tokens) + max(int(m.warmup), 1) + (int(m.profile_steps) + 1) // 2
    kv = compute_kv_cache_bytes(engine.model.config, batch, mean_length, engine.config.cache_dtype)
    working_set = sum(phase_weight_bytes(engine.model).values()) + kv
    bandwidth = read_bandwidth_gb_s(working_set / 2**20, engine.config.device)
    return {
        "working_set_mb": working_set / 2**20,
        "working_set_gb_s": bandwidth,
        "memory_floor_ms": working_set / bandwidth / 1e6,
    }


def profile_steps(cfg: DictConfig, engine: InferenceEngine, batch: int) -> tuple[profile, int]:
    """torch.profiler over `measure.profile_steps` greedy decode steps of `batch` sequences together (each after its
    own prompt of `measure.prompt_tokens`, after `measure.warmup` steps outside the profile)."""
    m = cfg.measure
    steps, warmup = int(m.profile_steps), max(int(m.warmup), 1)
    on_cuda = engine.config.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    seqs: list[Sequence] = []
    logits: list[Tensor] = []
    try:
        for b in range(batch):  # prompts of their own: nothing shared through the prefix cache
            first, seq = engine.prefill(prompt_ids(cfg, engine, int(m.prompt_tokens), seed=b), warmup + steps)
            seqs.append(seq)
            logits.append(first)
        if batch == 1:
            _, last = decode_loop(engine, seqs[0], logits[0], warmup)  # warm-up outside the profile
            with profile(activities=activities) as prof:
                decode_loop(engine, seqs[0], last, steps)
        else:
            paged = [seq for seq in seqs if isinstance(seq, PagedSequence)]  # all of them: cache=paged
            together = decode_together(engine, paged, torch.stack(logits), warmup)
            with profile(activities=activities) as prof:
                decode_together(engine, paged, together, steps)
    finally:
        for seq in seqs:
            seq.release()
    return prof, steps


def decode_together(engine: InferenceEngine, seqs: list[PagedSequence], logits: Tensor, steps: int) -> Tensor:
    """`steps` greedy decode steps of every sequence of `seqs` in one forward each, from their `logits` (B, vocab);
    the last logits."""
    for _ in range(steps):
        logits = forward_together(seqs, [[token] for token in argmax_rows(logits)])
        sync(engine.config.device)
    return logits


def profile_rows(
    cfg: DictConfig, engine: InferenceEngine, prof: profile, steps: int, working_set_gb_s: float
) -> tuple[Rows, float]:
    """The `study.top_ops` operators by self time, each with its ms per step (and, for the fused step's phases, the
    rate at which it streamed its weights, and that as a share of `working_set_gb_s`, the read bandwidth of the
    step's working set); the memory's bandwidth probed now beside them; and the whole step's ms."""
    bandwidth = read_bandwidth_gb_s(int(cfg.measure.bandwidth_mb), engine.config.device)
    weight_bytes = phase_weight_bytes(engine.model)
    on_cuda = engine.config.device.type == "cuda"
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
            row["pct_bandwidth"] = 100.0 * row["weights_gb_s"] / working_set_gb_s
        rows.append(row)
    return rows, total / 1e3 / steps
