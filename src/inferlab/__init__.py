"""inferlab: an LLM inference engine you can read, measure and trust."""
from inferlab.api import load_engine
from inferlab.engine.engine import Completion, GenerationRequest, InferenceEngine, StreamEvent, Timings
from inferlab.engine.kv_cache import KVCache, compute_kv_cache_bytes
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.speculative import SpecResult, SpecStats, speculative_generate
from inferlab.model.config import ModelConfig
from inferlab.model.transformer import Transformer

__all__ = ["Completion", "GenerationRequest", "InferenceEngine", "KVCache", "ModelConfig", "SamplingParams",
           "SpecResult", "SpecStats", "StreamEvent", "Timings", "Transformer", "compute_kv_cache_bytes", "load_engine",
           "speculative_generate"]
