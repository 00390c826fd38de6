"""Triton top-k / candidate blocks vs ops.indexer.select_topk / candidate_block_mask (bit-exact).

Every case compares the kernel's indices with the reference on the SAME scores, so equality
is exact: ties to the lower index, ascending order, -1 fill, -inf/NaN never selected.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops.indexer import candidate_block_mask, select_topk
from deepinfer_vllm.ops.paged_indexer import block_scores as ref_block_scores
from deepinfer_vllm.ops.paged_indexer import candidate_mask_from_blocks
from deepinfer_vllm.ops.paged_indexer import topk_indices as ref_topk
from deepinfer_vllm.ops.triton.topk import (
    block_scores,
    candidate_blocks,
    choose_block_reduction,
    choose_reg_reduction,
    reg_fits,
    topk_indices,
)

from conftest import poison_, shapes

NEG, INF, NAN = float("-inf"), float("inf"), float("nan")


def _scores(kind: str, T: int, N: int, g: torch.Generator) -> torch.Tensor:
    if kind == "randn":
        return torch.randn(T, N, generator=g)
    if kind == "bf16":  # the model's scores: bf16 values, ties at bf16 resolution
        return (torch.randn(T, N, generator=g) * 3).to(torch.bfloat16).float()
    if kind == "ties":  # a handful of values, -inf holes
        s = torch.randint(-3, 4, (T, N), generator=g).float() * 0.5
        s[s == -1.5] = NEG
        return s
    if kind == "special":  # +inf, NaN, -0.0 vs +0.0, -inf, huge
        s = torch.randn(T, N, generator=g)
        r = torch.rand(T, N, generator=g)
        s[r < 0.05] = INF
        s[(r >= 0.05) & (r < 0.15)] = NAN
        s[(r >= 0.15) & (r < 0.3)] = NEG
        s[(r >= 0.3) & (r < 0.4)] = -0.0
        s[(r >= 0.4) & (r < 0.5)] = 0.0
        s[(r >= 0.5) & (r < 0.52)] = torch.finfo(torch.float32).max
        return s
    if kind == "ascending":  # adversarial for the block-maximum filter
        return torch.arange(N, dtype=torch.float32).repeat(T, 1) + torch.rand(T, 1, generator=g)
    if kind == "descending":
        return -torch.arange(N, dtype=torch.float32).repeat(T, 1)
    if kind == "equal":
        return torch.full((T, N), 1.25)
    if kind == "neginf":
        return torch.full((T, N), NEG)
    if kind == "sparse":  # fewer selectable entries than k
        s = torch.full((T, N), NEG)
        s[:, ::37] = torch.randn(T, len(range(0, N, 37)), generator=g)
        return s
    raise ValueError(kind)


def _check(scores, k, lengths=None, **kw):
    out = poison_(torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device))
    got = topk_indices(scores, k, lengths, out=out, **kw)
    want = ref_topk(scores.cpu(), k, None if lengths is None else lengths.cpu())
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu().long(), want), (got.cpu(), want)


KINDS = ["randn", "bf16", "ties", "special", "ascending", "descending", "equal", "neginf", "sparse"]
METHODS = ["reg", "stream"]


@pytest.mark.parametrize("method", [None, "stream"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "T,N,k",
    shapes(
        small=[(1, 1, 1), (3, 7, 4), (3, 512, 4), (2, 513, 1), (3, 4096, 4), (2, 4096, 512), (1, 2048, 2048)],
        large=[(64, 4096, 512), (256, 513, 512), (3, 131072, 512), (64, 131072, 2048), (256, 16384, 2048)],
    ),
)
def test_topk_matches_select_topk(device, kind, T, N, k, method):
    g = torch.Generator().manual_seed(T * 7919 + N * 31 + k)
    _check(_scores(kind, T, N, g).to(device), k, method=method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("s1", [1, 2, 8, 32])
@pytest.mark.parametrize("kind", ["bf16", "ties", "ascending", "descending", "special", "sparse"])
def test_topk_forced_block_reduction(device, s1, kind, method):
    """Every path (radix over the row / block maxima + survivors / top-k blocks) on the same rows."""
    g = torch.Generator().manual_seed(s1)
    T, N = 3, 3000 if device.type == "cpu" else 40000
    s = _scores(kind, T, N, g).to(device)
    for k in (1, 4, 100):
        if method == "reg" and not reg_fits(N, k, s1):
            continue
        _check(s, k, method=method, s1=s1, block=1024)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dbits", [4, 5, 6, 8])
def test_topk_digit_widths(device, dbits, method):
    g = torch.Generator().manual_seed(dbits)
    s = _scores("bf16", 2, 2500, g).to(device)
    _check(s, 37, method=method, dbits=dbits, s1=1)
    _check(s, 37, method=method, dbits=dbits, s1=4)


@pytest.mark.parametrize("kind", ["bf16", "ties", "ascending", "special"])
@pytest.mark.parametrize(
    "T,N,k,s1",
    shapes(small=[(2, 20000, 64, None), (2, 5000, 512, 2)],
           large=[(64, 131072, 512, 8), (64, 131072, 512, 16), (64, 131072, 512, 32), (64, 32768, 512, 4),
                  (64, 16384, 2048, 2), (256, 16384, 512, 4), (8, 524288, 512, None),
                  (256, 8192, 512, None), (256, 16384, 512, None), (64, 65536, 512, None), (64, 16384, 2048, None)]),
)
def test_topk_register_path_reductions(device, kind, T, N, k, s1):
    """The register path's top-k blocks at the block sizes the benchmark may pick as default."""
    g = torch.Generator().manual_seed(N + k)
    _check(_scores(kind, T, N, g).to(device), k, method="reg", s1=s1)


