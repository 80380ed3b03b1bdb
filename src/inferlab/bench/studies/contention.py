"""contention: inferlab and llama.cpp on a quiet machine, beside CPU-bound neighbors, and under a CPU quota.

The conditions (bench/contention.py) are entered one after another, and every process measured in one is started
inside it, so a thread policy sees the condition when it sizes itself. In each, first batch-1 decode: inferlab's
through a fresh engine in a subprocess, timed by the engine's own timings (bench/decode_probe.py), and llama.cpp's
llama-bench on the same GGUF (-p 0: decode alone, after a context of the same prompt length); then serving:
inferlab-serve and llama.cpp's llama-server (`-np` the largest level), each at its defaults, driven in turn by the
serving study's rounds (the others paused; each load with prompts of its own; the order of servers reversed between
rounds; medians over the rounds). Under the conditions named in `study.fixed_threads_under` (the quota), inferlab
also runs with fixed thread counts (device.threads), and its defaults' figure over the best of them is vs_best_fixed.
vs_quiet is a figure over the same engine's at the same load on the quiet machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from inferlab.bench.contention import QUIET, Placement, condition, cores
from inferlab.bench.peer_servers import ServerSpec, inferlab_server, llama_cpp_tool, llama_server
from inferlab.bench.prompts import Prompt, load_tokenizer, make_prompts
from inferlab.bench.studies import Rows, StudyUnavailable, register
from inferlab.bench.studies.serving import Samples, gguf_file, load_plan, needs_gguf, serve_rounds

log = logging.getLogger(__name__)

SERVING_METRICS = ("median_ttft_ms", "median_tpot_ms", "failed", "timed_out")


@dataclass
class LlamaCpp:
    """llama.cpp's programs on the job's GGUF: llama-bench for decode, llama-server for serving."""

    bench: Path
    server: ServerSpec
    gguf: Path
    threads: int


@dataclass
class Job:
    """What every condition measures the same way."""

    model: str  # the model config's name, as inferlab's processes take it
    decode_ids: list[int]  # batch-1 decode's prompt
    measure: DictConfig
    warmup: list[Prompt]  # each server's untimed load
    output_tokens: int
    startup_timeout_s: float
    bench_timeout_s: float  # llama-bench's run, at most
    log_dir: Path
    llama: LlamaCpp | None

    def under(self, name: str, variants: list[list[str]], prompts: list[dict[int, list[Prompt]]]) -> Rows:
        """Enter condition `name` and measure in it inferlab with each list of overrides in `variants` (and
        llama.cpp): batch-1 decode, then serving with a round of loads per entry of `prompts`."""
        specs = [inferlab_server([f"model={self.model}"], v) for v in variants] + (
            [self.llama.server] if self.llama else []
        )
        log_dir = self.log_dir / name
        with condition(name) as placement:
            log.info("condition %s: %s", name, placement.mechanism)
            where = {"condition": name, "mechanism": placement.mechanism}
            rows = []
            for overrides, spec in zip(variants, specs):
                probe = inferlab_decode(placement, self.model, overrides, self.decode_ids, self.measure, log_dir)
                rows.append({"engine": spec.name, "load": "decode", **where, **probe, "weights": spec.weights})
            if self.llama:
                bench = llama_bench(placement, self.llama, len(self.decode_ids), self.measure, self.bench_timeout_s)
                rows.append(
                    {"engine": "llama.cpp", "load": "decode", **where, **bench, "weights": self.llama.server.weights}
                )
            wrapped = [dataclasses.replace(spec, argv=placement.wrap(spec.argv)) for spec in specs]
            samples = serve_rounds(wrapped, self.warmup, prompts, self.output_tokens, self.startup_timeout_s, log_dir)
        return rows + serving_rows(specs, list(prompts[0]), samples, where)


@register("contention")
def run(cfg: DictConfig) -> Rows:
    study, measure = cfg.study, cfg.measure
    load = OmegaConf.to_container(cfg.load, resolve=True)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    levels, rounds, seed = [int(c) for c in study.levels], int(measure.repeats), cfg.seed or 0
    threads = len(cores())
    llama, rows = llama_cpp(study, gguf_file(model), threads, max(levels))
    tokenizer = load_tokenizer(model)
    conditions = list(study.conditions)
    warmup, prompts = load_plan(tokenizer, load, levels, rounds * len(conditions), max(1, int(measure.warmup)), seed)
    decode_load = {**load, "num_requests": 1, "prompt_tokens": int(measure.prompt_tokens)}
    job = Job(
        model["name"],
        make_prompts(tokenizer, decode_load, seed=seed)[0].token_ids,
        measure,
        warmup,
        int(load["output_tokens"]),
        float(study.startup_timeout_s),
        float(study.bench_timeout_s),
        Path(HydraConfig.get().runtime.output_dir),
        llama,
    )
    fixed = [[f"device.threads={t}"] for t in fixed_thread_counts(study.fixed_threads, threads)]
    measured: Rows = []
    for i, name in enumerate(conditions):
        variants = [[], *(fixed if name in study.fixed_threads_under else [])]  # [] is inferlab's defaults
        measured += job.under(name, variants, prompts[i * rounds : (i + 1) * rounds])
    return rows + compared(measured)


def llama_cpp(study: DictConfig, gguf: Path | None, threads: int, slots: int) -> tuple[LlamaCpp | None, Rows]:
    """llama.cpp's programs for this job, or none and a row saying why (no GGUF weights, not built)."""
    try:
        gguf = needs_gguf(gguf, "llama.cpp")
        server = llama_server(
            llama_cpp_tool("llama-server", study.llama_cpp_bin), gguf, threads, slots, int(study.slot_ctx)
        )
        return LlamaCpp(llama_cpp_tool("llama-bench", study.llama_cpp_bin), server, gguf, threads), []
    except StudyUnavailable as e:
        return None, [{"engine": "llama.cpp", "tok_s": None, "note": str(e)}]


