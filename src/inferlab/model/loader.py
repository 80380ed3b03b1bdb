"""Weights into a Transformer, with no network: an HF checkpoint directory, a GGUF file, or random init.

Every path builds the model on the meta device and fills it with `load_state_dict(assign=True)`, so
the weights exist once in memory. Checkpoint q/k/v and gate/up rows are concatenated into the fused
`wqkv` and `w13` projections.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from inferlab.errors import ModelLoadError
from inferlab.model.config import FAMILIES, ModelConfig
from inferlab.model.gguf_loader import load_gguf, read_gguf_fields
from inferlab.model.safetensors_files import SafetensorsFiles
from inferlab.model.tokenizer import Tokenizer
from inferlab.model.transformer import Transformer


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    source: str  # where the weights came from, for logs and reports
    gguf_path: Path | None = None  # the GGUF file, when the weights came from one (int4 imports its blocks)
    stand_ins: list[str] = field(default_factory=list)  # Linears whose weights quant/ has yet to import (leave)


def load_model(
    spec: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    max_seq_len: int,
    seed: int = 0,
    leave: Collection[str] = (),
) -> LoadedModel:
    """`spec` is the resolved `model` config group (conf/model/*.yaml). `leave`: a GGUF's Linears whose parts are all
    of these block types ("Q4_1", "Q4_K", ...) stay undequantized stand-ins (LoadedModel.stand_ins), for quant/ to
    import their blocks (precision=int4: Q4_1; precision=gguf: every type the kernels read)."""
    path = Path(spec["path"]).expanduser() if spec.get("path") else None
    if path is not None and path.is_dir():
        return _finish(*load_hf_dir(path, dtype), f"hf:{path}", None, dtype, device, max_seq_len)
    if path is None and spec["source"] == "gguf_package":
        path = locate_package_file(spec["package"], spec["file"], spec.get("install", ""))
    if path is not None:
        config, state, tokenizer, stand_ins = load_gguf(path, dtype, leave)
        source = f"gguf:{path if spec.get('path') else path.name}"
        loaded = _finish(config, state, tokenizer, source, path, dtype, device, max_seq_len)
        loaded.stand_ins = stand_ins
        return loaded
    if spec["source"] == "random":
        config = ModelConfig.from_dict(dict(spec["architecture"]))
        tokenizer_spec = spec["tokenizer"]
        tok_path = locate_package_file(
            tokenizer_spec["package"], tokenizer_spec["file"], tokenizer_spec.get("install", "")
        )
        tokenizer = Tokenizer.from_gguf_fields(read_gguf_fields(tok_path))
        return _finish(
            config,
            _random_init(config, seed),
            tokenizer,
            f"random-init {spec['name']}",
            None,
            dtype,
            device,
            max_seq_len,
        )
    raise ModelLoadError(f"model {spec.get('name')!r} has no weights: set model.path=DIR (HF checkpoint) or FILE.gguf")


def locate_package_file(package: str, file: str, install_hint: str) -> Path:
    """Find a data file shipped in a pip package without importing the package."""
    found = importlib.util.find_spec(package)
    for location in (found.submodule_search_locations or []) if found else []:
        candidate = Path(location) / file
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{file} not found: package {package!r} is not installed; run `{install_hint}`")


def _finish(
    config: ModelConfig,
    state: dict[str, Tensor],
    tokenizer: Tokenizer,
    source: str,
    gguf_path: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    max_seq_len: int,
) -> LoadedModel:
    config.max_seq_len = min(config.max_seq_len, max_seq_len)
    with torch.device("meta"):
        model = Transformer(config)
    if config.tie_embeddings:
        state.pop("output.weight", None)
    for name in list(state):  # one tensor at a time: never a second copy of the whole model
        state[name] = state[name].to(dtype=dtype, device=device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_embeddings and k == "output.weight")]
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not match the architecture (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.reset_rope()
    return LoadedModel(model.eval(), tokenizer, config, source, gguf_path)


def _random_init(config: ModelConfig, seed: int) -> dict[str, Tensor]:
    """Weights for shape presets: N(0, 0.02) matrices and unit norms, reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(config).state_dict().items()}
    state = {
        k: torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=generator) * 0.02
        for k, s in shapes.items()
    }
    return state


# ---- HF checkpoint directory ---------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_HF_SANDWICH_NAMES = {  # Gemma: post_attention_layernorm is the attention output's norm, the MLP has its own pair
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_HF_QK_NORM_NAMES = {
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
}
_HF_FUSED = {  # ours <- the checkpoint's parts, concatenated by rows: split (Llama) or already fused (Phi-3)
    "attention.wqkv": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.qkv_proj"]),
    "feed_forward.w13": (["mlp.gate_proj", "mlp.up_proj"], ["mlp.gate_up_proj"]),
}


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, Tensor], Tokenizer]:
    """config.json, *.safetensors (read tensor by tensor, each straight into `dtype`) and tokenizer.json."""
    config_file = path / "config.json"
    files = sorted(path.glob("*.safetensors"))
    if not config_file.is_file() or not files:
        raise ModelLoadError(f"{path} is not an HF checkpoint directory (needs config.json and *.safetensors)")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    hf = json.loads(config_file.read_text())
    config = ModelConfig.from_hf(hf)
    norm_offset = FAMILIES[hf.get("model_type", "llama")].get("norm_offset", False)
    raw = SafetensorsFiles(files)

    def get(name: str) -> Tensor:
        if norm_offset and name.endswith("norm.weight"):  # Gemma's norms scale by (1 + w): stored as 1 + w
            return (raw.get(name, torch.float32) + 1).to(dtype)
        return raw.get(name, dtype)

    def fused(prefix: str, splits: tuple[list[str], list[str]], suffix: str) -> Tensor | None:
        """The parts' rows read one after another into the fused tensor: no concatenated copy."""
        for parts in splits:
            names = [f"{prefix}{p}.{suffix}" for p in parts]
            if all(n in raw for n in names):
                shapes = [raw.shape(n) for n in names]
                out = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dtype)
                row = 0
                for n, shape in zip(names, shapes):
                    raw.read_into(n, out[row : row + shape[0]])
                    row += shape[0]
                return out
        return None

    layer_names = dict(_HF_SANDWICH_NAMES if config.sandwich_norms else _HF_LAYER_NAMES)
    if config.qk_norm:
        layer_names.update(_HF_QK_NORM_NAMES)
    state = {"tok_embeddings.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if "lm_head.weight" in raw and not config.tie_embeddings:
        state["output.weight"] = get("lm_head.weight")
    for i in range(config.n_layers):
        hf_layer, ours = f"model.layers.{i}.", f"layers.{i}."
        for src, dst in layer_names.items():
            state[ours + dst] = get(hf_layer + src)
        for dst, splits in _HF_FUSED.items():
            for suffix in ("weight", "bias") if dst == "attention.wqkv" and config.qkv_bias else ("weight",):
                tensor = fused(hf_layer, splits, suffix)
                if tensor is None:
                    raise ModelLoadError(
                        f"{path}: layer {i} has no {' or '.join('+'.join(s) for s in splits)} {suffix}"
                    )
                state[f"{ours}{dst}.{suffix}"] = tensor
    return config, state, Tokenizer.from_hf_dir(path)
