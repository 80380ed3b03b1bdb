"""On a CUDA device (skipped without one): the engine's caches, batching loop, weight formats, speculation and
server give what the same model gives without them: each greedy token is the argmax of a full recompute on the
same device (but for a near tie at the format's resolution), fp32 gives the CPU's portable tokens exactly, and
a loaded checkpoint matches transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_level_backend, tiny_engine
from test_parity_transformers import MAX_SEQ_LEN, NEW, PROMPT, reference_model
from test_server import client_for, sse_payloads
from test_spec_self import spec_config

from inferlab import load_engine
from inferlab.engine.kv.int8 import KV_INT8
from inferlab.model.transformer import causal_attend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
PROMPTS = [
    [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 23, 11)
]
FORMATS = {  # name -> (dtype, quant, near-tie margin in logits)
    "fp32": (torch.float32, None, 1e-4),
    "bf16": (torch.bfloat16, None, 0.1),
    "fp16": (torch.float16, None, 0.02),
    "int8": (torch.float32, "int8", 0.02),
    "int4": (torch.float32, "int4", 0.02),
    "int4-bf16": (torch.bfloat16, "int4", 0.1),  # aten's CUDA int4pack kernel
}


def assert_greedy_under_recompute(model, prompt: list[int], generated: list[int], tie: float, what: str) -> None:
    """Each generated token is the argmax of the model's own causal forward over everything before it (no
    cache), or within `tie` of it."""
    tokens = torch.tensor([prompt + generated], device=CUDA)
    with torch.inference_mode():
        logits = model(tokens, torch.arange(tokens.shape[1], device=CUDA)[None], causal_attend)[0].float()
    for i, token in enumerate(generated):
        row = logits[len(prompt) - 1 + i]
        assert row[token] >= row.max() - tie, f"{what}: token {i}"


@pytest.mark.parametrize("cache,kv", [("contiguous", "auto"), ("paged", "auto"), ("paged", "int8")])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_batched_greedy_tokens_follow_a_full_recompute(tiny_tokenizer, fmt, cache, kv):
    dtype, quant, tie = FORMATS[fmt]
    kv_dtype = KV_INT8 if kv == "int8" else None
    engine = tiny_engine(
        tiny_tokenizer, cache, slots=2, dtype=dtype, quant=quant, kernels="fast", device=CUDA, kv_dtype=kv_dtype
    )
    if kv_dtype is not None:
        tie = max(tie, 0.1)  # codes per token and head
    completions = engine.generate_batch(PROMPTS, max_new_tokens=12, temperature=0)
    for prompt, completion in zip(PROMPTS, completions):
        assert len(completion.token_ids) == 12
        assert_greedy_under_recompute(engine.model, prompt, completion.token_ids, tie, f"{fmt} {cache} kv={kv}")
    if fmt == "fp32" and kv == "auto":
        cpu = tiny_engine(tiny_tokenizer, cache, slots=2, kernels="portable")
        expected = cpu.generate_batch(PROMPTS, max_new_tokens=12, temperature=0)
        assert [c.token_ids for c in completions] == [c.token_ids for c in expected]


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_spec_self_in_the_batched_loop_gives_spec_off_tokens(tiny_tokenizer, fmt):
    dtype = FORMATS[fmt][0]
    spec = spec_config("self", adaptive=False, k=4)
    plain = tiny_engine(tiny_tokenizer, "paged", dtype=dtype, kernels="fast", device=CUDA)
    speculating = tiny_engine(tiny_tokenizer, "paged", dtype=dtype, kernels="fast", device=CUDA, spec=spec)
    expected = plain.generate_batch(PROMPTS, max_new_tokens=16, temperature=0)
    got = speculating.generate_batch(PROMPTS, max_new_tokens=16, temperature=0)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert speculating.stats()["spec_proposed"] > 0


def test_sampling_on_cuda_is_seeded(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged", kernels="fast", device=CUDA)
    first = engine.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, seed=7).token_ids
    assert engine.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, seed=7).token_ids == first


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_checkpoint_loaded_onto_cuda_matches_transformers(tmp_path, cache):
    reference = reference_model("llama")
    reference.save_pretrained(tmp_path)
    byte_level_backend().save(str(tmp_path / "tokenizer.json"))
    engine = load_engine(
        model="local",
        precision="fp32",
        cache=cache,
        device="cuda",
        **{"model.path": str(tmp_path), "cache.max_seq_len": MAX_SEQ_LEN, "cache.prefix": False},
    )
    assert next(engine.model.parameters()).device.type == CUDA.type
    tokens = torch.randint(0, 256, (1, PROMPT + NEW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        actual = engine.model(tokens.to(CUDA), torch.arange(tokens.shape[1], device=CUDA)[None]).cpu()
    assert (actual - expected).abs().max() <= 1e-4
    completion = engine.generate(tokens[0, :PROMPT].tolist(), max_new_tokens=NEW, temperature=0)
    hf = reference.generate(tokens[:, :PROMPT], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert completion.token_ids == hf[0, PROMPT:].tolist()


def test_the_server_streams_from_a_cuda_engine(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged", kernels="fast", device=CUDA)
    expected = engine.generate("Hello", max_new_tokens=8, temperature=0).text
    with client_for(engine) as client:
        response = client.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True}
        )
    assert response.status_code == 200
    chunks = [p for p in sse_payloads(response.text) if p != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
