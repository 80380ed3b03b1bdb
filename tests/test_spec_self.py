"""spec=self: the target's own weights at int4/int8 as its draft, on the fused step and the portable path."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine, tiny_model
from omegaconf import OmegaConf

from inferlab.api import CONF_DIR
from inferlab.errors import QuantizationError
from inferlab.kernels.build import cpu_gemv_available
from inferlab.quant import quantize_model
from inferlab.quant.int4 import Int4GroupLinear
from inferlab.quant.int8 import Int8Embedding, Int8Linear
from inferlab.quant.self_draft import self_draft

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["abcabcabcab", "the cat sat on the mat; the cat", "xyz", "Speculation pays when the draft agrees"]


def spec_config(name: str, **overrides) -> dict:
    """conf/spec/NAME.yaml as the engine receives it, with `overrides`."""
    return {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "spec" / f"{name}.yaml")), **overrides}


def tied_model(seed: int = 0):
    model = tiny_model(seed)
    model.output.weight = model.tok_embeddings.weight
    return model


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_draft_shares_what_it_does_not_quantize(precision):
    target = tied_model()
    before = {name: t.clone() for name, t in target.state_dict().items()}
    draft = self_draft(target, precision)
    kind = Int4GroupLinear if precision == "int4" else Int8Linear
    assert all(
        isinstance(block.feed_forward.w2, kind) and isinstance(block.attention.wqkv, kind) for block in draft.layers
    )
    assert isinstance(draft.output, Int8Linear) and isinstance(draft.tok_embeddings, Int8Embedding)
    target_ptrs = {t.data_ptr() for t in target.state_dict().values()}
    for name, tensor in draft.state_dict().items():  # float tensors are the target's own, never copies
        assert tensor.dtype != torch.float32 or tensor.data_ptr() in target_ptrs or name.endswith(("scales", "mins")), (
            name
        )
    assert draft.norm.weight is target.norm.weight and draft.rope_cos is target.rope_cos
    for name, tensor in target.state_dict().items():  # the target is left as it was
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_subset_head_holds_the_first_ids_and_the_embedding_all(quant):
    """spec.draft_vocab: the draft's head is the target's first rows at int8; its embedding still covers every id."""
    target = tied_model().to(torch.bfloat16)
    if quant:
        quantize_model(target, quant)
    draft = self_draft(target, "int4", draft_vocab=100)
    assert isinstance(draft.output, Int8Linear) and draft.output.out_features == 100
    want = target.output.dequantize() if quant else target.output.weight.float()
    torch.testing.assert_close(draft.output.dequantize(), want[:100], atol=want.abs().max().item() / 127, rtol=0)
    ids = torch.tensor([0, 99, 100, 256])
    torch.testing.assert_close(draft.tok_embeddings(ids), target.tok_embeddings(ids), atol=0.02, rtol=0.02)
    assert self_draft(target, "int4", draft_vocab=10_000).output.out_features == target.config.vocab_size
    assert target.output.out_features == target.config.vocab_size  # the target is left as it was


@pytest.mark.parametrize("kernels", ["fast", "portable"])
def test_subset_head_engine_greedy_equals_spec_off(tiny_tokenizer, kernels):
    """Lossless at T=0 with the draft proposing its argmax over the first 100 ids only."""
    if kernels == "fast" and not cpu_gemv_available():
        pytest.skip("no AVX2 CPU or no C++ toolchain here")
    plain = tiny_engine(tiny_tokenizer, max_new_tokens=24, kernels=kernels)
    spec = tiny_engine(
        tiny_tokenizer,
        max_new_tokens=24,
        kernels=kernels,
        spec=spec_config("self", draft_vocab=100, adaptive=False, k=4),
    )
    assert spec.speculation.drafter.model.output.out_features == 100
    for prompt in PROMPTS:
        assert spec.generate(prompt).token_ids == plain.generate(prompt).token_ids
    assert spec.stats()["spec_proposed"] > 0


def test_int8_target_shares_its_head_with_an_int4_draft():
    target = tied_model().to(torch.bfloat16)
    quantize_model(target, "int8")
    draft = self_draft(target, "int4")
    assert draft.output is target.output and draft.tok_embeddings is target.tok_embeddings
    assert isinstance(draft.layers[0].feed_forward.w13, Int4GroupLinear)


@pytest.mark.parametrize(
    "target_quant,draft_precision,fix",
    [
        ("int4", "int4", "float or int8 target"),
        ("int4", "int8", "float or int8 target"),
        ("int8", "int8", "draft_precision=int4"),
    ],
)
def test_refused_where_the_draft_reads_no_fewer_bytes(target_quant, draft_precision, fix):
    target = tiny_model(0).to(torch.bfloat16)
    quantize_model(target, target_quant, 32 if target_quant == "int4" else None)
    with pytest.raises(QuantizationError, match=fix) as error:
        self_draft(target, draft_precision)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kernels", ["fast", "portable"])
@pytest.mark.parametrize("quant,draft_precision", [(None, "int4"), (None, "int8"), ("int8", "int4")])
def test_engine_greedy_equals_spec_off(tiny_tokenizer, kernels, quant, draft_precision):
    """Lossless at T=0 against the same target without speculation, the draft decoding through its own
    fused step (fast; its int4 projections on int16 or int8 activation codes, draft_int8_from_rows) or the Python model (portable)."""
    if kernels == "fast" and not cpu_gemv_available():
        pytest.skip("no AVX2 CPU or no C++ toolchain here")
    dtype = torch.bfloat16 if quant else torch.float32
    common = dict(max_new_tokens=24, kernels=kernels, quant=quant, dtype=dtype)
    plain = tiny_engine(tiny_tokenizer, **common)
    for adaptive, int8_from_rows in ((True, 0), (False, 0), (True, 1)):
        config = spec_config(
            "self", draft_precision=draft_precision, adaptive=adaptive, k=4, draft_int8_from_rows=int8_from_rows
        )
        spec = tiny_engine(tiny_tokenizer, **common, spec=config)
        assert (spec.speculation.drafter.fused is not None) == (kernels == "fast")
        for prompt in PROMPTS:
            want, got = plain.generate(prompt), spec.generate(prompt)
            if kernels == "fast" or got.token_ids == want.token_ids:
                assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
            else:  # F.linear's sums depend on how many rows a call has: only a tie at rounding's size may part them
                bound = 0.02 if dtype == torch.bfloat16 else 1e-4  # a few bf16 steps of this model's logits (~2)
                assert rounding_tie(plain, plain.encode_prompt(prompt), want.token_ids, got.token_ids, bound)
        stats = spec.stats()
        assert stats["spec_proposed"] > 0 and stats["spec_accepted"] > 0  # the draft ran, and was right sometimes


def rounding_tie(engine, prompt: list[int], want: list[int], got: list[int], bound: float) -> bool:
    """Whether the two token lists first part where the engine's own logits, after the tokens they share, hold the
    two picks within `bound` of each other (fp32 summation order), not at a real margin."""
    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    logits, seq = engine.prefill(prompt + want[:i])
    seq.release()
    return abs(float(logits[want[i]] - logits[got[i]])) <= bound


def test_draft_cache_after_rollbacks_equals_a_fresh_prefill(tiny_tokenizer):
    """The draft's own KV, written by its fused step a token at a time and rolled back after rejections, is what a
    fresh prefill of the confirmed tokens on the same step writes, up to summation order (a stale entry, the KV
    of another token, would be off by the values' own size)."""
    if not cpu_gemv_available():
        pytest.skip("no AVX2 CPU or no C++ toolchain here")
    from inferlab.engine.model_runner import SlotRunner
    from inferlab.engine.sampling import SamplingParams

    config = spec_config("self", min_confidence=0.0, k=4, draft_int8_from_rows=1)
    engine = tiny_engine(tiny_tokenizer, kernels="fast", spec=config)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=4)
    session = engine.speculation.start(
        engine.model, prompt, params, 40, params.make_generator(torch.device("cpu")), engine.fused
    )
    while len(session.tokens) < 30 or (session.stats.accepted == session.stats.proposed and len(session.tokens) < 36):
        session.step()  # until a rejection has rolled the draft's cache back
    assert session.stats.accepted < session.stats.proposed
    runner = session.draft.runner
    n = runner.length
    fresh = SlotRunner.alone(runner.model, 80, runner.fused)
    fresh.forward((prompt + session.tokens)[:n])
    for got, want in ((runner.cache.k, fresh.cache.k), (runner.cache.v, fresh.cache.v)):
        assert want[:, :, :, :n].abs().mean() > 0.1
        torch.testing.assert_close(got[:, :, :, :n], want[:, :, :, :n], atol=1e-5, rtol=1e-4)
