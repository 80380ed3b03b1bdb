"""Weights moved onto huge pages: the same values, one 2 MiB-aligned arena, ties and parameters kept."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import tiny_model
from torch import nn

from inferlab.kernels.huge_pages import HUGE_PAGE, move_weights_to_huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


@pytest.mark.parametrize("tied", [False, True])
def test_moved_weights_compute_the_same_logits_from_one_aligned_arena(tied):
    model = tiny_model(tie_embeddings=tied)
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    positions = torch.arange(5)[None]
    with torch.no_grad():
        before = model(tokens, positions)
    moved = move_weights_to_huge_pages(model, min_bytes=1)
    if moved == 0:
        pytest.skip("this system refuses MADV_HUGEPAGE")
    with torch.no_grad():
        assert torch.equal(model(tokens, positions), before)
    weights = list(model.parameters())
    assert all(isinstance(w, nn.Parameter) and w.requires_grad for w in weights)
    tensors = weights + list(model.buffers())  # rope tables too
    (arena,) = {t.untyped_storage().data_ptr() for t in tensors}  # one storage holds them all
    first = min(t.data_ptr() for t in tensors)
    assert first % HUGE_PAGE == 0 and moved == sum(-(-t.nbytes // 64) * 64 for t in tensors)
    assert (model.output.weight is model.tok_embeddings.weight) == tied


def test_small_tensors_stay_where_they_are():
    model = tiny_model()
    norm = model.norm.weight
    move_weights_to_huge_pages(model)  # the default threshold: a tiny model's norms are far below it
    assert model.norm.weight is norm