def fixed_thread_counts(configured: list[int] | None, threads: int) -> list[int]:
    """The fixed thread counts inferlab runs with beside its defaults: as configured, else the quota's CPUs (half the
    cores) and all the cores, the two a fixed setting would pick."""
    if configured:
        return sorted({int(t) for t in configured})
    return sorted({max(1, math.floor(threads / 2)), threads})


def inferlab_decode(
    placement: Placement, model: str, overrides: list[str], ids: list[int], measure: DictConfig, log_dir: Path
) -> dict[str, Any]:
    """Batch-1 decode of a fresh inferlab engine started inside `placement`: its tok/s and the threads it took."""
    argv = placement.wrap([sys.executable, "-m", "inferlab.bench.decode_probe", f"model={model}", *overrides])
    request = {"prompt_ids": ids, "new_tokens": int(measure.new_tokens)}
    request.update(warmup=int(measure.warmup), repeats=int(measure.repeats))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"decode_{'_'.join(['inferlab', *overrides])}.log"
    with open(log_path, "w") as stderr:
        done = subprocess.run(argv, input=json.dumps(request), stdout=subprocess.PIPE, stderr=stderr, text=True)
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"inferlab's decode probe exited with code {done.returncode}: {' | '.join(tail)}")
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    return {"tok_s": probe["decode_tok_s"], "threads": probe["threads"]}


def llama_bench(
    placement: Placement, llama: LlamaCpp, depth: int, measure: DictConfig, timeout_s: float
) -> dict[str, Any]:
    """llama.cpp's batch-1 decode (llama-bench, started inside `placement`): `measure.new_tokens` tokens after a
    context of `depth`, tok/s the median of `measure.repeats` runs after its own warm-up run; and its threads."""
    argv = [str(llama.bench), "-m", str(llama.gguf), "-p", "0", "-n", str(int(measure.new_tokens)), "-d", str(depth)]
    argv += ["-t", str(llama.threads), "-r", str(int(measure.repeats)), "-o", "json"]
    try:
        done = subprocess.run(placement.wrap(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:  # a collapse: the row says so instead of holding the study for an hour
        runs = int(measure.repeats) + 1
        note = f"llama-bench did not finish {runs} runs of {int(measure.new_tokens)} tokens in {timeout_s:.0f} s"
        return {"tok_s": None, "threads": llama.threads, "note": note}
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with code {done.returncode}: {done.stderr.strip()[-300:]}")
    (test,) = json.loads(done.stdout)
    return {"tok_s": statistics.median(test["samples_ts"]), "threads": llama.threads}


def serving_rows(specs: list[ServerSpec], levels: list[int], samples: Samples, where: dict[str, str]) -> Rows:
    """A row per server and level: the medians over the rounds."""
    rows = []
    for spec in specs:
        for c in levels:
            loads = samples[spec.name, c]
            row = {"engine": spec.name, "load": f"serving c={c}", **where}
            row["tok_s"] = statistics.median(s["output_throughput"] for s in loads)
            row.update({m: statistics.median(s[m] for s in loads) for m in SERVING_METRICS})
            row.update(requests=int(loads[0]["completed"] + loads[0]["failed"]), weights=spec.weights)
            rows.append(row)
    return rows


def compared(rows: Rows) -> Rows:
    """Each row with vs_quiet (its tok/s over the same engine's at the same load, quiet) and, for inferlab's defaults
    where fixed thread counts ran beside them, vs_best_fixed (over the fastest of those)."""
    tok_s = {(r["engine"], r["load"], r["condition"]): r["tok_s"] for r in rows}
    for row in rows:
        quiet, own = tok_s.get((row["engine"], row["load"], QUIET)), row["tok_s"]  # None: a run that did not finish
        row["vs_quiet"] = own / quiet if own is not None and quiet else None
        fixed = [r["tok_s"] for r in rows if is_fixed_beside(r, row) and r["tok_s"] is not None]
        row["vs_best_fixed"] = own / max(fixed) if own is not None and fixed and max(fixed) > 0 else None
    return rows


def is_fixed_beside(other: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether `other` is inferlab at a fixed thread count measured at `row`'s load and condition, `row` its defaults."""
    same = other["load"] == row["load"] and other["condition"] == row["condition"]
    return row["engine"] == "inferlab" and same and other["engine"].startswith("inferlab device.threads=")
