"""model=local: what a user can get wrong about the files is an error whose first line says what (every case
through load_engine in this process), and inferlab-generate prints that line alone on stderr, exit 2, no traceback
(one case as a subprocess: the console scripts' wrapper, cli.py, prints every InferlabError so)."""

import json
import subprocess
import sys

import gguf
import pytest
from conftest import byte_level_backend
from gguf_writer import add_vocab, byte_level_vocab

from inferlab import load_engine
from inferlab.errors import InferlabError


def generate_with(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferlab.generate", "model=local", f"model.path={path}", "prompt=hi", "device=cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def hf_dir(tmp_path, config: dict, weights: bool = True, tokenizer: bool = True):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if weights:
        import torch
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    if tokenizer:
        byte_level_backend().save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def gguf_file(tmp_path, arch: str):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    add_vocab(writer, byte_level_vocab(byte_level_backend()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "m.gguf"


LLAMA = dict(
    model_type="llama", vocab_size=257, hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1
)
CASES = {
    "missing path": (lambda p: p / "nowhere", "not found"),
    "missing GGUF file": (lambda p: p / "model.gguf", "GGUF file not found"),
    "empty directory": (lambda p: p, "not an HF checkpoint directory"),
    "no weights": (lambda p: hf_dir(p, LLAMA, weights=False), "not an HF checkpoint directory"),
    "no tokenizer": (lambda p: hf_dir(p, LLAMA, tokenizer=False), "no tokenizer.json"),
    "unsupported architecture": (
        lambda p: hf_dir(p, {**LLAMA, "model_type": "mamba"}),
        "unsupported model_type 'mamba'",
    ),
    "quantized checkpoint": (
        lambda p: hf_dir(p, {**LLAMA, "quantization_config": {"quant_method": "gptq"}}),
        "unsupported quantization 'gptq'",
    ),
    "unsupported GGUF architecture": (lambda p: gguf_file(p, "mamba"), "unsupported GGUF architecture 'mamba'"),
    "not a GGUF file": (lambda p: (p / "x.gguf").write_text("hello") and p / "x.gguf", "not a GGUF file"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_errors_say_what_is_wrong_in_their_first_line(case, tmp_path):
    make, expected = CASES[case]
    with pytest.raises(InferlabError) as error:
        load_engine(model="local", device="cpu", **{"model.path": str(make(tmp_path))})
    assert expected in str(error.value).strip().splitlines()[0]


@pytest.mark.slow
def test_the_cli_prints_a_model_error_as_one_line(tmp_path):
    make, expected = CASES["unsupported GGUF architecture"]
    result = generate_with(make(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.stderr
