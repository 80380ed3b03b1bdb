"""The one-line way in: `load_engine(model=..., precision=..., **overrides)` composes conf/ and builds the engine."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from inferlab.engine.engine import EngineConfig, InferenceEngine
from inferlab.engine.kv.budget import KVPool, size_kv_pool
from inferlab.engine.kv.contiguous import compute_kv_cache_bytes
from inferlab.engine.kv.int8 import KV_INT8
from inferlab.engine.runtime.cpus import cpu_grant
from inferlab.engine.runtime.threads import StepThreads, on_own_thread
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.scheduler import SchedulerConfig
from inferlab.engine.spec.build import build_speculation
from inferlab.errors import InvalidRequestError, ModelLoadError
from inferlab.kernels.select import choose_isa, select_kernels
from inferlab.model.config import ModelConfig
from inferlab.model.gguf_loader import release_gguf
from inferlab.model.loader import load_model
from inferlab.model.native_format import native_precision
from inferlab.native_memory import large_frees_returned, return_freed_memory
from inferlab.paths import conf_dir
from inferlab.quant import quantize_model

CONF_DIR = conf_dir()
log = logging.getLogger(__name__)


def compose(config_name: str = "engine", overrides: list[str] | None = None) -> DictConfig:
    """Compose a config from conf/ the way the command line would, with Hydra's override syntax."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name=config_name, overrides=overrides or [])
    except (HydraException, OmegaConfBaseException) as e:
        raise InvalidRequestError(_first_line(str(e))) from e


def load_engine(
    model: str = "smollm2-135m",
    precision: str = "auto",
    cache: str = "paged",
    spec: str = "off",
    device: str = "auto",
    **overrides: Any,
) -> InferenceEngine:
    """`overrides` take Hydra dotted keys: load_engine(cache="contiguous", **{"cache.slots": 2})."""
    args = [f"model={model}", f"precision={precision}", f"cache={cache}", f"spec={spec}", f"device={device}"]
    args += [f"{k}={_override_value(v)}" for k, v in overrides.items()]
    return engine_from_config(compose("engine", args))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device=cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_precision(cfg: DictConfig) -> str:
    """Replace precision=auto in `cfg` by the model's own format (model/native_format.py); say the choice."""
    if cfg.precision.name != "auto":
        return cfg.precision.name
    name, why = native_precision(OmegaConf.to_container(cfg.model, resolve=True))
    chosen = precision_config(name)
    with open_dict(chosen):  # what precision=auto was asked for an int4 choice (int8_activations_of checks it)
        chosen.activations = cfg.precision.activations
    with open_dict(cfg):
        cfg.precision = chosen
    return f"{name} (auto: {why})"


def precision_config(name: str) -> DictConfig:
    """conf/precision/NAME.yaml, the `precision` group's option, for a config composed with another one."""
    path = CONF_DIR / "precision" / f"{name}.yaml"
    if not path.is_file():
        raise InvalidRequestError(f"no precision {name!r} in {path.parent}")
    config = OmegaConf.load(path)
    assert isinstance(config, DictConfig)
    return config


def memory_mib() -> tuple[float, float]:
    """(resident memory now, its peak so far) of this process in MiB: /proc's VmRSS and VmHWM (Linux). Not
    getrusage's ru_maxrss, which a child inherits from the process that spawned it."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Vm"))
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def reset_peak_rss() -> None:
    """Start VmHWM over from the current RSS (Linux clear_refs), so a peak measures what comes next only."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def engine_from_config(cfg: DictConfig) -> InferenceEngine:
    """Load, quantize and build; records the load's time and peak resident memory (engine.load_stats), which the
    CLI prints and the quant_tradeoff study reports."""
    start = time.perf_counter()
    reset_peak_rss()
    engine = on_own_thread(lambda: _build_engine(cfg))
    now, peak = memory_mib()
    engine.load_stats = {"load_s": time.perf_counter() - start, "load_rss_mb": now, "load_peak_rss_mb": peak}
    log.info(
        "loaded %s in %.1f s: peak RSS %.0f MiB while loading, %.0f MiB after",
        engine.loaded.source,
        engine.load_stats["load_s"],
        peak,
        now,
    )
    return engine


