"""Speculative decoding against references: greedy recomputation, exact target distributions, fresh prefills."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_model

from inferlab.engine.model_runner import SlotRunner
from inferlab.engine.sampling import SamplingParams, probabilities
from inferlab.engine.spec import acceptance
from inferlab.engine.spec.draft_model import ModelDrafter
from inferlab.engine.spec.proposers import NgramDrafter, lookup_continuation
from inferlab.engine.spec.session import Speculation, speculative_generate
from inferlab.model.transformer import Transformer
from inferlab.quant.self_draft import self_draft

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [1, 2, 3],
    [200, 17, 5, 99, 42, 7],
    [65, 66, 67, 65, 66, 67, 65, 66],
    [250] * 5,
    list(range(30, 50)),
    [10, 20, 10, 20, 10, 20, 30],
    [128, 3, 3, 3, 9],
]


def perturbed(model: Transformer, scale: float, seed: int) -> Transformer:
    """A draft that mostly agrees with `model`: the same weights plus noise."""
    draft = tiny_model(0)
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return draft.eval()


@torch.inference_mode()
def greedy_reference(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding by full recomputation: no cache involved."""
    ids = list(prompt)
    for _ in range(n):
        tokens = torch.tensor([ids])
        ids.append(int(model(tokens, torch.arange(len(ids)).unsqueeze(0))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0)


@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_greedy_matches_target_only(target, K):
    draft = perturbed(target, 0.03, seed=1)
    calls = tokens = 0
    for prompt in PROMPTS:
        want = greedy_reference(target, prompt, 24)
        assert speculative_generate(target, NgramDrafter(max_n=3), prompt, K=K, max_new_tokens=24).tokens == want
        result = speculative_generate(target, draft, prompt, K=K, max_new_tokens=24)
        assert result.tokens == want
        calls, tokens = calls + result.stats.target_calls, tokens + len(result.tokens)
    assert calls < tokens


def test_identical_draft_accepts_everything(target):
    result = speculative_generate(target, target, PROMPTS[1], K=4, max_new_tokens=26)
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.target_calls == 6  # the prompt (its first token), then 5 rounds of 4 drafts + 1 bonus
    assert result.stats.accepted == 20
    assert result.tokens == greedy_reference(target, PROMPTS[1], 26)


def test_eos_ends_generation(target):
    want = greedy_reference(target, PROMPTS[0], 20)
    eos = want[7]
    result = speculative_generate(target, perturbed(target, 0.03, 1), PROMPTS[0], K=4, max_new_tokens=20, eos_ids={eos})
    assert result.finish_reason == "stop" and result.tokens == want[: want.index(eos)]


def test_lookup_continuation_prefers_longest_latest_match():
    context = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    assert lookup_continuation(context, 3, 1, 3) == [9, 2, 3]  # the 3-gram [1, 2, 3] matched at 0
    assert lookup_continuation(context, 2, 1, 2) == [8, 7]  # the 2-gram [2, 3] matched latest at 4
    assert lookup_continuation([5, 6, 7], 4, 1, 3) == []
    assert lookup_continuation([4, 4], 3, 1, 3) == [4]


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_rollback_leaves_no_stale_kv(target, drafter_kind):
    """After rounds with rejections, both caches equal a fresh prefill of the accepted tokens."""
    drafter = ModelDrafter(perturbed(target, 0.08, 2)) if drafter_kind == "model" else NgramDrafter()
    prompt = PROMPTS[2]
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=3)
    session = Speculation(drafter, 4).start(target, prompt, params, 40, params.make_generator(torch.device("cpu")))
    while len(session.tokens) < 30:
        session.step()
    assert session.stats.accepted < session.stats.proposed  # there were rejections to roll back
    context = prompt + session.tokens
    runners = [session.sequence] + ([session.draft.runner] if drafter_kind == "model" else [])
    for runner in runners:
        fresh = SlotRunner.alone(runner.model, 80)
        n = runner.length
        fresh.forward(context[:n])
        torch.testing.assert_close(runner.cache.k[:, :, :, :n], fresh.cache.k[:, :, :, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(runner.cache.v[:, :, :, :n], fresh.cache.v[:, :, :, :n], atol=1e-5, rtol=1e-4)
        # continuing the rolled-back cache gives what a full recomputation of the sequence gives
        continued = runner.forward(context[n:])[-1]
        full = runner.model(torch.tensor([context]), torch.arange(len(context)).unsqueeze(0))[0, -1]
        torch.testing.assert_close(continued, full, atol=1e-4, rtol=1e-4)


# ---- the output distribution is the target's ----------------------------------------------------


def chi_square_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    """Pearson's test, with cells expecting fewer than 5 samples pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, prob in expected_probs.items():
        expected, observed = prob * n, counts.get(key, 0)
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
        else:
            stat, cells = stat + (observed - expected) ** 2 / expected, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    assert sum(counts.values()) == n and set(counts) <= set(expected_probs)  # nothing outside the support
    return float(
        torch.special.gammaincc(
            torch.tensor((cells - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def toy_model(seed: int, n_layers: int = 1) -> Transformer:
    """Vocabulary of 4 and large weights: peaked, far-apart distributions, every sequence enumerable."""
    model = tiny_model(seed, vocab_size=4, dim=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, hidden_dim=32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(8.0)
    return model


@torch.inference_mode()
def exact_sequence_probs(model: Transformer, prompt: list[int], length: int, params: SamplingParams) -> dict:
    """P(sequence) under target-only sampling, by the chain rule over every prefix."""
    out = {}
    for seq in itertools.product(range(model.config.vocab_size), repeat=length):
        ids, prob = list(prompt), 1.0
        for token in seq:
            logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))[0, -1]
            prob *= float(probabilities(logits, params)[token])
            ids.append(token)
        out[seq] = prob
    return out


def sample_sequences(target, drafter, prompt, n_samples: int, length: int, K: int, **kw) -> dict:
    counts: dict = {}
    for seed in range(n_samples):
        tokens = tuple(
            speculative_generate(target, drafter, prompt, K=K, max_new_tokens=length, seed=seed, **kw).tokens
        )
        counts[tokens] = counts.get(tokens, 0) + 1
    return counts


TOY_PROMPT = [1, 2, 1, 2, 3, 1]
N_TOY = 800  # biased rules land near p = 1e-25 and below at this size


@pytest.fixture(scope="module")
def toy_pair() -> tuple[Transformer, Transformer, dict]:
    target, draft = toy_model(11, n_layers=2), toy_model(12)
    return target, draft, exact_sequence_probs(target, TOY_PROMPT, 3, SamplingParams(max_new_tokens=3, temperature=1.0))


@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "self-int8-adaptive", "self-int8-subset", "model-adaptive"])
def test_sequence_distribution_equals_target(toy_pair, drafter_kind):
    """Also with K chosen per round from the acceptance so far and drafting stopped at unsure proposals."""
    target, draft, exact = toy_pair
    drafter = {
        "model": draft,
        "ngram": NgramDrafter(max_n=2),
        "self-int8-adaptive": ModelDrafter(self_draft(target, "int8"), min_confidence=0.6),
        # the draft's head over ids 0 and 1 only: its q is zero at 2 and 3
        "self-int8-subset": ModelDrafter(self_draft(target, "int8", draft_vocab=2)),
        "model-adaptive": ModelDrafter(draft, min_confidence=0.6),
    }[drafter_kind]
    counts = sample_sequences(
        target, drafter, TOY_PROMPT, N_TOY, 3, K=2, temperature=1.0, adaptive=drafter_kind.endswith("adaptive")
    )
    assert chi_square_pvalue(counts, exact, N_TOY) > 1e-3


def accept_too_often(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    return (p_draft / q_draft).sqrt().clamp(max=1.0)


def resample_from_target(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


@pytest.mark.parametrize("rule", ["acceptance_probability", "residual_distribution"])
def test_biased_rule_is_detected(toy_pair, monkeypatch, rule):
    """The same test, run with a deliberately wrong rule, must reject: it has the power to see a bias."""
    biased = {"acceptance_probability": accept_too_often, "residual_distribution": resample_from_target}[rule]
    monkeypatch.setattr(acceptance, rule, biased)
    target, draft, exact = toy_pair
    counts = sample_sequences(target, draft, TOY_PROMPT, N_TOY, 3, K=2, temperature=1.0)
    assert chi_square_pvalue(counts, exact, N_TOY) < 1e-6


@pytest.mark.parametrize(
    "temperature,top_k,top_p,draft_kind",
    [(0.8, 8, 1.0, "perturbed"), (1.3, 0, 0.6, "perturbed"), (0.8, 8, 1.0, "self-int4"), (0.8, 8, 1.0, "self-int8")],
)
def test_first_token_distribution_with_truncation(target, temperature, top_k, top_p, draft_kind):
    """Rejections happen on the full vocabulary of a real-sized model with top-k/top-p applied to p and q;
    spec=self: the target's own weights at int4 / int8 draft."""
    draft = perturbed(target, 0.15, seed=4) if draft_kind == "perturbed" else self_draft(target, draft_kind[5:])
    prompt, n = PROMPTS[1], 800
    params = SamplingParams(max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p)
    with torch.inference_mode():
        p = probabilities(target(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0))[0, -1], params)
    exact = {(t,): float(p[t]) for t in torch.nonzero(p).flatten().tolist()}
    counts: dict = {}
    for seed in range(n):
        first = speculative_generate(
            target, draft, prompt, K=1, max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
        ).tokens[:1]
        counts[tuple(first)] = counts.get(tuple(first), 0) + 1
    assert chi_square_pvalue(counts, exact, n) > 1e-3
