"""Weight-only INT8 / group-wise INT4 quantization: module swaps whose matmuls read the integers directly."""

from inferlab.quant.apply import LayerQuant, QuantReport, dense_copy_bytes, quantize_model, weight_bytes
from inferlab.quant.int4 import Int4GroupLinear
from inferlab.quant.int8 import Int8Embedding, Int8Linear

__all__ = [
    "Int4GroupLinear",
    "Int8Embedding",
    "Int8Linear",
    "LayerQuant",
    "QuantReport",
    "dense_copy_bytes",
    "quantize_model",
    "weight_bytes",
]
