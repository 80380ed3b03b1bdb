"""The shape presets' GGUF files (bench/model_files.py): a bf16 checkpoint of the preset's shape that llama.cpp's
converter turns into the very weights inferlab then loads from the GGUF, and the presets' shapes are the real
architectures' (parameter counts as published)."""

import os
import subprocess
import sys

import pytest
import torch

from inferlab.api import compose
from inferlab.bench.model_files import hf_shapes, llama_cpp_dir
from inferlab.model.config import ModelConfig
from inferlab.model.loader import load_hf_dir, load_model

PUBLISHED = {"smollm2-360m": 361_821_120, "smollm2-1.7b": 1_711_376_384, "llama-3.1-8b": 8_030_261_248}  # safetensors


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_real_architectures_parameter_counts(name):
    spec = compose("engine", [f"model={name}"]).model
    config = ModelConfig.from_dict(dict(spec.architecture))
    params = sum(torch.Size(shape).numel() for _, shape in hf_shapes(config))
    assert params == PUBLISHED[name]


tools = llama_cpp_dir()


@pytest.mark.skipif(
    not (tools / "build" / "bin" / "llama-quantize").exists(),
    reason="llama.cpp's tools are not built (make llama-server)",
)
def test_converted_file_holds_the_checkpoints_weights(tmp_path):
    env = {**os.environ, "INFERLAB_CACHE": str(tmp_path)}
    made = subprocess.run(
        [sys.executable, "-m", "inferlab.bench.model_files", "model=tiny-random", "formats=[BF16]"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stdout[-2000:]
    os.environ["INFERLAB_CACHE"] = str(tmp_path)
    try:
        spec = compose("engine", ["model=tiny-random", "model.file_format=BF16"]).model
        loaded = load_model(dict(spec), torch.bfloat16, torch.device("cpu"), None)
    finally:
        del os.environ["INFERLAB_CACHE"]
    # the same checkpoint, written again from the same seed, read by inferlab's own HF loader
    from inferlab.bench.model_files import write_checkpoint

    write_checkpoint(dict(compose("engine", ["model=tiny-random"]).model), tmp_path / "hf", seed=0)
    _, state, _ = load_hf_dir(tmp_path / "hf", torch.bfloat16)
    ours = loaded.model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name  # the converter's q/k row permutation undone exactly
