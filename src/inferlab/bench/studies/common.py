"""What several studies measure the same way: prompts, decode timing, read bandwidth."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from inferlab.bench.prompts import make_prompts
from inferlab.bench.studies import Rows, Study, StudyUnavailable
from inferlab.engine.engine import InferenceEngine
from inferlab.engine.reference.single import SingleSequence
from inferlab.engine.sampling import argmax_rows
from inferlab.kernels.build import use_isa
from inferlab.kernels.huge_pages import zeros_on_huge_pages
from inferlab.model.gguf_loader import read_gguf_fields
from inferlab.model.native_format import GGUF_FILE_TYPE_NAMES


def prompt_ids(cfg: DictConfig, engine: InferenceEngine, n_tokens: int, seed: int = 0) -> list[int]:
    """One prompt of exactly `n_tokens` ids from the job's load dataset (another `seed`, another prompt)."""
    load = {**OmegaConf.to_container(cfg.load, resolve=True), "num_requests": 1, "prompt_tokens": n_tokens}
    return make_prompts(engine.tokenizer, load, seed=(cfg.seed or 0) + seed)[0].token_ids


def in_fresh_process(study: Study, cfg: DictConfig) -> Rows:
    """`study(cfg)` in a newly spawned Python process, for a study that measures its own process's memory: a
    multirun's jobs share one process (Hydra's basic launcher), where every earlier job's memory would count."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_log_to_stderr) as pool:
        return pool.submit(study, OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))).result()


def _log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_times(engine: InferenceEngine, ids: list[int], steps: int) -> list[float]:
    """Prefill `ids`, then time `steps` greedy decode steps (seconds each); EOS does not stop it."""
    logits, seq = engine.prefill(ids, reserve_tokens=steps)
    try:
        return decode_loop(engine, seq, logits, steps)[0]
    finally:
        seq.release()


def decode_loop(engine: InferenceEngine, seq: SingleSequence, logits: Tensor, steps: int) -> tuple[list[float], Tensor]:
    """`steps` greedy decode steps on `seq` from `logits`; each step's seconds and the last logits. The token is
    picked as the engine's greedy sampling picks it (argmax_rows), so a profile over this loop shows what serving
    spends between steps, not torch's slower argmax."""
    times = []
    for _ in range(steps):
        token = argmax_rows(logits[None])[0]
        start = time.perf_counter()
        logits = engine.decode_step(token, seq)
        sync(engine.config.device)
        times.append(time.perf_counter() - start)
    return times, logits


Runner = Callable[[list[int], int], list[float]]  # (prompt ids, new tokens) -> token arrival times


def inferlab_runner(engine: InferenceEngine, isa: str | None = None) -> Runner:
    """Batch-1 greedy decoding on `engine` (with the kernels of `isa`), timed as the peers study times every engine."""

    def generate(ids: list[int], n: int) -> list[float]:
        if isa:
            use_isa(isa)  # the process's kernels (the engine's decode plan is its own already)
        logits, seq = engine.prefill(ids, reserve_tokens=n)
        try:
            start = time.perf_counter()
            times, _ = decode_loop(engine, seq, logits, n - 1)
        finally:
            seq.release()
        return [start + sum(times[:i]) for i in range(n)]

    return generate


def median_rate(times: list[float], warmup: int) -> float:
    """Tokens/s of the median step after dropping `warmup` steps."""
    return 1.0 / statistics.median(times[warmup:])


def decode_rate(timestamps: list[float]) -> float:
    """Tokens/s between the first and the last token: (n - 1) / (t_last - t_first), TPOT's inverse."""
    return (len(timestamps) - 1) / (timestamps[-1] - timestamps[0])


def median_of(run: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(repeats))


def read_bandwidth_gb_s(megabytes: float, device: torch.device, repeats: int = 5) -> float:
    """The machine's read bandwidth: the best of `repeats` sums over a buffer of `megabytes` (larger than the caches:
    the memory's; a step's working set: what that step can get). On huge pages where they are granted, as the
    engine keeps its weights and KV pools (on 4 KiB pages this machine's sums over 256 MiB-1 GiB read 10-30% slower)."""
    buffer = zeros_on_huge_pages((int(megabytes * 2**20) // 4,), torch.float32, device)
    # written first: a fresh mapping's untouched pages all read as the kernel's one zero page, which stays in cache
    # (sums over 1 GiB of them ran ~3x faster than over written memory here, and the roofline came out too high)
    buffer.fill_(1.0)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        buffer.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def require(module: str, feature: str) -> ModuleType:
    """Import `module` or say which feature is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise StudyUnavailable(f"{feature} is not available yet ({module}: {e})") from e


def file_format(gguf: Path) -> str:
    """The GGUF's file type as llama.cpp names it (Q4_1, Q8_0, BF16, ...)."""
    file_type = read_gguf_fields(gguf).get("general.file_type")
    return GGUF_FILE_TYPE_NAMES.get(file_type, str(file_type))
