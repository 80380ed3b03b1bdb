"""Logit and greedy-token parity with Hugging Face transformers on random-init checkpoints saved with save_pretrained.

One case per family and feature (sliding windows shorter than the test's sequences, soft-caps small
enough to bite, partial rotary, each rope scaling), each run through the fast kernels and the
portable path, over the contiguous and the paged cache.
"""

import pytest
import torch
from conftest import byte_level_backend
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from inferlab import load_engine
from inferlab.kernels.build import cpu_gemv_available
from inferlab.model.loader import load_model

NO_SPECIAL_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # greedy runs the full length
SHAPE = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    head_dim=16,
    **NO_SPECIAL_IDS,
)
MAX_SEQ_LEN, PROMPT, NEW = 64, 20, 12  # the engine's context; a 20-token prompt and 12 greedy tokens
LONGROPE = dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.3, 1.7, 2.2], long_factor=[1.5, 2.5, 4.0, 8.0]
)  # 4 = (head_dim * partial_rotary_factor) / 2 frequencies
GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
}
CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_theta=10000.0, tie_word_embeddings=False)),
    "llama-tied-llama3-rope": (
        LlamaForCausalLM,
        LlamaConfig(
            **SHAPE,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, tie_word_embeddings=False)),
    "mistral-sliding-window": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=8)),
    # no window (v0.2 on), heads narrower than hidden / heads as Mistral Nemo's and Small's: q is 32 wide, not 64
    "mistral-head-dim": (MistralForCausalLM, MistralConfig(**{**SHAPE, "head_dim": 8}, sliding_window=None)),
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config(
            **SHAPE, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=2.0
        ),
    ),
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **SHAPE,
            query_pre_attn_scalar=12,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=GEMMA_ROPE,
        ),
    ),
    "phi3-partial-rotary-longrope-short": (
        Phi3ForCausalLM,
        Phi3Config(
            **SHAPE,
            sliding_window=10,
            rope_parameters={**LONGROPE, "partial_rotary_factor": 0.5, "original_max_position_embeddings": MAX_SEQ_LEN},
        ),
    ),
    "phi3-longrope-long": (
        Phi3ForCausalLM,
        Phi3Config(
            **SHAPE, rope_parameters={**LONGROPE, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 16}
        ),
    ),
}
# the C++ step runs exactly these layers
FUSED_DECODE = {"llama", "llama-tied-llama3-rope", "mistral-head-dim", "qwen2"}


def reference_model(case: str):
    """The case's transformers model, random-init with weights large enough that every feature shows."""
    cls, config = CASES[case]
    torch.manual_seed(0)
    reference = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mapping mistake cannot hide behind ones/zeros
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(4)  # larger weights: soft-caps and windows change the logits by far more than the tolerance
    return reference


def assert_engine_matches(engine, reference, case: str, kernels: str) -> None:
    """Logits of a whole sequence within 1e-4, then the same greedy tokens through the engine's decode path."""
    if case not in FUSED_DECODE:  # the C++ step declines what it cannot run exactly: the Python model decodes
        assert engine.fused is None
    elif kernels == "fast" and engine.config.cache_mode == "contiguous" and cpu_gemv_available():
        assert engine.fused is not None
    tokens = torch.randint(0, 256, (1, PROMPT + NEW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        actual = engine.model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0))
    assert (actual - expected).abs().max() <= 1e-4

    prompt = tokens[:, :PROMPT]
    completion = engine.generate(prompt[0].tolist(), max_new_tokens=NEW, temperature=0)
    hf_tokens = reference.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, PROMPT:]
    assert completion.token_ids == hf_tokens.tolist()


def local_engine(path, kernels: str, cache: str):
    return load_engine(
        model="local",
        precision="fp32",
        cache=cache,
        device="cpu",
        **{
            "model.path": str(path),
            "device.kernels": kernels,
            "cache.max_seq_len": MAX_SEQ_LEN,
            "cache.prefix": False,
            "cache.kv_budget_mb": 1,
        },
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    reference = reference_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    byte_level_backend().save(str(path / "tokenizer.json"))
    return request.param, reference, path


def test_config_declares_the_family(checkpoint):
    case, reference, path = checkpoint
    loaded = load_model({"name": case, "path": str(path)}, torch.float32, torch.device("cpu"), MAX_SEQ_LEN)
    config = loaded.config
    assert config.qkv_bias == (case == "qwen2")
    assert config.tie_embeddings == reference.config.tie_word_embeddings
    assert config.qk_norm == (case in ("qwen3", "gemma3"))
    assert config.sandwich_norms == case.startswith("gemma")
    assert config.rotary_dim == (8 if case.startswith("phi3") else reference.config.head_dim)
    assert (config.window(0) is not None) == (
        case in ("mistral-sliding-window", "gemma2", "gemma3", "phi3-partial-rotary-longrope-short")
    )
    assert config.llama_layer == (case in FUSED_DECODE)


@pytest.mark.parametrize(
    "kernels,cache", [("fast", "contiguous"), ("fast", "paged"), ("portable", "contiguous"), ("portable", "paged")]
)
def test_logits_and_greedy_tokens_match_transformers(checkpoint, kernels, cache, one_thread):
    case, reference, path = checkpoint
    assert_engine_matches(local_engine(path, kernels, cache), reference, case, kernels)
