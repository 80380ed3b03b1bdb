"""INT8 KV on the real default model: the greedy tokens stay with the full-precision KV's.

Measured here (default precision: the GGUF's Q4_1 blocks, bf16 KV against int8 KV), teacher-forced on the
full-precision greedy text of six prompts: 338 of 347 greedy tokens the same (every prompt >= 95%), logit
cosine >= 0.993 at every position, and each differing token a near tie (its logit within 0.25 of the top).
Free-running, a near tie then takes the text elsewhere: two of those six prompts kept all 64 tokens.

The cosine floor is int8 rounding itself, and it depends on the text: once int4 prompts ran on the fused step
the reference greedy text of "Shall I compare thee..." changed, and on it the 10th position reads 0.9889 (bf16
KV against fp32 KV: 1.0000 there). Both routes write the same int8 codes and scales (checked bit for bit); the
Python model's route reads 0.9867 on that text. Attending each step's own new rows at full precision would
give 0.9936, at the cost of logits that depend on how a prompt is chunked: not done. The text's first token is a
near tie (a newline or not): with the decode attention's scores summed 16 keys at a time (csrc/attention.h, the
same scores to ~1e-7) it starts without the newline, and on that text the 10th position reads 0.9838 (with the
newline: >= 0.998 at every position). Hence 0.98, not 0.99.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from inferlab.api import load_engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "To be, or not to be, that is the question:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Shall I compare thee to a summer's day?",
]
TOKENS = 64
OVERRIDES = {"device": "cpu", "cache.kv_budget_mb": 32}


@functools.cache
def engine(kv_dtype: str):
    return load_engine(**OVERRIDES, **{"cache.kv_dtype": kv_dtype})


def teacher_forced_logits(kv_dtype: str, prompt: str, tokens: list[int]) -> list[torch.Tensor]:
    """The logits before each of `tokens`, with those tokens fed in whatever this engine would pick."""
    e = engine(kv_dtype)
    logits, seq = e.prefill(e.tokenizer.encode(prompt), reserve_tokens=len(tokens))
    out = []
    for token in tokens:
        out.append(logits.float())
        logits = e.decode_step(token, seq)
    seq.release()
    return out


def test_int8_kv_keeps_the_greedy_tokens_of_the_full_precision_kv():
    assert "in int8" in engine("int8").describe() and "in int8" not in engine("auto").describe()
    same = total = 0
    for prompt in PROMPTS:
        tokens = engine("auto").generate(prompt, max_new_tokens=TOKENS, temperature=0).token_ids
        full, int8 = (teacher_forced_logits(kv, prompt, tokens) for kv in ("auto", "int8"))
        agree = 0
        for step, (e, g) in enumerate(zip(full, int8)):
            assert F.cosine_similarity(e, g, dim=0) >= 0.98, (prompt, step)
            picked = int(g.argmax())
            agree += picked == int(e.argmax())
            assert e[picked] >= e.max() - 0.5, (prompt, step)  # a different pick only at a near tie
        assert agree >= 0.9 * len(tokens), prompt
        same, total = same + agree, total + len(tokens)
    assert same >= 0.95 * total