def _build_engine(cfg: DictConfig) -> InferenceEngine:
    """Build the engine `cfg` describes; precision=auto in `cfg` becomes the precision it chose."""
    device = resolve_device(cfg.device.name)
    grant = cpu_grant()
    # device.threads unset: a thread per CPU the process gets (torch alone counts the affinity mask, not a quota),
    # fewer while other processes keep them busy (engine/runtime/threads.py)
    threads = int(cfg.device.threads or grant.threads)
    torch.set_num_threads(threads)
    share = grant.cpus if device.type == "cpu" and not cfg.device.threads else ()
    if cfg.model.source == "path" and not cfg.model.path:
        raise ModelLoadError("model=local needs model.path=DIR or FILE.gguf")
    precision = resolve_precision(cfg)
    dtype = getattr(torch, cfg.precision.dtype)
    model_spec = OmegaConf.to_container(cfg.model, resolve=True)
    if cfg.cache.prefix and cfg.cache.mode != "paged":
        raise InvalidRequestError(f"cache.prefix=true needs cache=paged (got cache={cfg.cache.mode})")
    kv_dtype = kv_dtype_of(cfg.cache)
    int8_activations = int8_activations_of(cfg.precision)
    choose_isa(device, cfg.device.kernels, cfg.device.isa)
    # a GGUF's Linears that will be quantized are read layer by layer as they are (int4 at Q4_1's group size
    # imports the file's blocks as they are): the float model never exists whole
    defer = bool(cfg.precision.quant)
    with large_frees_returned():  # each layer's temporaries gone with it, not kept resident (load peak)
        loaded = load_model(model_spec, dtype, device, cfg.cache.max_seq_len, seed=cfg.seed or 0, defer_linears=defer)
        if cfg.precision.quant:
            quantize_model(
                loaded.model, cfg.precision.quant, cfg.precision.get("group_size"), loaded.gguf_path, loaded.stand_ins
            )
        # the drafts before the kernels: a self draft is built from the target's own layers, and kernels and
        # huge pages are then chosen for both at once, so the tensors they share stay shared
        speculation = build_speculation(
            OmegaConf.to_container(cfg.spec, resolve=True),
            cfg.model.name,
            loaded.model,
            dtype,
            device,
            loaded.gguf_path,
        )
        drafts = speculation.drafter.models() if speculation else []
        release_gguf()  # before the kernels' copies (huge pages, dense copies), so those never coexist with it
        return_freed_memory()  # what loading freed (the GGUF's metadata, the float weights quantized away), likewise
        select_kernels(
            nn.ModuleList([loaded.model, *drafts]), device, dtype, cfg.device.kernels, cfg.device.dense_copy_mb
        )
    defaults = SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=cfg.seed,
        stop=list(cfg.stop),
    )
    pool = kv_pool(cfg, loaded.config, kv_dtype or dtype)
    if pool is not None:  # the longest sequence is what the pool can hold, if less than the model's context
        per_sequence = pool.tokens // (cfg.cache.slots if cfg.cache.mode == "contiguous" else 1)
        if per_sequence < loaded.config.max_seq_len:
            loaded.model.limit_context(per_sequence)
    config = EngineConfig(
        device=device,
        dtype=dtype,
        precision=precision,
        cache_mode=cfg.cache.mode,
        max_seq_len=loaded.config.max_seq_len,
        slots=cfg.cache.slots,
        defaults=defaults,
        block_size=cfg.cache.block_size,
        kv_blocks=pool.tokens // cfg.cache.block_size if pool is not None and cfg.cache.mode == "paged" else 0,
        kv_pool=pool,
        prefix_cache=cfg.cache.prefix,
        scheduler=SchedulerConfig(**cfg.scheduler),
        kernels=cfg.device.kernels,
        kv_dtype=kv_dtype,
        int8_activations=int8_activations,
        small_steps=StepThreads(cfg.device.small_step_threads or 0, cfg.device.small_step_rows or 0, share),
        threads=threads,
        cpus=grant,
    )
    engine = InferenceEngine(loaded, config, speculation)
    return_freed_memory()  # the fused step's plan leaves its build's temporaries (61 MiB at Llama-3.1-8B) in malloc's heap
    if int8_activations and engine.fused is None:
        log.warning(
            "precision.activations=int8 has no effect here: it applies to the fused CPU step, which this engine does "
            "not run (device.kernels=portable, a GPU, or no C++ toolchain)"
        )
    if speculation is not None:  # adaptive K counts a draft step in target steps as timed here, not as bytes
        speculation.drafter.measure_cost(loaded.model, engine.fused, speculation.k + 1)
    return engine


def kv_pool(cfg: DictConfig, model: ModelConfig, kv_dtype: torch.dtype) -> KVPool | None:
    """The KV memory of cache=paged (its pool) or cache=contiguous (its slots), sized once the weights are in place
    (engine/kv/budget.py); None for cache=none, which keeps no KV."""
    if cfg.cache.mode == "none":
        return None
    longest = model.max_seq_len * (cfg.cache.slots if cfg.cache.mode == "contiguous" else cfg.scheduler.max_running)
    return size_kv_pool(
        compute_kv_cache_bytes(model, 1, 1, kv_dtype),
        cfg.cache.block_size if cfg.cache.mode == "paged" else 1,
        cfg.cache.kv_tokens,
        cfg.cache.kv_budget_mb,
        float(cfg.cache.kv_memory_share),
        longest,
    )


def kv_dtype_of(cache: DictConfig) -> torch.dtype | None:
    """cache.kv_dtype: auto (None: the model's dtype) or int8 (codes + per-row scales, paged pools only)."""
    if cache.kv_dtype == "auto":
        return None
    if cache.kv_dtype != "int8":
        raise InvalidRequestError(f"cache.kv_dtype must be auto or int8 (got {cache.kv_dtype})")
    if cache.mode != "paged":
        raise InvalidRequestError(f"cache.kv_dtype=int8 needs cache=paged (got cache={cache.mode})")
    return KV_INT8


INT8_CODE_QUANTS = ("int4", "gguf")  # the quantized precisions whose products may take int8 activation codes


def int8_activations_of(precision: DictConfig) -> bool:
    """precision.activations (the INT8_CODE_QUANTS: int4 weights, a GGUF's K-quant blocks): int16 codes per row (False)
    or int8 codes per block of 32 columns, Q6_K's per 256 (True)."""
    activations = precision.get("activations", "int16")
    if activations not in ("int16", "int8"):
        raise InvalidRequestError(f"precision.activations must be int16 or int8 (got {activations})")
    if activations == "int8" and precision.quant not in INT8_CODE_QUANTS:
        raise InvalidRequestError(
            f"precision.activations=int8 is for int4 weights and GGUF K-quants (this model runs {precision.name})"
        )
    return activations == "int8"


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value and all(c.isalnum() or c in "._-/" for c in value) else repr(value)
    return str(value)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid configuration"
