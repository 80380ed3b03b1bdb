"""Trained models -> HF checkpoint directories (config.json, model.safetensors, tokenizer files).

The format the loader already reads (`model=local model.path=DIR`, `spec.draft_model=DIR`) and that
`transformers` reads too, so a trained draft or from-scratch pair needs no format of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from inferlab.model.config import ModelConfig
from inferlab.model.tokenizer import Tokenizer
from inferlab.model.transformer import Transformer


def hf_config(config: ModelConfig) -> dict:
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_seq_len,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.qkv_bias,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if config.rope_scaling:
        out["rope_scaling"] = dict(config.rope_scaling)
    return out


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """Our fused wqkv / w13 rows split back into HF's q/k/v and gate/up projections."""
    c = model.config
    q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        state["lm_head.weight"] = model.output.weight
    for i, layer in enumerate(model.layers):
        hf = f"model.layers.{i}."
        state[hf + "input_layernorm.weight"] = layer.attention_norm.weight
        state[hf + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
        for name, w in zip("qkv", layer.attention.wqkv.weight.split((q_size, kv_size, kv_size))):
            state[f"{hf}self_attn.{name}_proj.weight"] = w
        if c.qkv_bias:
            for name, b in zip("qkv", layer.attention.wqkv.bias.split((q_size, kv_size, kv_size))):
                state[f"{hf}self_attn.{name}_proj.bias"] = b
        state[hf + "self_attn.o_proj.weight"] = layer.attention.wo.weight
        gate, up = layer.feed_forward.w13.weight.chunk(2)
        state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"] = gate, up
        state[hf + "mlp.down_proj.weight"] = layer.feed_forward.w2.weight
    return {k: v.detach().float().cpu().contiguous() for k, v in state.items()}


def save_checkpoint(
    model: Transformer, tokenizer: Tokenizer, path: Path, metadata: dict[str, str] | None = None
) -> Path:
    """Write `path/` whole: files go to a sibling temp dir first, so a reader never sees half a checkpoint."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(hf_config(model.config), indent=2))
    save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata=metadata or {})
    tokenizer.backend.save(str(tmp / "tokenizer.json"))
    eos = sorted(tokenizer.eos_ids)
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": tokenizer.add_bos,
                "chat_template": tokenizer.chat_template,
                "bos_token": tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else None,
                "eos_token": tokenizer.token_text(eos[0]) if eos else None,
            },
            indent=2,
        )
    )
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": tokenizer.bos_id, "eos_token_id": eos}))
    if path.exists():
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    tmp.rename(path)
    return path


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