@pytest.mark.parametrize("nw", [4, 8, 16])
def test_topk_register_path_warps(device, nw):
    g = torch.Generator().manual_seed(nw)
    s = _scores("bf16", 3, 4000 if device.type == "cpu" else 16384, g).to(device)
    _check(s, 500, method="reg", num_warps=nw)
    _check(s, 300, method="reg", s1=4, num_warps=nw)


@pytest.mark.parametrize("method,s1", [(None, None), ("stream", None), ("reg", 4)])
@pytest.mark.parametrize("T,N,k", shapes(small=[(5, 300, 16), (4, 4096, 64)], large=[(256, 131072, 512)]))
def test_topk_lengths(device, T, N, k, method, s1):
    g = torch.Generator().manual_seed(N)
    s = _scores("bf16", T, N, g)
    lengths = torch.randint(0, N + 1, (T,), generator=g)
    lengths[0] = 0
    lengths[-1] = N + 5  # longer than the row: clamped
    s_dev = s.to(device)
    if s1 is not None and not reg_fits(N, k, s1):  # long rows: the register path picks its own s1
        s1 = None
    kw = dict(method=method, s1=s1)
    _check(s_dev, k, lengths.to(device), **kw)
    # entries past lengths are never read: NaN there changes nothing
    cols = torch.arange(N)
    poisoned = s.masked_fill(cols >= lengths.view(-1, 1), NAN).to(device)
    assert torch.equal(
        topk_indices(poisoned, k, lengths.to(device), **kw).cpu(),
        topk_indices(s_dev, k, lengths.to(device), **kw).cpu(),
    )


@pytest.mark.parametrize("method,s1", [(None, None), ("stream", None), ("reg", 2)])
def test_topk_int64_and_index_map(device, method, s1):
    g = torch.Generator().manual_seed(9)
    T, nb, B = 4, 24, 8
    s = _scores("ties", T, nb * B, g)
    kept = torch.sort(torch.randperm(200, generator=g)[:nb]).values.repeat(T, 1)
    kept[1, 20:] = -1
    s[1, 20 * B :] = NEG  # compact columns of -1 blocks are -inf
    out = poison_(torch.empty(T, 11, dtype=torch.int64, device=device))
    got = topk_indices(s.to(device), 11, index_map=kept.to(device), map_block=B, index_dtype=torch.int64,
                       out=out, method=method, s1=s1)
    want = ref_topk(s, 11, index_map=kept, map_block=B)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("s1", [None, 4])
def test_topk_index_map_reindex_shape(device, s1):
    """Reindex layers' shape: top-512 over 2048 kept blocks of 8 (block-max path with a map too)."""
    g = torch.Generator().manual_seed(11)
    T, nb, B = 3, 2048, 8
    s = _scores("bf16", T, nb * B, g)
    kept = torch.sort(torch.randperm(20000, generator=g)[:nb]).values.repeat(T, 1)
    kept[2, 1500:] = -1
    s[2, 1500 * B :] = NEG
    method = None if s1 is None else "reg"
    got = topk_indices(s.to(device), 512, index_map=kept.to(device), map_block=B, method=method, s1=s1)
    assert torch.equal(got.cpu().long(), ref_topk(s, 512, index_map=kept, map_block=B))


def test_choose_block_reduction():
    assert choose_block_reduction(131072, 512) == 32
    assert choose_block_reduction(32768, 512) == 8
    assert choose_block_reduction(8192, 512) == 2
    assert choose_block_reduction(16384, 2048) == 1
    assert choose_block_reduction(7, 4) == 1
    # the register path: both tiles near 4096 (benchmarks/HISTORY.md, run 11)
    assert choose_reg_reduction(8192, 512) == 8
    assert choose_reg_reduction(16384, 512) == 8
    assert choose_reg_reduction(32768, 512) == 8
    assert choose_reg_reduction(65536, 512) == 16
    assert choose_reg_reduction(131072, 512) == 32
    assert choose_reg_reduction(16384, 2048) == 4
    assert choose_reg_reduction(131072, 2048) == 8  # k * S1 <= REG_MAX
    assert choose_reg_reduction(524288, 512) == 32
    assert choose_reg_reduction(4096, 512) == 1  # S1 = 8 would not halve the row
    assert choose_reg_reduction(2048, 2048) == 1
    assert choose_reg_reduction(1 << 20, 512) is None


@pytest.mark.parametrize("T,N", shapes(small=[(3, 203), (2, 64)], large=[(256, 131072), (64, 32768)]))
def test_block_scores_exact(device, T, N):
    g = torch.Generator().manual_seed(N)
    s = _scores("special", T, N, g)
    visible = torch.randint(0, N + 1, (T,), generator=g)
    visible[0] = 0
    out = block_scores(s.to(device), visible.to(device), 8)
    want = ref_block_scores(s, visible, 8)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize(
    "T,N,topk_blocks",
    shapes(small=[(5, 203, 4), (3, 1000, 16)], large=[(64, 131072, 2048), (256, 32768, 2048)]),
)
@pytest.mark.parametrize("kind", ["bf16", "ties", "special"])
def test_candidate_blocks_exact(device, T, N, topk_blocks, kind):
    g = torch.Generator().manual_seed(N + topk_blocks)
    s = _scores(kind, T, N, g)
    visible = torch.randint(0, N + 1, (T,), generator=g)
    visible[0] = N
    kept = candidate_blocks(s.to(device), visible.to(device), 8, topk_blocks)
    assert kept.shape == (T, topk_blocks)
    mask = candidate_mask_from_blocks(kept.cpu(), visible, N, 8)
    assert torch.equal(mask, candidate_block_mask(s, visible, 8, topk_blocks))
    assert torch.equal(kept.cpu().long(), select_topk(ref_block_scores(s, visible, 8), topk_blocks))
