"""peers: batch-1 decode and prompt tokens/s of inferlab, Hugging Face transformers, llama.cpp and OpenVINO GenAI on the
same GGUF.

Every engine is timed the same way: token arrival times while generating `new_tokens` greedy tokens after
the same prompt ids, decode rate = (n - 1) / (t_last - t_first), and the seconds one forward over a prompt
of each `study.prefill_tokens` length takes (prefill rate = its tokens / those seconds; every round draws new
prompts, so no engine finds one cached), in rounds that probe the read bandwidth a buffer of each engine's
weight bytes gets (weights that fit the last-level cache read faster than ones that do not) and then run every
engine once (medians over the rounds). The roofline is that bandwidth over the bytes of weights one decode step
reads. inferlab runs once per instruction set of `study.isas` that the CPU
runs (its kernels' builds, kernels/isa.py), each row naming its set; the peers name what they run on.
An engine "inferlab int8 codes" in `study.engines` adds the job's engine at precision.activations=int8 on the same
build, where the job's precision takes it (int4, and gguf: K-quant files): llama.cpp's own arithmetic (int8 activation
codes), beside the served default's int16 codes.
Beside `study.prefill_paired_with` (a precision), the job's own inferlab engine also has its prefill timed
against that precision's, back to back on the same two prompts in every round (ABBA): `prefill_N_vs_PRECISION`
is the other's seconds over ours (above 1: ours is faster), a ratio the machine's drift over minutes does not reach.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from inferlab.api import INT8_CODE_QUANTS, engine_from_config, precision_config
from inferlab.bench import openvino_worker
from inferlab.bench.peer_servers import llama_cpp_tool, llama_cpp_version
from inferlab.bench.progress import progress
from inferlab.bench.studies import Rows, StudyUnavailable, register
from inferlab.bench.studies.common import (
    Runner,
    decode_rate,
    file_format,
    inferlab_runner,
    prompt_ids,
    read_bandwidth_gb_s,
    require,
    sync,
)
from inferlab.engine.engine import InferenceEngine
from inferlab.kernels.build import use_isa
from inferlab.kernels.isa import supported_isas
from inferlab.quant import dense_copy_bytes, weight_bytes

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the precision that serves a GGUF file type as stored (the K-quant and other block types: gguf)
STORED_PRECISIONS = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "Q8_0": "int8", "Q4_1": "int4"}
INT8_CODES = "inferlab int8 codes"  # the job's engine at precision.activations=int8 (int8_codes_peer)
LLAMA_CPP_ISA_FEATURES = {"avx2": {"AVX2", "FMA"}, "avx512": {"AVX2", "FMA", "AVX512", "AVX512_VNNI", "AVX512_BF16"}}


Prefill = Callable[[list[int]], float]  # prompt ids -> seconds of the forward over them
Decode = Callable[[list[int], int], float]  # prompt ids, new tokens -> decode tokens/s after that prompt


@dataclass
class Peer:
    decode: Decode
    prefill: Prefill
    weight_bytes: int
    note: str
    isa: str
    paired: tuple[str, Prefill] | None = None  # (precision, its engine's prefill) timed beside ours
    dense_copy_bytes: int | None = None  # dequantized copies held for many-row steps (inferlab's; None: not known)
    close: Callable[[], None] = lambda: None  # ends what the peer started (a worker process)


@register("peers", "peer_sizes")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    gguf = engine.loaded.gguf_path
    if gguf is None:
        raise StudyUnavailable("peers compares engines on one GGUF file: use a GGUF model (model=smollm2-135m)")
    m = cfg.measure
    ids = prompt_ids(cfg, engine, int(m.prompt_tokens))
    prefill_lengths = [int(n) for n in cfg.study.prefill_tokens]
    # (engine, isa) -> a maker of its Peer; inferlab once per kernel build
    makers: dict[tuple[str, str | None], Callable[[], Peer]] = {
        ("transformers", None): lambda: transformers_peer(gguf, cfg.precision, engine.config.device),
        ("llama.cpp", None): lambda: llama_bench_peer(gguf, cfg.precision.name, cfg.study.get("llama_cpp_bin")),
        ("openvino", None): lambda: openvino_peer(gguf, cfg.precision.name, cfg.study.get("openvino_python")),
    }
    for isa, isa_engine in inferlab_engines(cfg, engine).items():
        makers["inferlab", isa] = lambda e=isa_engine, isa=isa: inferlab_peer(
            e, isa, paired=paired_prefill(cfg, isa, cfg.study.get("prefill_paired_with")) if e is engine else None
        )
    if engine.fused is not None and cfg.precision.quant in INT8_CODE_QUANTS:
        makers[INT8_CODES, engine.fused.isa] = lambda: int8_codes_peer(cfg, engine.fused.isa)
    common = {
        "file_format": file_format(gguf),
        "prompt_tokens": len(ids),
        "new_tokens": int(m.new_tokens),
        "torch_threads": torch.get_num_threads(),
    }
    peers: dict[tuple[str, str | None], Peer] = {}
    unavailable = []
    for name in cfg.study.engines:
        for key in [key for key in makers if key[0] == name]:
            try:
                peers[key] = makers[key]()
            except StudyUnavailable as e:
                unavailable.append({"engine": name, "decode_tok_s": None, "note": str(e)})

    # Round robin: each round probes the bandwidth of every engine's weight size, then runs every engine once, so the
    # probes and all engines see the same states of a shared machine (its speed drifts by tens of percent over
    # minutes).
    Rates = dict[tuple[str, str | None], dict[str, float]]
    sizes = sorted({peer.weight_bytes for peer in peers.values()})

    def one_round(index: int) -> tuple[dict[int, float], Rates]:
        bandwidth = {size: read_bandwidth_gb_s(size / 2**20, engine.config.device) for size in sizes}
        # new prompts every round, two per length (seeds from 1: 0 drew the decode prompt), so no engine finds one
        # cached; the second only for a paired engine's
        prompts = {
            n: (prompt_ids(cfg, engine, n, seed=2 * index - 1), prompt_ids(cfg, engine, n, seed=2 * index))
            for n in prefill_lengths
        }
        rates: Rates = {}
        for key, peer in peers.items():
            rates[key] = {"decode_tok_s": peer.decode(ids, int(m.new_tokens))}
            rates[key] |= prefill_rates(peer, prompts, index)
        return bandwidth, rates

    warmup = int(m.warmup)
    try:
        for i in range(1, warmup + 1):
            one_round(i)
        repeats = progress(range(warmup + 1, warmup + 1 + int(m.repeats)), f"peers {cfg.precision.name} rounds")
        rounds = [one_round(i) for i in repeats]
    finally:
        for peer in peers.values():
            peer.close()
    rows = [{**row, **common} for row in unavailable]
    for key, peer in peers.items():
        medians = {column: statistics.median(rates[key][column] for _, rates in rounds) for column in rounds[0][1][key]}
        bandwidth = statistics.median(probes[peer.weight_bytes] for probes, _ in rounds)
        roofline = bandwidth * 1e9 / peer.weight_bytes
        rows.append(
            {
                "engine": key[0],
                "isa": peer.isa,
                **medians,
                "weight_mb": peer.weight_bytes / 2**20,
                "dense_copy_mb": None if peer.dense_copy_bytes is None else peer.dense_copy_bytes / 2**20,
                "roofline_tok_s": roofline,
                "pct_roofline": 100.0 * medians["decode_tok_s"] / roofline,
                "note": peer.note,
                "bandwidth_gb_s": bandwidth,
                **common,
            }
        )
    return rows


def prefill_rates(peer: Peer, prompts: dict[int, tuple[list[int], list[int]]], index: int) -> dict[str, float]:
    """Prefill tok/s at each prompt length, over the first of its two prompts; with a paired engine, over both, each
    engine timed on both in the order ABBA (who is A alternates with the round's index: neither always goes first
    nor meets the machine later), and the paired engine's seconds over ours."""
    rates = {}
    for n, (first, second) in prompts.items():
        if peer.paired is None:
            rates[f"prefill_{n}_tok_s"] = n / peer.prefill(first)
            continue
        precision, paired = peer.paired
        a, b = (peer.prefill, paired) if index % 2 else (paired, peer.prefill)
        seconds = {a: a(first), b: b(first)}
        seconds[b] += b(second)
        seconds[a] += a(second)
        rates[f"prefill_{n}_tok_s"] = 2 * n / seconds[peer.prefill]
        rates[f"prefill_{n}_vs_{precision}"] = seconds[paired] / seconds[peer.prefill]
    return rates


