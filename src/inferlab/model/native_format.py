"""precision=auto: serve a checkpoint in the format it is stored in.

A GGUF file says its format in `general.file_type` (llama.cpp's LlamaFileType): its Q4_1 blocks import
as they are into int4, Q8_0 into int8, 16-bit floats run as bf16 (CPUs have bf16 dot products, rarely
fp16 ones) and F32 as fp32; the K-quant mixes (Q4_K_M, Q5_K_M, Q6_K, ...) and Q4_0/Q5_0/Q5_1 run as gguf, every
tensor in the block format the file keeps it in (a Q4_K_M file's Q6_K and fallback Q5_0/Q8_0 tensors included). An HF checkpoint runs in its config's dtype. Random init has no stored
format and runs in fp32, the reference precision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inferlab.model.loader import locate_package_file, model_file, read_gguf_fields

GGUF_FILE_TYPE_NAMES = {  # llama.cpp's LlamaFileType values
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}
GGUF_FILE_TYPES = {0: "fp32", 1: "bf16", 3: "int4", 7: "int8", 32: "bf16"} | {
    t: "gguf" for t in (2, 8, 9, 14, 15, 16, 17, 18)
}
HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FALLBACK = "fp32"


def native_precision(model: dict[str, Any]) -> tuple[str, str]:
    """(precision option, why) for a resolved `model` config group."""
    path = model_file(model)
    if path is not None:
        if path.is_dir():
            return hf_precision(path)
        return gguf_precision(path)
    if model.get("source") == "gguf_package":
        return gguf_precision(locate_package_file(model["package"], model["file"], model.get("install", "")))
    return FALLBACK, "random init"


def gguf_precision(path: Path) -> tuple[str, str]:
    file_type = read_gguf_fields(path).get("general.file_type")
    if file_type in GGUF_FILE_TYPES:
        return GGUF_FILE_TYPES[file_type], f"the GGUF's {GGUF_FILE_TYPE_NAMES[file_type]}"
    return FALLBACK, f"the GGUF's file type {file_type} has no counterpart here"


def hf_precision(path: Path) -> tuple[str, str]:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype in HF_DTYPES:
        return HF_DTYPES[dtype], f"the checkpoint's {dtype}"
    return FALLBACK, f"the checkpoint's dtype {dtype} has no counterpart here"
