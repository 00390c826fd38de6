"""The paged indexer reference (ops/paged_indexer.py) against ops/indexer.py on gathered keys."""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.indexer import candidate_block_mask, index_scores, select_topk
from deepinfer_vllm.ops.paged_indexer import (
    block_scores,
    candidate_blocks,
    candidate_mask_from_blocks,
    index_record,
    index_scores_paged,
    index_scores_paged_sparse,
    indexer_topk,
    restore_candidate_indices,
    topk_indices,
)
from deepinfer_vllm.ops.paged_records import write_records

NEG = float("-inf")


def make_paged_keys(g, n_req, n_entries, ratio, block_size, dim=128, pad=40, dtype=torch.float32):
    """Random keys of ``n_req`` requests in a shuffled, padded paged cache.

    Returns ``(cache, block_table, keys [n_req, n_entries, dim] after MXFP4)``; pages have a
    block stride larger than ``N * 68`` and every request's pages are scattered.
    """
    rec = index_record(dim)
    n = block_size // ratio
    pages = -(-n_entries // n)
    num_blocks = n_req * pages + 3
    stride = n * rec.record_bytes + pad
    buf = torch.randint(0, 256, (num_blocks * stride,), generator=g, dtype=torch.uint8)
    rb = rec.record_bytes
    cache = buf.as_strided((num_blocks, 1, n, rb), (stride, n * rb, rb, 1))
    block_table = torch.randperm(num_blocks, generator=g)[: n_req * pages].view(n_req, pages).int()
    raw = torch.randn(n_req, n_entries, dim, generator=g)
    e = torch.arange(n_entries)
    for r in range(n_req):
        first = e * ratio
        blocks = block_table[r, first // block_size].long()
        write_records(cache, rec, blocks, (first % block_size) // ratio, raw[r])
    return cache, block_table, quant.mxfp4_qdq(raw).to(dtype)


@pytest.mark.parametrize("ratio,block_size", [(1, 8), (2, 16), (2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_scores_equal_gathered(ratio, block_size, dtype):
    g = torch.Generator().manual_seed(ratio * 100 + block_size)
    H, E = 3, 37
    cache, bt, keys = make_paged_keys(g, 2, E, ratio, block_size, dtype=dtype)
    token_req = torch.tensor([1, 0, 1, 1, 0])
    visible = torch.tensor([37, 0, 5, 20, 11])
    q = quant.mxfp4_qdq(torch.randn(5, H, 128, generator=g)).to(dtype)
    w = torch.randn(5, H, generator=g).to(dtype)
    got = index_scores_paged(q, w, cache, bt, token_req, visible, ratio, block_size)
    assert got.shape == (5, 37) and got.dtype == torch.float32
    for t in range(5):
        want = index_scores(q[t : t + 1], w[t : t + 1], keys[token_req[t]], visible[t : t + 1])
        assert torch.equal(got[t], want[0])
    # max_visible pads with -inf and never reads past visible
    wide = index_scores_paged(q, w, cache, bt, token_req, visible, ratio, block_size, max_visible=50)
    assert torch.equal(wide[:, :37], got) and bool((wide[:, 37:] == NEG).all())


def test_sparse_scores_match_dense_entries():
    g = torch.Generator().manual_seed(7)
    ratio, bs, E, H = 2, 16, 60, 2
    cache, bt, keys = make_paged_keys(g, 2, E, ratio, bs)
    token_req = torch.tensor([0, 1, 1])
    visible = torch.tensor([60, 33, 0])
    q = quant.mxfp4_qdq(torch.randn(3, H, 128, generator=g))
    w = torch.randn(3, H, generator=g)
    cand = torch.tensor([[0, 3, 7, -1], [1, 4, 5, -1], [0, -1, -1, -1]])
    got = index_scores_paged_sparse(q, w, cache, bt, token_req, visible, ratio, bs, cand, 8)
    dense = index_scores_paged(q, w, cache, bt, token_req, visible, ratio, bs, max_visible=64)
    assert got.shape == (3, 32)
    for t in range(3):
        for c in range(32):
            b = int(cand[t, c // 8])
            e = b * 8 + c % 8
            if b < 0 or e >= int(visible[t]):
                assert got[t, c].item() == NEG
            else:  # fp32 islands accumulate in fp64 here: the same value whatever the batching
                assert got[t, c].item() == dense[t, e].item()


def test_topk_indices_lengths_and_map():
    g = torch.Generator().manual_seed(3)
    s = torch.randint(-3, 4, (6, 40), generator=g).float()
    s[s == -3] = NEG
    lengths = torch.tensor([40, 0, 7, 39, 1, 25])
    got = topk_indices(s, 9, lengths)
    cols = torch.arange(40)
    want = select_topk(s.masked_fill(cols >= lengths.view(-1, 1), NEG), 9)
    assert torch.equal(got, want)
    kept = torch.tensor([[1, 2, 4, 6, -1]] * 6)
    s[:, 32:] = NEG  # the compact columns of a -1 block are never selectable
    mapped = topk_indices(s, 9, index_map=kept, map_block=8)
    assert torch.equal(mapped, restore_candidate_indices(select_topk(s, 9), kept, 8))
    ok = mapped >= 0
    assert bool((torch.diff(mapped.masked_fill(~ok, 10**6), dim=1) > 0).all())  # ascending, then -1


def test_candidate_blocks_match_mask():
    g = torch.Generator().manual_seed(11)
    for trial in range(4):
        T, N = 7, 203
        s = torch.randint(-4, 5, (T, N), generator=g).float()
        s[s == -4] = NEG
        s[s == 4] = float("inf")
        if trial == 1:
            s[0, 5] = float("nan")
        visible = torch.randint(0, N + 1, (T,), generator=g)
        for topk_blocks in (1, 3, 10, 40):
            kept = candidate_blocks(s, visible, 8, topk_blocks)
            assert kept.shape == (T, topk_blocks)
            mask = candidate_mask_from_blocks(kept, visible, N, 8)
            assert torch.equal(mask, candidate_block_mask(s, visible, 8, topk_blocks))
    bsc = block_scores(torch.tensor([[1.0, float("inf"), 2.0, NEG, float("nan")]]), torch.tensor([3]), 2)
    assert bsc.tolist() == [[torch.finfo(torch.float32).max, float("inf"), NEG]]


def test_indexer_topk_reference_paths():
    g = torch.Generator().manual_seed(5)
    ratio, bs, E, H = 1, 8, 150, 2
    cache, bt, keys = make_paged_keys(g, 2, E, ratio, bs)
    token_req = torch.tensor([0, 1, 0])
    visible = torch.tensor([150, 96, 17])
    q = quant.mxfp4_qdq(torch.randn(3, H, 128, generator=g))
    w = torch.randn(3, H, generator=g)
    kw = dict(ratio=ratio, block_size=bs, topk=6, candidate_block_size=8, candidate_topk_blocks=4)
    idx, kept = indexer_topk(q, w, cache, bt, token_req, visible, candidate_source=True, **kw)
    scores = index_scores_paged(q, w, cache, bt, token_req, visible, ratio, bs)
    assert torch.equal(idx, select_topk(scores, 6))
    mask = candidate_block_mask(scores, visible, 8, 4)
    assert torch.equal(candidate_mask_from_blocks(kept, visible, scores.shape[1], 8), mask)
    idx2, none = indexer_topk(q, w, cache, bt, token_req, visible, candidates=kept, **kw)
    assert none is None
    assert torch.equal(idx2, select_topk(scores.masked_fill(~mask, NEG), 6))