def paired_prefill(cfg: DictConfig, isa: str | None, precision: str | None) -> tuple[str, Prefill] | None:
    """The prefill of an engine like the job's at `precision`, on the same kernel build; None where the
    job itself runs at that precision (or none is asked for)."""
    if precision is None or cfg.precision.name == precision:
        return None
    paired_cfg = cfg.copy()
    with open_dict(paired_cfg):
        paired_cfg.precision = precision_config(precision)
    return precision, inferlab_prefill(engine_from_config(paired_cfg), isa)


def inferlab_prefill(engine: InferenceEngine, isa: str | None) -> Prefill:
    def prefill(ids: list[int]) -> float:
        if isa:
            use_isa(isa)
        start = time.perf_counter()
        _, seq = engine.prefill(ids, reserve_tokens=1)
        seconds = time.perf_counter() - start
        seq.release()
        return seconds

    return prefill


def int8_codes_peer(cfg: DictConfig, isa: str) -> Peer:
    """The job's engine with int8 activation codes (precision.activations=int8) on build `isa`."""
    codes_cfg = cfg.copy()
    with open_dict(codes_cfg):
        codes_cfg.precision.activations = "int8"
        codes_cfg.device.isa = isa
    engine = engine_from_config(codes_cfg)
    return inferlab_peer(engine, isa, "; precision.activations=int8 (int8 activation codes, as llama.cpp's)")


