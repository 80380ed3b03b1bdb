"""profile: torch.profiler over decode steps of 1 and of more sequences decoding together (`study.sequences`);
the top operators by self time and their share of the total.

The fused step's phases (decode_step.cpp names one profiler range per phase) also get the rate at which
they streamed their weights, as a share of the read bandwidth the step's working set gets (below): how far each
matrix-vector product is from the memory limit, phase by phase. A step of B sequences is one flat forward
of B rows, as the engine loop runs it (engine/reference/single.py: forward_together); against the one-sequence step
of the same job, `vs_one_sequence` is what each phase's step costs more, and `speedup_ceiling` = B x the
one-sequence step's ms over the B-sequence step's: the most tokens/s that B streams decoding together can
bring over one stream on this machine, whatever the server around the step does. Each step's ms is the median of
timed steps outside the profiler, every batch size's in runs alternating with the others' (a burst of other load on
a shared machine would otherwise land on one size only), each run's first RUN_SETTLE steps untimed: the other
size's working set has just passed through the caches (here a one-sequence int4 step runs from a last-level cache
that a 16-sequence step overflows).

What memory allows each step: its working set (the weights its phases read and its sequences' KV, at their mean
length over the timed and profiled steps) and the read bandwidth over a buffer of that size (a set that fits the
last-level cache reads much faster than one that does not), hence `memory_floor_ms`, the step's ms at that
bandwidth, and `memory_ceiling` = B x the one-sequence floor over the B-sequence floor: what B streams could bring
over one if every step ran at the pace of the memory its working set lives in."""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function

from inferlab.api import engine_from_config
from inferlab.bench.studies import Rows, StudyUnavailable, register
from inferlab.bench.studies.common import file_format, prompt_ids, read_bandwidth_gb_s, sync
from inferlab.engine.engine import InferenceEngine
from inferlab.engine.kv.contiguous import compute_kv_cache_bytes
from inferlab.engine.reference.single import PagedSequence, SingleSequence, forward_together
from inferlab.engine.sampling import argmax_rows
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


RUN_STEPS = 4  # timed steps of one batch size before the next size's
RUN_SETTLE = 4  # untimed steps before them, while the caches take this size's working set back


@dataclass
class Decoding:
    """`seqs` decoding greedy tokens together, one flat forward a step (one sequence: the engine's decode step)."""

    engine: InferenceEngine
    seqs: list[SingleSequence]
    logits: Tensor  # (len(seqs), vocab): their last step's
    paged: list[PagedSequence] = field(init=False)  # seqs, when several (they decode together on cache=paged)

    def __post_init__(self) -> None:
        self.paged = [seq for seq in self.seqs if isinstance(seq, PagedSequence)]

    def step(self) -> float:
        """One step of every sequence; its seconds."""
        tokens = argmax_rows(self.logits)  # as the engine's greedy sampling picks them, outside the timing
        start = time.perf_counter()
        if len(self.seqs) == 1:
            self.logits = self.engine.decode_step(tokens[0], self.seqs[0])[None]
        else:
            self.logits = forward_together(self.paged, [[token] for token in tokens])
        sync(self.engine.config.device)
        return time.perf_counter() - start


@register("profile", "profile_sizes")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    sequences = sorted(int(b) for b in cfg.study.sequences)
    if max(sequences) > 1 and engine.config.cache_mode != "paged":
        raise StudyUnavailable("several sequences decode together on the paged cache: use cache=paged")
    m = cfg.measure
    steps, warmup = int(m.profile_steps), max(int(m.warmup), 1)
    stored_format = file_format(engine.loaded.gguf_path) if engine.loaded.gguf_path else None
    decodings: dict[int, Decoding] = {}
    try:
        for batch in sequences:  # prompts of their own: nothing shared through the prefix cache
            room = warmup + timed_rows(steps) + RUN_SETTLE + steps  # then the profiled steps
            decodings[batch] = start_decoding(cfg, engine, batch, len(decodings) * max(sequences), room)
        step_ms = timed_steps(decodings, warmup, steps)
        rows: Rows = []
        one_sequence: dict[str, float] = {}  # op -> its ms per step with one sequence (and "" -> the whole step's)
        one_floor_ms = 0.0  # the one-sequence step's memory floor
        for batch, decoding in decodings.items():
            prof = profiled(decoding, steps)
            memory = memory_floor(cfg, engine, batch)
            ops = profile_rows(cfg, engine, prof, steps, memory["working_set_gb_s"])
            if batch == 1:
                one_sequence = {row["op"]: row["self_ms_per_step"] for row in ops} | {"": step_ms[batch]}
                one_floor_ms = memory["memory_floor_ms"]
            for row in ops:
                row |= {"sequences": batch, "step_ms": step_ms[batch], "file_format": stored_format, **memory}
                if one_sequence:
                    row["speedup_ceiling"] = batch * one_sequence[""] / step_ms[batch]
                    row["memory_ceiling"] = batch * one_floor_ms / memory["memory_floor_ms"]
                    if row["op"] in one_sequence:
                        row["vs_one_sequence"] = row["self_ms_per_step"] / one_sequence[row["op"]]
            rows += ops
    finally:
        for decoding in decodings.values():
            for seq in decoding.seqs:
                seq.release()
    return rows


