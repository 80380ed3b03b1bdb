"""precision=auto serves each checkpoint in its own format, and the defaults say what they chose."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from inferlab.api import load_engine
from inferlab.model.native_format import native_precision


def gguf_with_file_type(path: Path, file_type: int) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "file_type, precision",
    # 15 Q4_K_M, 17 Q5_K_M, 18 Q6_K, 2 Q4_0, 8 Q5_0: their own blocks; 10 (Q2_K) has no counterpart here
    [
        (0, "fp32"),
        (1, "bf16"),
        (3, "int4"),
        (7, "int8"),
        (32, "bf16"),
        (15, "gguf"),
        (17, "gguf"),
        (18, "gguf"),
        (2, "gguf"),
        (8, "gguf"),
        (10, "fp32"),
    ],
)
def test_a_gguf_runs_in_its_file_type(tmp_path, file_type, precision):
    path = gguf_with_file_type(tmp_path / f"m{file_type}.gguf", file_type)
    chosen, why = native_precision({"path": str(path)})
    assert chosen == precision and "GGUF" in why


@pytest.mark.parametrize("dtype, precision", [("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")])
def test_an_hf_checkpoint_runs_in_its_dtype(tmp_path, dtype, precision):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    assert native_precision({"path": str(tmp_path)}) == (precision, f"the checkpoint's {dtype}")


def test_random_init_runs_in_fp32():
    assert native_precision({"source": "random", "name": "tiny-random"}) == ("fp32", "random init")


def test_the_default_engine_serves_the_default_gguf_as_int4_from_paged_blocks():
    engine = load_engine(device="cpu", **{"cache.max_seq_len": 256})
    line = engine.describe()
    assert "int4 (auto: the GGUF's Q4_1)" in line and "cache=paged" in line and "prefix cache on" in line
    assert engine.config.scheduler.max_running >= 32 and engine.config.dtype.is_floating_point
    explicit = load_engine(precision="int4", device="cpu", **{"cache.max_seq_len": 256})
    prompt = "To be, or not to be"
    assert engine.generate(prompt, max_new_tokens=8).token_ids == explicit.generate(prompt, max_new_tokens=8).token_ids