def inferlab_peer(
    engine: InferenceEngine, isa: str | None, note: str = "", paired: tuple[str, Prefill] | None = None
) -> Peer:
    """An inferlab engine as a peer on build `isa` (None: its device without the CPU kernels); `note` after its
    source."""
    return Peer(
        rate_of(inferlab_runner(engine, isa)),
        inferlab_prefill(engine, isa),
        weight_bytes(engine.model),
        engine.loaded.source + note,
        isa or engine.config.device.type,
        paired,
        dense_copy_bytes=dense_copy_bytes(engine.model),
    )


def inferlab_engines(cfg: DictConfig, engine: InferenceEngine) -> dict[str | None, InferenceEngine]:
    """The job's engine on each instruction set of `study.isas` the CPU runs (the job's own device.isa
    first); {None: engine} where the CPU kernels do not run (another device, kernels=portable)."""
    chosen = engine.fused.isa if engine.fused is not None else None
    if chosen is None:
        return {None: engine}
    engines: dict[str | None, InferenceEngine] = {chosen: engine}
    for isa in [i for i in cfg.study.isas if i in supported_isas() and i != chosen]:
        isa_cfg = cfg.copy()
        with open_dict(isa_cfg):
            isa_cfg.device.isa = isa
        engines[isa] = engine_from_config(isa_cfg)
    return engines


def transformers_peer(gguf: Path, precision: DictConfig, device: torch.device) -> Peer:
    if precision.get("quant") or precision.dtype not in TORCH_DTYPES:
        raise StudyUnavailable(f"transformers has no {precision.name} path for GGUF weights on this device")
    transformers = require("transformers", "the transformers peer (pip install -e .[peers])")
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=TORCH_DTYPES[precision.dtype]
        )
        .to(device)
        .eval()
    )

    class Clock(transformers.generation.streamers.BaseStreamer):  # type: ignore[name-defined]  # imported at run time
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    def generate(ids: list[int], n: int) -> list[float]:
        clock = Clock()
        with torch.inference_mode():
            model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                streamer=clock,
                pad_token_id=model.config.eos_token_id,
            )
        return clock.times

    def prefill(ids: list[int]) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model(torch.tensor([ids], device=device))
        sync(device)
        return time.perf_counter() - start

    nbytes = sum(p.nbytes for p in {p.data_ptr(): p for p in model.parameters()}.values())
    isa = f"torch {torch.backends.cpu.get_cpu_capability().lower()}" if device.type == "cpu" else device.type
    return Peer(rate_of(generate), prefill, nbytes, f"transformers {transformers.__version__} generate", isa)


def rate_of(generate: Runner) -> Decode:
    """A runner's token arrival times as its decode rate."""
    return lambda ids, n: decode_rate(generate(ids, n))


