"""GGUF files of real architectures' shapes with random weights, for the speed and memory studies at the sizes people
serve: a shape preset (conf/model/, `source: random`) written as a bf16 Hugging Face checkpoint, then converted by
llama.cpp's own `convert_hf_to_gguf.py` and quantized by its `llama-quantize`, so inferlab and every peer read the
very same bytes. Random weights say nothing about quality: tables that use them say "random weights".

    python -m inferlab.bench.model_files model=smollm2-1.7b formats=[BF16,Q8_0,Q4_1]

needs llama.cpp's tree and tools (`make llama-server` builds them into .cache/llama.cpp) and writes
<cache dir>/models/NAME/NAME.FORMAT.gguf (paths.shape_file), where `model=NAME model.file_format=FORMAT` finds it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from inferlab.errors import ModelLoadError
from inferlab.model.config import ModelConfig
from inferlab.model.gguf_loader import read_gguf_fields
from inferlab.model.loader import locate_package_file
from inferlab.model.tokenizer import Tokenizer
from inferlab.paths import shape_file, source_tree

SHARD_BYTES = 2 << 30  # bf16 bytes per safetensors shard: one shard's tensors are in memory at once
CONVERTED = "BF16"  # the converter's output type; every other format is quantized from it


def llama_cpp_dir() -> Path:
    """$INFERLAB_LLAMA_CPP, else the repository's .cache/llama.cpp (the Makefile's llama-server target)."""
    tree = source_tree()
    return Path(os.environ.get("INFERLAB_LLAMA_CPP") or ((tree or Path.cwd()) / ".cache" / "llama.cpp"))


def make_model_files(spec: dict[str, Any], formats: list[str], seed: int = 0) -> dict[str, Path]:
    """The GGUF file of the preset `spec` (a resolved conf/model group, `source: random`) in each format, made where
    missing; format -> path. The bf16 checkpoint the converter reads is deleted once converted."""
    name = spec["name"]
    if spec.get("source") != "random":
        raise ModelLoadError(f"model {name!r} is not a shape preset (source: random): its weights are its own file")
    tools = llama_cpp_dir()
    converter, quantizer = tools / "src" / "convert_hf_to_gguf.py", tools / "build" / "bin" / "llama-quantize"
    for needed in (converter, quantizer):
        if not needed.exists():
            raise ModelLoadError(f"{needed} not found: run `make llama-server` (builds llama.cpp's tools)")
    out = {fmt: shape_file(name, fmt) for fmt in formats}
    bf16 = shape_file(name, CONVERTED)
    if not bf16.is_file() and any(not path.is_file() for path in out.values()):
        bf16.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=bf16.parent) as checkpoint:
            write_checkpoint(spec, Path(checkpoint), seed)
            _run(
                [sys.executable, str(converter), checkpoint, "--outtype", "bf16", "--outfile", str(bf16) + ".part"],
                {"PYTHONPATH": str(tools / "src" / "gguf-py")},
            )
        os.replace(str(bf16) + ".part", bf16)
    for fmt, path in out.items():
        if not path.is_file():
            _run([str(quantizer), str(bf16), str(path) + ".part", fmt], {})
            os.replace(str(path) + ".part", path)
    return out


def write_checkpoint(spec: dict[str, Any], directory: Path, seed: int) -> None:
    """config.json, bf16 *.safetensors of N(0, 0.02) matrices and unit norms (a shard at a time, so an 8B model
    never exists whole in memory) and the preset's tokenizer as tokenizer.json."""
    config = ModelConfig.from_dict(dict(spec["architecture"]))
    tok = spec["tokenizer"]
    tokenizer = Tokenizer.from_gguf_fields(
        read_gguf_fields(locate_package_file(tok["package"], tok["file"], tok.get("install", "")))
    )
    tokenizer.save_hf_dir(directory, config.max_seq_len)
    (directory / "config.json").write_text(json.dumps(hf_config(config, tokenizer), indent=1))
    generator = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}

    def flush() -> None:
        file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, file))
        shard.clear()

    for tensor_name, shape in hf_shapes(config):
        if tensor_name.endswith("norm.weight"):
            shard[tensor_name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            shard[tensor_name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    weight_map = {"metadata": {}, "weight_map": index}
    (directory / "model.safetensors.index.json").write_text(json.dumps(weight_map, indent=1))


def hf_config(config: ModelConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """The Llama config.json of the preset's shape."""
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim or config.dim // config.n_heads,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": min(tokenizer.eos_ids) if tokenizer.eos_ids else None,
    }
    if config.rope_scaling:
        hf["rope_scaling"] = dict(config.rope_scaling)
    return hf


def hf_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Each tensor of a Llama checkpoint of this shape, in the order the converter reads them."""
    head_dim = config.head_dim or config.dim // config.n_heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, config.dim))]
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (config.dim,)),
            (p + "self_attn.q_proj.weight", (config.n_heads * head_dim, config.dim)),
            (p + "self_attn.k_proj.weight", (config.n_kv_heads * head_dim, config.dim)),
            (p + "self_attn.v_proj.weight", (config.n_kv_heads * head_dim, config.dim)),
            (p + "self_attn.o_proj.weight", (config.dim, config.n_heads * head_dim)),
            (p + "post_attention_layernorm.weight", (config.dim,)),
            (p + "mlp.gate_proj.weight", (config.hidden_dim, config.dim)),
            (p + "mlp.up_proj.weight", (config.hidden_dim, config.dim)),
            (p + "mlp.down_proj.weight", (config.dim, config.hidden_dim)),
        ]
    out.append(("model.norm.weight", (config.dim,)))
    if not config.tie_embeddings:
        out.append(("lm_head.weight", (config.vocab_size, config.dim)))
    return out


def _run(command: list[str], env: dict[str, str]) -> None:
    """A tool's run, its output shown as it goes (a 1.7B conversion takes minutes); a failure says what failed."""
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, env={**os.environ, **env}, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise ModelLoadError(
            f"{Path(command[1 if command[0] == sys.executable else 0]).name} failed ({result.returncode})"
        )


def main(argv: list[str] | None = None) -> None:
    """model=NAME (a shape preset) formats=[BF16,Q8_0,Q4_1] seed=0 (Hydra override syntax)."""
    from omegaconf import OmegaConf

    from inferlab.api import compose

    args = sys.argv[1:] if argv is None else argv
    ours = [a for a in args if a.split("=", 1)[0] in ("formats", "seed")]
    cfg = compose("engine", [a for a in args if a not in ours])
    extra = OmegaConf.from_dotlist(ours)
    formats = [str(f) for f in extra.get("formats", ["BF16", "Q8_0", "Q4_1"])]
    spec = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(spec, dict)
    for fmt, path in make_model_files(spec, formats, int(extra.get("seed", 0))).items():
        print(f"{fmt}: {path} ({path.stat().st_size / 2**20:,.0f} MiB)")


if __name__ == "__main__":
    main()
