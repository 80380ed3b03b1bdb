"""inferlab: an LLM inference engine you can read, measure and trust.

The names below load on first use (PEP 562), so importing one layer (`inferlab.model`, `inferlab.quant`)
does not import the engine above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferlab.api import load_engine
    from inferlab.engine.engine import Completion, GenerationRequest, InferenceEngine, StreamEvent, Timings
    from inferlab.engine.kv.contiguous import KVCache, compute_kv_cache_bytes
    from inferlab.engine.sampling import SamplingParams
    from inferlab.engine.spec.session import SpecResult, SpecStats, speculative_generate
    from inferlab.model.config import ModelConfig
    from inferlab.model.transformer import Transformer

_HOMES = {
    "load_engine": "inferlab.api",
    **dict.fromkeys(
        ("Completion", "GenerationRequest", "InferenceEngine", "StreamEvent", "Timings"), "inferlab.engine.engine"
    ),
    **dict.fromkeys(("KVCache", "compute_kv_cache_bytes"), "inferlab.engine.kv.contiguous"),
    "SamplingParams": "inferlab.engine.sampling",
    **dict.fromkeys(("SpecResult", "SpecStats", "speculative_generate"), "inferlab.engine.spec.session"),
    "ModelConfig": "inferlab.model.config",
    "Transformer": "inferlab.model.transformer",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'inferlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
