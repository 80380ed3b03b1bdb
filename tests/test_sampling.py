"""Sampling against exact distributions, stop strings, and streaming detokenization."""

import pytest
import torch
from conftest import tiny_engine
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from inferlab.engine.loop import last_row_argmax
from inferlab.engine.sampling import SamplingParams, argmax_rows, probabilities, sample
from inferlab.engine.stop import TextStream
from inferlab.errors import InvalidRequestError
from inferlab.model.tokenizer import IncrementalDetokenizer, Tokenizer


def params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=1, **kw)


def test_greedy_is_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, params(), None) == int(torch.argmax(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rows_argmax_is_torchs_and_takes_the_first_of_equal_maxima(dtype):
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, [7, 300]] = 50.0  # a tie: the first index wins, as torch.argmax takes it
    logits[3] = 0.0
    logits[4] = -torch.rand(1000, generator=torch.Generator().manual_seed(2)) - 1.0  # all negative
    logits[4, 500] = -0.5
    logits = torch.cat(
        [logits, torch.tensor([[-0.0, 0.0, -1.0], [float("-inf"), -1e-30, -1e30]]).to(dtype).repeat(1, 334)[:, :1000]]
    )
    assert argmax_rows(logits) == logits.argmax(-1).tolist()
    assert argmax_rows(logits)[1] == 7 and argmax_rows(logits)[3] == 0 and argmax_rows(logits)[4] == 500
    assert argmax_rows(logits)[5:] == [0, 1]  # -0 and +0 are equal maxima; the least negative wins
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(-1).tolist()  # a strided view too


def test_the_loops_argmax_is_each_requests_last_row():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    counts = [1, 0, 3, 2]  # rows per request: one, none (a prompt chunk), drafts' rows...
    assert last_row_argmax(logits, counts) == [
        int(logits[0].argmax()),
        None,
        int(logits[3].argmax()),
        int(logits[5].argmax()),
    ]
    assert last_row_argmax(logits[:2], [1, 1]) == logits[:2].argmax(-1).tolist()
    assert last_row_argmax(logits[:0], [0, 0]) == [None, None]


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    p = probabilities(logits, params(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0, 0.4, 0, 0.3, 0]) / 0.7)
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05 -> cumulative 0.4, 0.7, 0.85: top_p=0.8 keeps the first three
    p = probabilities(logits, params(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0, 0.4, 0, 0.3, 0.15]) / 0.85)
    p = probabilities(logits, params(temperature=1.0, top_p=0.01))  # the top token always survives
    assert torch.equal(p, torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))


def test_temperature_scales_the_distribution():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(probabilities(logits, params(temperature=0.5)), torch.softmax(logits / 0.5, -1))


def test_sampled_frequencies_match_the_distribution():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    p = params(temperature=1.0, seed=0)
    generator = p.make_generator(torch.device("cpu"))
    counts = torch.bincount(torch.tensor([sample(logits, p, generator) for _ in range(4000)]), minlength=4)
    expected = torch.tensor([0.1, 0.2, 0.3, 0.4]) * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # p = 0.001 for 3 degrees of freedom


def test_extreme_logits_stay_finite():
    logits = torch.tensor([1e4, -1e4, float("-inf"), 3e4, 3e4 - 1])
    p = probabilities(logits, params(temperature=0.1, top_p=0.9, top_k=3))
    assert torch.isfinite(p).all() and p.sum().item() == pytest.approx(1.0)
    assert p[3] == 1.0


@pytest.mark.parametrize("top_p", [5e-324, 1e-50, 1e-8, 0.5, 1 - 1e-16, 1.0])
@pytest.mark.parametrize("temperature", [5e-324, 1e-30, 1e-3, 1.0, 2.0])
def test_every_accepted_value_gives_a_distribution_that_keeps_the_top_token(top_p, temperature):
    """Found from outside: top_p=1e-50 rounded to 0 in fp32, dropped every token, and the softmax was nan."""
    generator = torch.Generator().manual_seed(0)
    for logits in (
        torch.randn(300, generator=generator) * 20,
        torch.tensor([3e4, 3e4, -3e4, float("-inf")]),
        torch.randn(300, generator=generator).to(torch.bfloat16),
    ):
        for top_k in (0, 1, 10**9):
            p = params(temperature=temperature, top_p=top_p, top_k=top_k)
            probs = probabilities(logits, p)
            assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0, abs=1e-5)
            assert probs[int(torch.argmax(logits))] > 0
            assert 0 <= sample(logits, p, p.make_generator(torch.device("cpu"))) < logits.shape[-1]


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 2.0])
def test_a_tiny_repetition_penalty_keeps_the_distribution_finite(penalty):
    """Found by schemathesis: repetition_penalty=5e-324 divided seen tokens' logits to inf, and sampling hit nan."""
    from inferlab.engine.logits import process_logits

    logits = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 5
    p = SamplingParams(
        max_new_tokens=4, temperature=1.0, repetition_penalty=penalty, logit_bias={3: 5.0, 10**6: 1.0}, min_tokens=2
    )
    processed = process_logits(logits, p, prompt_ids=[1, 2, 3], output_ids=[4], stop_ids={5, 10**6})
    probs = probabilities(processed, p)
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0, abs=1e-5) and probs[5] == 0


def test_seed_reproduces_and_differs(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer)
    run = lambda seed: engine.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=seed).token_ids
    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize(
    "bad", [dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)]
)
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        params(**bad)
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_new_tokens=0)


def test_detokenizer_streams_multibyte_text_exactly(tiny_tokenizer):
    text = "naïve café — 日本語 🤖 done"
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.push(t) for t in tiny_tokenizer.encode(text)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_text_stream_holds_back_a_partial_stop_and_cuts_at_it(tiny_tokenizer):
    stream = TextStream(tiny_tokenizer, stop=["END"])
    shown = [stream.push(t) for t in tiny_tokenizer.encode("abc EN")]
    assert "".join(d for d, _ in shown) == "abc "  # "EN" may start "END": held back
    assert stream.push(tiny_tokenizer.encode("D")[0]) == ("", True)
    assert stream.text == "abc " and stream.flush() == ""


def test_text_stream_releases_a_stop_prefix_that_did_not_complete(tiny_tokenizer):
    stream = TextStream(tiny_tokenizer, stop=["END"])
    out = "".join(stream.push(t)[0] for t in tiny_tokenizer.encode("x EN"))
    assert out + stream.flush() == "x EN"


def test_generate_stops_at_stop_string():
    # a word-level vocabulary, so whatever a random model emits decodes to visible text ("w12 w7 ...")
    backend = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(257)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    engine = tiny_engine(Tokenizer(backend=backend, bos_id=None, eos_ids={256}))
    full = engine.generate([5, 6, 7], max_new_tokens=16, temperature=0)
    stop = full.text[6:10]
    assert stop and full.finish_reason == "length"
    cut = engine.generate([5, 6, 7], max_new_tokens=16, temperature=0, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
