"""Strided-window perplexity against token-by-token recomputation, and the offline corpus split/cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from inferlab.bench.perplexity import evaluate_perplexity, windows
from inferlab.errors import InvalidRequestError
from inferlab.train.corpus import VAL_EVERY, documents, load_tokens, split_documents, token_file


def random_ids(n: int) -> torch.Tensor:
    return torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("n, window, stride", [(20, 8, 4), (100, 16, 5), (7, 16, 8), (33, 4, 3)])
def test_windows_score_every_token_once_with_context(n, window, stride):
    spans = windows(n, window, stride)
    scored = [p for _, first, end in spans for p in range(first, end)]
    assert scored == list(range(1, n))
    for i, (begin, first, end) in enumerate(spans):
        assert end - begin <= window and first > begin
        assert i == 0 or first - begin >= window - stride


def test_single_window_equals_full_cross_entropy():
    model, ids = tiny_model(), random_ids(50)
    logits = model(ids[None], torch.arange(50)[None])[0]
    expected = math.exp(F.cross_entropy(logits[:-1], ids[1:]).item())
    assert evaluate_perplexity(model, ids, window=64, stride=16) == pytest.approx(expected, rel=1e-5)


def test_strided_matches_token_by_token_recomputation():
    """Each token p is predicted from exactly the context its window gives it, recomputed alone."""
    model, ids = tiny_model(), random_ids(20)
    contexts = (
        {p: 0 for p in range(1, 8)}
        | {p: 4 for p in range(8, 12)}
        | {p: 8 for p in range(12, 16)}
        | {p: 12 for p in range(16, 20)}
    )  # window 8, stride 4
    nll = 0.0
    for p, begin in contexts.items():
        logits = model(ids[None, begin:p], torch.arange(p - begin)[None])[0, -1]
        nll -= torch.log_softmax(logits, -1)[ids[p]].item()
    assert evaluate_perplexity(model, ids.tolist(), window=8, stride=4) == pytest.approx(math.exp(nll / 19), rel=1e-5)


@pytest.mark.parametrize(
    "window, stride, message",
    [(8, 8, "stride < window"), (8, 0, "stride < window"), (512, 64, "exceeds the model's context")],
)
def test_bad_windows(window, stride, message):
    with pytest.raises(InvalidRequestError, match=message):
        evaluate_perplexity(tiny_model(), random_ids(20), window, stride)


def test_too_few_tokens():
    with pytest.raises(InvalidRequestError, match="at least 2 tokens"):
        evaluate_perplexity(tiny_model(), [5], 8, 4)


@pytest.mark.parametrize("corpus", ["shakespeare", "kjv"])
def test_split_by_document_is_disjoint_and_complete(corpus):
    docs = documents(corpus)
    val, train = split_documents(corpus, "val"), split_documents(corpus, "train")
    assert [name for name, _ in val] == [name for name, _ in docs[::VAL_EVERY]]
    assert sorted(val + train) == sorted(docs)
    assert len(docs) > 30 and not {name for name, _ in val} & {name for name, _ in train}


def test_val_tokens_are_cached_once_and_match_the_tokenizer(tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERLAB_CACHE", str(tmp_path))
    first_doc = split_documents("shakespeare", "val")[0][1]
    ids = load_tokens(tiny_tokenizer, "shakespeare", "val", max_tokens=300)
    assert ids.dtype == torch.int64 and ids.tolist() == tiny_tokenizer.encode(first_doc)[:300]
    path = token_file(tiny_tokenizer, "shakespeare", "val")
    assert path.parent.parent == tmp_path / "corpus" and path.stat().st_size == 2 * len(
        load_tokens(tiny_tokenizer, "shakespeare", "val")
    )


def test_unknown_corpus():
    with pytest.raises(InvalidRequestError, match="unknown corpus"):
        documents("wikipedia")