def llama_bench_peer(gguf: Path, precision: str, bin_dir: str | None) -> Peer:
    """llama.cpp's own llama-bench on the same file (built by `make llama-server`), one run per call: decode of
    `n` tokens after a context as deep as the prompt (-d), and a prompt of the same length (-p); its prompts are its
    own random tokens (a forward's cost does not depend on which). It runs the job's file as stored, so it has a
    counterpart only where the job serves that format (its own precision, or gguf for the block formats)."""
    require_stored_format("llama.cpp", gguf, precision)
    binary = llama_cpp_tool("llama-bench", bin_dir)
    threads = str(torch.get_num_threads())

    def bench(*args: str) -> float:
        out = subprocess.run(
            [str(binary), "-m", str(gguf), "-t", threads, "-r", "1", "-o", "json", *args],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if out.returncode != 0:
            raise StudyUnavailable(f"llama-bench failed: {out.stderr.strip().splitlines()[-1:]}")
        return float(json.loads(out.stdout)[0]["avg_ts"])

    def decode(ids: list[int], n: int) -> float:
        return bench("-p", "0", "-n", str(n), "-d", str(len(ids)))

    def prefill(ids: list[int]) -> float:
        return len(ids) / bench("-p", str(len(ids)), "-n", "0")

    version = llama_cpp_version(binary)
    return Peer(decode, prefill, gguf.stat().st_size, f"llama-bench {version} on {gguf.name}", llama_cpp_isa(binary))


def require_stored_format(peer: str, gguf: Path, precision: str) -> None:
    """A peer that runs the file as stored is compared only with a job that serves it so (its own precision, or gguf
    for the block formats: each tensor in its own blocks)."""
    if precision not in ("gguf", STORED_PRECISIONS.get(file_format(gguf))):
        raise StudyUnavailable(f"{peer} runs {gguf.name} as stored ({file_format(gguf)}), not as {precision}")


def openvino_peer(gguf: Path, precision: str, python: str | None) -> Peer:
    """OpenVINO GenAI's LLMPipeline on the same file, in the venv of `python` (`make openvino`), through
    bench/openvino_worker.py: decode tok/s from its own time per output token over `n` greedy tokens (EOS ignored),
    prefill seconds from its own time to first token of a one-token generation. It reads the GGUF's blocks into its
    own CPU formats (here it read the Q4_1, Q8_0, Q6_K files and the 1.7B Q4_K_M; it refused BF16 and the 360M Q4_K_M,
    mostly Q5_0 blocks), so, like llama.cpp, it has a counterpart only where the job serves the file's format."""
    if not python or not Path(python).is_file():
        raise StudyUnavailable(f"OpenVINO GenAI: no study.openvino_python ({python}); `make openvino` makes its venv")
    require_stored_format("OpenVINO GenAI", gguf, precision)
    worker = subprocess.Popen(
        [python, openvino_worker.__file__, str(gguf), str(torch.get_num_threads())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    stdin, stdout = worker.stdin, worker.stdout

    def close() -> None:
        stdin.close()
        worker.wait(timeout=60)

    hello = json.loads(stdout.readline() or '{"error": "the worker exited"}')
    if "error" in hello:
        close()
        raise StudyUnavailable(f"OpenVINO GenAI cannot load {gguf.name}: {hello['error']}")

    def generate(ids: list[int], n: int) -> dict[str, float]:
        stdin.write(json.dumps({"ids": ids, "new_tokens": n}) + "\n")
        stdin.flush()
        return json.loads(stdout.readline())

    return Peer(
        lambda ids, n: 1e3 / generate(ids, n)["tpot_ms"],
        lambda ids: generate(ids, 1)["ttft_ms"] / 1e3,
        gguf.stat().st_size,
        f"OpenVINO GenAI {hello['version'].split('-')[0]} LLMPipeline on {gguf.name} (converted at load)",
        "openvino cpu",
        close=close,
    )


def llama_cpp_isa(binary: Path) -> str:
    """The widest of inferlab's instruction sets whose features llama.cpp's CPU backend was built with (its
    build's CMakeCache.txt: `make llama-server` builds for those /proc/cpuinfo lists)."""
    cache = binary.parent.parent / "CMakeCache.txt"
    text = cache.read_text() if cache.is_file() else ""
    used = set(re.findall(r"^GGML_(\w+):BOOL=ON$", text, flags=re.MULTILINE))
    names = [name for name, features in LLAMA_CPP_ISA_FEATURES.items() if features <= used]
    return names[-1] if names else "unknown"
