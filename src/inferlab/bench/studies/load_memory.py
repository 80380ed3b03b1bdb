"""load_memory: what loading a model costs in memory, per size and file format, at the defaults.

Each file loads in a freshly spawned process (a multirun's jobs share one, where every earlier load would count):
its resident memory before loading (Python, torch and inferlab imported), the peak while loading (/proc's VmHWM)
and what stays once the engine is built (VmRSS), beside the bytes of the weights the engine holds and of the
dequantized copies it keeps for many-row steps (device.dense_copy_mb). The KV pool is sized at load but its pages
are committed only as blocks fill, so it adds nothing here. The shape presets' files hold random weights.
"""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from inferlab.api import CONF_DIR, engine_from_config, memory_mib
from inferlab.bench.progress import progress
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import file_format, in_fresh_process
from inferlab.errors import InferlabError
from inferlab.model.loader import model_file
from inferlab.quant import dense_copy_bytes, weight_bytes

MIB = 2**20


@register("load_memory")
def run(cfg: DictConfig) -> Rows:
    rows = []
    for entry in progress(list(cfg.study.files), "load_memory files"):
        job = cfg.copy()
        with open_dict(job):
            job.model = OmegaConf.load(CONF_DIR / "model" / f"{entry.model}.yaml")
            job.model.file_format = entry.get("file_format")
        try:
            rows += in_fresh_process(measure, job)
        except (BrokenProcessPool, InferlabError) as e:  # a file that did not load is a row saying why, not a lost job
            rows.append({"model": entry.model, "file_format": entry.get("file_format"), "note": f"not loaded: {e!r}"})
    return rows


def measure(cfg: DictConfig) -> Rows:
    spec = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(spec, dict)
    before, _ = memory_mib()
    engine = engine_from_config(cfg)
    try:
        stats = engine.load_stats
        weights = weight_bytes(engine.model) / MIB
        dense = dense_copy_bytes(engine.model) / MIB
        path = model_file(spec) or engine.loaded.gguf_path
        row: dict[str, Any] = {
            "model": spec["name"],
            "file_format": file_format(path) if path else None,
            "precision": engine.config.precision.split(" ")[0],
            "file_mb": path.stat().st_size / MIB if path else None,
            "weights_mb": weights,
            "dense_copies_mb": dense,
            "before_load_mb": before,
            "load_peak_mb": stats["load_peak_rss_mb"],
            "steady_mb": stats["load_rss_mb"],
            "peak_over_steady": stats["load_peak_rss_mb"] / stats["load_rss_mb"],
            "steady_over_bound": stats["load_rss_mb"] / (before + weights + dense + 150),
            "kv_pool_mb": engine.config.kv_pool.mib if engine.config.kv_pool else 0.0,
            "context": engine.config.max_seq_len,
            "load_s": stats["load_s"],
            "note": "random weights" if spec.get("source") == "random" else None,
        }
    finally:
        engine.close()
    return [row]
