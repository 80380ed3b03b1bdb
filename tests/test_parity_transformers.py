"""Logit parity with Hugging Face transformers on random-init checkpoints saved with save_pretrained."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from inferlab.model.loader import load_model

from conftest import byte_level_backend

SHAPE = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_theta=10000.0, tie_word_embeddings=False)),
    "llama-tied-llama3-rope": (LlamaForCausalLM, LlamaConfig(
        **SHAPE, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, rope_theta=1000000.0, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    cls, config = CASES[case]
    torch.manual_seed(0)
    reference = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mapping mistake cannot hide behind ones/zeros
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    reference.save_pretrained(tmp_path)
    byte_level_backend().save(str(tmp_path / "tokenizer.json"))

    loaded = load_model({"name": case, "path": str(tmp_path)}, torch.float32, torch.device("cpu"), max_seq_len=256)
    assert loaded.config.qkv_bias == (case == "qwen2")
    assert loaded.config.tie_embeddings == config.tie_word_embeddings
    assert (loaded.config.rope_scaling is not None) == ("llama3" in case)
    tokens = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        actual = loaded.model(tokens, torch.arange(32).unsqueeze(0))
    assert (actual - expected).abs().max() <= 1e-4
