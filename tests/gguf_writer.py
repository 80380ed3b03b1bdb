"""Write a transformers model as a GGUF file the way llama.cpp's converter lays it out (names, fusions,
q/k row interleaving for llama, Gemma's norms as 1 + w, rope factors as tensors), with gguf's GGUFWriter."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

GGUF_ARCH = {  # HF model_type -> general.architecture (llama.cpp converts Mistral as Llama, q/k rows interleaved)
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
GEMMA_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotate-half pairs interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, vocab: dict) -> Path:
    """`vocab`: tokenizer.ggml.* fields (model, tokens, token_type, merges or scores, special ids)."""
    c = model.config
    arch = GGUF_ARCH[c.model_type]
    gemma = arch.startswith("gemma")
    writer = gguf.GGUFWriter(str(path), arch)
    n_heads, head_dim = c.num_attention_heads, c.head_dim
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if getattr(c, "sliding_window", None):
        writer.add_sliding_window(c.sliding_window)
    if gemma:
        writer.add_float32(f"{arch}.attention.scale", c.query_pre_attn_scalar**-0.5)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(c, key, None):
                writer.add_float32(f"{arch}.{key}", getattr(c, key))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    tensors: dict[str, np.ndarray] = {}
    if rope.get("rope_type") == "llama3":  # as the converter does: the divisors llama3 scaling applies
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c)
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        tensors["rope_freqs.weight"] = (base / scaled).numpy()
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        factor = c.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors["token_embd.weight"] = state["model.embed_tokens.weight"]
    tensors["output_norm.weight"] = state["model.norm.weight"] + (1 if gemma else 0)
    if not c.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        hf, g = f"model.layers.{i}.", f"blk.{i}."
        for src, dst in (GEMMA_NORMS if gemma else NORMS).items():
            if hf + src + ".weight" in state:
                tensors[g + dst + ".weight"] = state[hf + src + ".weight"] + (1 if gemma else 0)
        for src, dst in LINEARS.items():
            if hf + src + ".weight" in state:
                w = state[hf + src + ".weight"]
                if arch == "llama" and dst in ("attn_q", "attn_k"):
                    w = permute(w, n_heads if dst == "attn_q" else c.num_key_value_heads)
                tensors[g + dst + ".weight"] = w
            if hf + src + ".bias" in state:  # Qwen2's q/k/v biases
                tensors[g + dst + ".bias"] = state[hf + src + ".bias"]
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    return finish(writer, vocab, path)


def finish(writer: gguf.GGUFWriter, vocab: dict, path):
    """Add the vocabulary, write the file and close it; returns `path`."""
    add_vocab(writer, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_vocab(writer: gguf.GGUFWriter, vocab: dict) -> None:
    writer.add_tokenizer_model(vocab["model"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    if vocab.get("merges"):
        writer.add_token_merges(vocab["merges"])
    for key in ("bos", "eos", "unk"):
        if vocab.get(key) is not None:
            getattr(writer, f"add_{key}_token_id")(vocab[key])
    if "add_bos" in vocab:
        writer.add_add_bos_token(vocab["add_bos"])
    if vocab.get("chat_template"):
        writer.add_chat_template(vocab["chat_template"])


def byte_level_vocab(backend) -> dict:
    """tokenizer.ggml.* for a `tokenizers` byte-level BPE: its tokens in id order, added tokens as control."""
    size = backend.get_vocab_size(with_added_tokens=True)
    tokens = [backend.id_to_token(i) for i in range(size)]
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return {
        "model": "gpt2",
        "tokens": tokens,
        "token_type": [3 if i in special else 1 for i in range(size)],
        "merges": [],
        "eos": min(special) if special else None,
    }