def start_decoding(cfg: DictConfig, engine: InferenceEngine, batch: int, first_seed: int, steps: int) -> Decoding:
    """`batch` sequences after prompts of `measure.prompt_tokens` of their own (seeds first_seed on), with room for
    `steps` decode steps."""
    seqs: list[SingleSequence] = []
    logits: list[Tensor] = []
    try:
        for b in range(batch):
            ids = prompt_ids(cfg, engine, int(cfg.measure.prompt_tokens), seed=first_seed + b)
            first, seq = engine.prefill(ids, steps)
            seqs.append(seq)
            logits.append(first)
    except BaseException:
        for seq in seqs:
            seq.release()
        raise
    return Decoding(engine, seqs, torch.stack(logits))


def timed_rows(steps: int) -> int:
    """Decode steps that timed_steps runs of each decoding to time `steps` of them."""
    return -(-steps // RUN_STEPS) * RUN_SETTLE + steps


def timed_steps(decodings: dict[int, Decoding], warmup: int, steps: int) -> dict[int, float]:
    """After `warmup` steps each, `steps` timed steps of every decoding, in runs of RUN_STEPS (after RUN_SETTLE untimed
    ones) that alternate between them, which goes first alternating too; the median ms of each one's timed steps."""
    times: dict[int, list[float]] = {batch: [] for batch in decodings}
    for decoding in decodings.values():
        for _ in range(warmup):
            decoding.step()
    order = list(decodings)
    for run in range(-(-steps // RUN_STEPS)):
        for batch in order if run % 2 == 0 else order[::-1]:
            for _ in range(RUN_SETTLE):
                decodings[batch].step()
            times[batch] += [decodings[batch].step() for _ in range(min(RUN_STEPS, steps - run * RUN_STEPS))]
    return {batch: 1e3 * statistics.median(t) for batch, t in times.items()}


STEP_RANGE = "profile: step"  # each profiled step's range, which per_step_ms sorts the operators' times by


def profiled(decoding: Decoding, steps: int) -> profile:
    """torch.profiler over `steps` steps of `decoding`, each in a STEP_RANGE, after RUN_SETTLE untimed ones."""
    for _ in range(RUN_SETTLE):
        decoding.step()
    on_cuda = decoding.engine.config.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                decoding.step()
    return prof


def per_step_ms(prof: profile, attr: str) -> tuple[dict[str, list[float]], Counter[str]]:
    """Each operator's self time (`attr`, microseconds) in each profiled step, as ms (0 in a step it did not run in),
    and its calls over all of them."""
    events = list(prof.events())
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_RANGE)
    starts = [start for start, _ in steps]
    times: dict[str, list[float]] = {}
    calls: Counter[str] = Counter()
    for e in events:
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if e.name == STEP_RANGE or i < 0 or e.time_range.start > steps[i][1]:
            continue
        times.setdefault(e.key, [0.0] * len(steps))[i] += getattr(e, attr) / 1e3
        calls[e.key] += 1
    return times, calls


def memory_floor(cfg: DictConfig, engine: InferenceEngine, batch: int) -> dict[str, float]:
    """A step of `batch` sequences' working set (its phases' weights and the sequences' KV at their mean length over
    the timed and profiled steps), the read bandwidth over a buffer of that size, and the step's ms at that
    bandwidth."""
    m = cfg.measure
    steps = int(m.profile_steps)
    mean_length = int(m.prompt_tokens) + max(int(m.warmup), 1) + (timed_rows(steps) + steps) // 2  # timed, profiled
    kv = compute_kv_cache_bytes(engine.model.config, batch, mean_length, engine.config.cache_dtype)
    working_set = sum(phase_weight_bytes(engine.model).values()) + kv
    bandwidth = read_bandwidth_gb_s(working_set / 2**20, engine.config.device)
    return {
        "working_set_mb": working_set / 2**20,
        "working_set_gb_s": bandwidth,
        "memory_floor_ms": working_set / bandwidth / 1e6,
    }


def profile_rows(cfg: DictConfig, engine: InferenceEngine, prof: profile, steps: int, working_set_gb_s: float) -> Rows:
    """The `study.top_ops` operators by self time, each with its ms per step, the median over the profiled steps (a
    burst of other load on a shared machine lands in a few of them: their sum over the steps put the attention of
    SmolLM2 int8's 16-sequence step at 3.3 to 7.9 ms in three runs of a 12 ms step), and for the fused step's phases
    the rate at which it streamed its weights, and that as a share of `working_set_gb_s`, the read bandwidth of the
    step's working set; the memory's bandwidth probed now beside them."""
    bandwidth = read_bandwidth_gb_s(int(cfg.measure.bandwidth_mb), engine.config.device)
    weight_bytes = phase_weight_bytes(engine.model)
    on_cuda = engine.config.device.type == "cuda"
    times, calls = per_step_ms(prof, "self_device_time_total" if on_cuda else "self_cpu_time_total")
    ms = {op: statistics.median(t) for op, t in times.items() if sum(t) > 0}
    total = sum(ms.values())
    rows = []
    for op in sorted(ms, key=ms.__getitem__, reverse=True)[: int(cfg.study.top_ops)]:
        seconds_per_step = ms[op] / 1e3
        row = {
            "op": op,
            "share_pct": 100.0 * ms[op] / total,
            "self_ms_per_step": ms[op],
            "calls_per_step": calls[op] / steps,
            "bandwidth_gb_s": bandwidth,
            "timer": "device" if on_cuda else "cpu",
            "torch_threads": torch.get_num_threads(),
        }
        if op in weight_bytes:
            row["weights_gb_s"] = weight_bytes[op] / seconds_per_step / 1e9
            row["pct_bandwidth"] = 100.0 * row["weights_gb_s"] / working_set_gb_s
        rows.append(row)
    return rows
