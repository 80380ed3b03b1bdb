"""Weights moved onto huge pages: the same values, one 2 MiB-aligned arena, ties and parameters kept; KV pools
allocated there."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import tiny_model
from torch import nn

from inferlab.engine.kv.contiguous import KVCache
from inferlab.engine.kv.paged import PagedKVCache
from inferlab.kernels.huge_pages import HUGE_PAGE, move_weights_to_huge_pages, zeros_on_huge_pages

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
    # an untied embedding stays where it is (a step looks up a few of its rows), and so do the rotary tables, which
    # limit_context cuts later: moved, their whole-context originals stayed in the arena
    embedding, rope = model.tok_embeddings.weight, [model.rope_cos, model.rope_sin]
    tensors = [
        t for t in weights + list(model.buffers()) if (tied or t is not embedding) and all(t is not r for r in rope)
    ]
    (arena,) = {t.untyped_storage().data_ptr() for t in tensors}  # one storage holds them all
    assert tied or embedding.untyped_storage().data_ptr() != arena
    assert all(r.untyped_storage().data_ptr() != arena for r in rope)
    first = min(t.data_ptr() for t in tensors)
    assert first % HUGE_PAGE == 0 and moved == sum(-(-t.nbytes // 64) * 64 for t in tensors)
    assert (model.output.weight is model.tok_embeddings.weight) == tied


def test_small_tensors_stay_where_they_are():
    model = tiny_model()
    norm = model.norm.weight
    move_weights_to_huge_pages(model)  # the default threshold: a tiny model's norms are far below it
    assert model.norm.weight is norm


def test_zeros_on_huge_pages_start_a_huge_page_and_are_zeros():
    big = zeros_on_huge_pages((3, HUGE_PAGE // 4 + 5), torch.float32, torch.device("cpu"))
    assert big.shape == (3, HUGE_PAGE // 4 + 5) and big.dtype == torch.float32 and big.is_contiguous()
    assert not big.any()
    if big.data_ptr() % HUGE_PAGE:
        pytest.skip("this system refuses MADV_HUGEPAGE")
    small = zeros_on_huge_pages((4, 8), torch.bfloat16, torch.device("cpu"))  # under one huge page: where torch puts it
    assert small.shape == (4, 8) and small.dtype == torch.bfloat16 and not small.any()


def test_kv_pools_of_both_layouts_lie_on_huge_pages():
    config = tiny_model().config
    paged = PagedKVCache.allocate(config, 4096, 16, torch.bfloat16, torch.device("cpu"))
    contiguous = KVCache(config, 16, 4096, torch.bfloat16, torch.device("cpu"))
    pools = [paged.k, paged.v, contiguous.k, contiguous.v]
    assert all(p.nbytes >= HUGE_PAGE and not p.any() for p in pools)
    if any(p.data_ptr() % HUGE_PAGE for p in pools):
        pytest.skip("this system refuses MADV_HUGEPAGE")


def test_a_view_stays_where_it_is():
    """A view keeps its base: moved, the memory it left would stay resident beside the arena's copy."""
    module = nn.Module()
    base = torch.ones(HUGE_PAGE // 4, 4)
    module.register_buffer("view", base.view(-1, 2, 2))
    module.register_buffer("whole", torch.ones(HUGE_PAGE // 4, 4))
    view = module.view.data_ptr()
    if move_weights_to_huge_pages(module, min_bytes=1) == 0:
        pytest.skip("this system refuses MADV_HUGEPAGE")
    assert module.view.data_ptr() == view and module.whole.data_ptr() % HUGE_PAGE == 0


def test_a_weight_moves_in_parts_and_an_alias_of_it_keeps_its_values(monkeypatch):
    """A weight is copied a part at a time, each part's original pages released as it goes (the largest weight then
    never exists twice); a storage that another tensor shares is copied whole and left as it was, so the alias still
    reads its values, not released pages."""
    monkeypatch.setattr("inferlab.kernels.huge_pages.RELEASE_BYTES", 3 * 4096 + 64)  # parts across page boundaries
    module = nn.Module()
    module.sole = nn.Parameter(torch.randn(HUGE_PAGE // 4 + 7), requires_grad=False)
    module.shared = nn.Parameter(torch.randn(HUGE_PAGE // 4 + 7), requires_grad=False)
    alias = module.shared.detach()  # another tensor on the same storage
    want = {name: p.clone() for name, p in module.named_parameters()}
    if move_weights_to_huge_pages(module) == 0:
        pytest.skip("this system refuses MADV_HUGEPAGE")
    for name, p in module.named_parameters():
        assert torch.equal(p, want[name]), name
    assert torch.equal(alias, want["shared"]) and alias.data_ptr() != module.shared.data_ptr()
