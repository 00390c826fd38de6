"""Triton indexer scores over the paged MXFP4 cache vs ops.paged_indexer, and the end-to-end top-k.

Scores are not bit-exact (the kernel sums in another order than the einsum reference):
* fp32 scores (``out_dtype=float32``): ``|got - want| <= 1e-5 * S`` where ``S = sum_h |w_h|
  relu(q_h . k)`` bounds every partial sum;
* bf16 scores (the model dtype): at most one bf16 step apart, ``|got - want| <= 2^-7 |want| +
  1e-5 S``, and at least 98 % of them bit-identical;
* the -inf pattern (invisible / non-candidate columns) is identical.
Mode 5 (e4m3 operands on fp8 tensor cores) has the same exact products but Hopper's fp8 wgmma
keeps only ~13 bits of its running sums, so its error is bounded by ``2^-12 * A`` with ``A =
sum_h |w_h| sum_k |q_hk k_jk|``, at least 97 % of its bf16 scores equal those of mode 3 (the same
products with fp32-exact sums) and its top-512 agrees with mode 3's on >= 99.5 % of the indices.
Every decode mode x tile pipeline (``prefetch`` 0 / 1 = L2 prefetch / 2 = registers) is covered.
Selections are exact given the kernel's own scores; against the full reference pipeline at
least 95 % of the selected indices agree (score rounding can reorder near-ties).
"""

from __future__ import annotations

import pytest
import torch

from conftest import INTERPRET, poison_, shapes
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops import paged_indexer as ref
from deepinfer_vllm.ops.triton.indexer import (default_mode, index_scores_paged, index_scores_paged_sparse,
                                               indexer_topk)

NEG = float("-inf")
REC = 68  # MXFP4 record of 128 dims: 64 value bytes + 4 scale bytes


def make_cache(device, g, n_req, max_entries, ratio, block_size, pad=48, scales=(122, 131)):
    """A paged index cache filled with random MXFP4 records (scale bytes in ``scales``).

    Pages are shuffled over the cache and padded (block stride > N * 68); unused pages hold
    garbage (NaN-free). Returns ``(cache, block_table)``.
    """
    n = block_size // ratio
    pages = max(1, -(-max_entries // n))
    num_blocks = n_req * pages + 5
    stride = n * REC + pad
    buf = torch.randint(0, 256, (num_blocks, stride), generator=g, dtype=torch.uint8)
    sc = buf[:, n * 64 : n * REC]
    sc.copy_(torch.randint(scales[0], scales[1], sc.shape, generator=g, dtype=torch.uint8))
    buf = buf.to(device)
    cache = buf.view(-1).as_strided((num_blocks, 1, n, REC), (stride, n * REC, REC, 1))
    perm = torch.randperm(num_blocks, generator=g)[: n_req * pages]
    block_table = perm.view(n_req, pages).to(torch.int32).to(device)
    return cache, block_table


def make_queries(device, g, T, H, dtype):
    q = quant.mxfp4_qdq(torch.randn(T, H, 128, generator=g)).to(dtype)
    w = torch.randn(T, H, generator=g).to(dtype)
    return q.to(device), w.to(device)


def check_scores(got, want, bound, exact_frac, rel_bound=1e-5):
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), "-inf pattern differs"
    assert not torch.isnan(got).any()
    if not fin.any():
        return
    diff = (got[fin] - want[fin]).abs()
    tol = 2.0**-7 * want[fin].abs() + rel_bound * bound[fin] + 1e-30
    assert bool((diff <= tol).all()), f"max excess {(diff - tol).max().item()}"
    frac = (got[fin] == want[fin]).float().mean().item()
    assert frac >= exact_frac, f"only {frac:.4f} identical"


def score_bound(q, w, cache, bt, req, vis, ratio, bs, max_visible=None):
    return ref.index_scores_paged(q.float(), w.float().abs(), cache, bt, req, vis, ratio, bs, torch.float32,
                                  max_visible).clamp_min(0)


# (T, H, requests, max entries, ratio, block_size)
SMALL = [
    (1, 4, 1, 1, 1, 16),
    (3, 4, 2, 40, 2, 16),
    (5, 32, 3, 200, 1, 64),
    (4, 4, 2, 300, 2, 64),
]
LARGE = [
    (256, 32, 256, 8192, 2, 64),
    (64, 32, 64, 32768, 1, 64),
    (8, 32, 8, 131072, 2, 64),
    (128, 32, 16, 16384, 2, 64),  # 8 tokens per request (speculative verification / chunks)
]
# (mode, prefetch)
MODES = [(3, 1), (3, 0), (3, 2), (2, 1), (2, 0)]
MODES += [] if INTERPRET else [(5, 1)]  # 5: Gluon, no interpreter
LARGE_MODES = {(3, 1), (3, 0), (3, 2), (5, 1)}  # the rest: small


def _variant_cases(small, large):
    """(mode, prefetch) x shape; variants outside LARGE_MODES get the small shapes only."""
    return [
        (*m, *shape)
        for m in MODES
        for shape in shapes(small, large)
        if INTERPRET or shape[0] * shape[3] <= 100_000 or m in LARGE_MODES
    ]


def abs_bound(q, w, cache, bt, req, vis, ratio, bs, max_visible=None):
    """``A = sum_h |w_h| sum_k |q_hk k_jk|``: what the error of fp8 wgmma's short running sums
    scales with (mode 5). The keys' magnitudes are the records with their sign bits cleared."""
    n = bs // ratio
    mag = cache.clone()
    mag.as_strided((mag.shape[0], n * 64), (mag.stride(0), 1)).bitwise_and_(0x77)
    return ref.index_scores_paged(q.float().abs(), w.float().abs(), mag, bt, req, vis, ratio, bs, torch.float32,
                                  max_visible).clamp_min(0)


def _bound(mode, q, w, cache, bt, req, vis, ratio, bs, max_visible=None):
    """The bound the mode's fp32 error is checked against (see the module docstring)."""
    fn = abs_bound if mode == 5 else score_bound
    return fn(q, w, cache, bt, req, vis, ratio, bs, max_visible)


def _tols(mode):
    """(factor of ``_bound`` in the fp32 check, identical fraction of the bf16 check) per mode."""
    return (2.0**-12, 0.97) if mode == 5 else (1e-5, 0.98)


def _case(device, T, H, R, E, ratio, bs, seed, scales=(122, 131)):
    g = torch.Generator().manual_seed(seed)
    cache, bt = make_cache(device, g, R, E, ratio, bs, scales=scales)
    req = (torch.arange(T) * R // T).to(device)
    vis = torch.randint(0, E + 1, (T,), generator=g)
    vis[0] = E
    if T > 2:
        vis[1] = 0
    return g, cache, bt, req, vis.to(device)


@pytest.mark.parametrize("mode,prefetch,T,H,R,E,ratio,bs", _variant_cases(SMALL, LARGE))
def test_scores_vs_reference(device, mode, prefetch, T, H, R, E, ratio, bs):
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=T + E)
    for dtype in {2: [torch.float32], 5: [torch.bfloat16]}.get(mode, [torch.bfloat16, torch.float32]):
        q, w = make_queries(device, g, T, H, dtype)
        n_cols = E + 3
        bound = _bound(mode, q, w, cache, bt, req, vis, ratio, bs, n_cols)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = poison_(torch.empty(T, n_cols, dtype=torch.float32, device=device))
            got = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, out_dtype, max_visible=n_cols,
                                     mode=mode, prefetch=prefetch, out=out)
            want = ref.index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, out_dtype, max_visible=n_cols)
            rel, frac = _tols(mode)
            if out_dtype == torch.float32:
                fin = torch.isfinite(want)
                assert torch.equal(fin, torch.isfinite(got))
                assert bool(((got[fin] - want[fin]).abs() <= rel * bound[fin] + 1e-30).all())
            else:
                check_scores(got, want, bound, frac, rel)


@pytest.mark.parametrize("T,H,R,E,ratio,bs", shapes([(4, 4, 2, 300, 2, 16)], [(64, 32, 16, 20000, 2, 64)]))
def test_scores_wide_scale_spread(device, T, H, R, E, ratio, bs):
    """Scale bytes anywhere in 2^-126 .. 2^72: blocks of one key up to 198 binades apart (mode 3
    rescales each key by its largest block and must keep the small blocks' share; mode 5 on
    such keys: ``test_scores_gluon_fp8``)."""
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=11, scales=(1, 200))
    q, w = make_queries(device, g, T, H, torch.bfloat16)
    bound = score_bound(q, w, cache, bt, req, vis, ratio, bs, E)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, out_dtype, max_visible=E, mode=3)
        want = ref.index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, out_dtype, max_visible=E)
        if out_dtype == torch.float32:
            fin = torch.isfinite(want)
            assert torch.equal(fin, torch.isfinite(got))
            assert bool(((got[fin] - want[fin]).abs() <= 1e-5 * bound[fin] + 1e-30).all())
        else:
            check_scores(got, want, bound, 0.98)


@pytest.mark.parametrize("i16,prefetch,block_n,tiles", [
    (False, 1, None, None), (True, 1, None, None), (True, 1, 64, 3), (True, 0, 64, 2), (True, 2, None, None),
])
@pytest.mark.parametrize("T,H,R,E,ratio,bs", shapes([(5, 32, 3, 200, 1, 64), (4, 4, 2, 300, 2, 16)],
                                                    [(64, 32, 64, 32768, 2, 64)]))
def test_scores_fp16_decode_variants(device, i16, prefetch, block_n, tiles, T, H, R, E, ratio, bs):
    """Mode 3's record reads (bytes / int16 words), pipelines and launch shapes give the
    reference's scores."""
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=E + tiles if tiles else E)
    q, w = make_queries(device, g, T, H, torch.bfloat16)
    want = ref.index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, max_visible=E + 5)
    got = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, max_visible=E + 5, mode=3,
                             i16=i16, prefetch=prefetch, block_n=block_n, tiles=tiles)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    bound = score_bound(q, w, cache, bt, req, vis, ratio, bs, E + 5)
    assert bool(((got[fin] - want[fin]).abs() <= 1e-5 * bound[fin] + 1e-30).all())


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run under Triton's interpreter")
@pytest.mark.parametrize("stages,tiles", [(2, 1), (3, 3), (4, None), (6, 2)])
@pytest.mark.parametrize("T,H,R,E,ratio,bs", [(5, 32, 3, 200, 1, 64), (4, 4, 2, 300, 2, 16),
                                              (3, 64, 2, 1000, 1, 512), (64, 32, 64, 32768, 2, 64)])
def test_scores_gluon_pipelines(device, stages, tiles, T, H, R, E, ratio, bs):
    """The Gluon kernel's ring depths and program sizes (pages of 8 .. 512 records): every key's
    score is one tile's arithmetic, so they give the default launch's scores bit for bit, and
    those are within mode 5's bound of the reference."""
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=E + stages)
    q, w = make_queries(device, g, T, H, torch.bfloat16)
    kw = dict(max_visible=E + 5)
    want = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, mode=5, **kw)
    out = poison_(torch.empty(T, E + 5, dtype=torch.float32, device=device))
    got = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, mode=5, stages=stages,
                             tiles=tiles, out=out, **kw)
    assert torch.equal(got, want)
    ref_scores = ref.index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, **kw)
    fin = torch.isfinite(ref_scores)
    assert torch.equal(fin, torch.isfinite(got))
    bound = abs_bound(q, w, cache, bt, req, vis, ratio, bs, E + 5)
    assert bool(((got[fin] - ref_scores[fin]).abs() <= 2.0**-12 * bound[fin] + 1e-30).all())


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run under Triton's interpreter")
@pytest.mark.parametrize("T,H,R,E,ratio,bs,scales", [
    (5, 32, 3, 200, 1, 64, (122, 131)), (4, 4, 2, 300, 2, 16, (122, 131)), (3, 64, 2, 1000, 1, 512, (122, 131)),
    (64, 32, 64, 32768, 2, 64, (122, 131)), (64, 32, 16, 20000, 2, 64, (1, 200)),
])
def test_scores_gluon_fp8(device, T, H, R, E, ratio, bs, scales):
    """Mode 5 (e4m3 operands, fp8 wgmma) against mode 3 (the same exact products, fp16 wgmma):
    fp32 scores within ``2^-12 A`` (the fp8 wgmma's short running sums; the wide-spread case
    also rounds blocks more than 14 binades below a key's largest), bf16 scores mostly
    identical, and the top-512 selections agree."""
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=E + 5, scales=scales)
    q, w = make_queries(device, g, T, H, torch.bfloat16)
    kw = dict(max_visible=E + 5)
    bound = abs_bound(q, w, cache, bt, req, vis, ratio, bs, E + 5)
    want = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, mode=3, **kw)
    out = poison_(torch.empty(T, E + 5, dtype=torch.float32, device=device))
    got = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, mode=5, out=out, **kw)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and not torch.isnan(got).any()
    excess = ((got[fin] - want[fin]).abs() / (bound[fin] + 1e-30)).max().item() if fin.any() else 0.0
    assert excess <= 2.0**-12, f"max |fp8 - fp16| / A = {excess:.3g}"
    assert excess > 0, "mode 5 gave mode 3's scores exactly: is the fp8 path running?"
    want16 = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.bfloat16, mode=3, **kw)
    got16 = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.bfloat16, mode=5, **kw)
    same = (got16[fin] == want16[fin]).float().mean().item() if fin.any() else 1.0
    assert same >= 0.97, f"only {same:.4f} of the bf16 scores identical"
    k = min(512, E)
    agree = _overlap(ref.topk_indices(got16.cpu(), k, vis.cpu()), ref.topk_indices(want16.cpu(), k, vis.cpu()))
    assert agree >= 0.995, f"top-{k} agreement {agree:.4f}"


def test_scores_odd_block_stride(device):
    """An odd page stride cannot be read as int16 words: mode 3 reads bytes (and says so if forced)."""
    g = torch.Generator().manual_seed(5)
    cache, bt = make_cache(device, g, 2, 200, 2, 16, pad=49)
    req, vis = torch.tensor([0, 1], device=device), torch.tensor([200, 77], device=device)
    q, w = make_queries(device, g, 2, 4, torch.bfloat16)
    want = ref.index_scores_paged(q, w, cache, bt, req, vis, 2, 16, torch.float32)
    got = index_scores_paged(q, w, cache, bt, req, vis, 2, 16, torch.float32)
    bound = score_bound(q, w, cache, bt, req, vis, 2, 16)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert bool(((got[fin] - want[fin]).abs() <= 1e-5 * bound[fin] + 1e-30).all())
    with pytest.raises(ValueError, match="even base address"):
        index_scores_paged(q, w, cache, bt, req, vis, 2, 16, i16=True)


def test_scores_default_sizes_and_short_rows(device):
    """No max_visible (host max), tokens with nothing visible, tuning knobs."""
    g, cache, bt, req, vis = _case(device, 6, 4, 3, 90, 2, 16, seed=3)
    q, w = make_queries(device, g, 6, 4, torch.bfloat16)
    want = ref.index_scores_paged(q, w, cache, bt, req, vis, 2, 16)
    mode = default_mode(q, cache, 8)  # 5 on sm90 (the knobs below are the Triton kernel's), else 3
    bound = _bound(mode, q, w, cache, bt, req, vis, 2, 16)
    rel, frac = _tols(mode)
    for block_n, tiles, nw, pf in [(None, None, None, None), (64, 1, 4, 1), (128, 2, 8, 2), (64, 3, 4, 0)]:
        got = index_scores_paged(q, w, cache, bt, req, vis, 2, 16, block_n=block_n, tiles=tiles, num_warps=nw,
                                 prefetch=pf)
        assert got.shape == want.shape
        check_scores(got, want, bound, frac, rel)


@pytest.mark.parametrize("mode,prefetch,T,H,R,E,ratio,bs,nb", _variant_cases(
    [(3, 4, 2, 200, 2, 16, 5), (4, 4, 2, 64, 1, 16, 9)],
    [(64, 32, 64, 131072, 2, 64, 2048), (256, 32, 32, 16384, 1, 64, 2048)],
))
def test_sparse_scores_vs_reference(device, mode, prefetch, T, H, R, E, ratio, bs, nb):
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=nb)
    dtype = torch.float32 if mode == 2 else torch.bfloat16
    q, w = make_queries(device, g, T, H, dtype)
    n_blocks = -(-E // 8)
    cand = torch.full((T, nb), -1, dtype=torch.int32)
    for t in range(T):
        m = min(nb - 1, n_blocks)
        cand[t, :m] = torch.sort(torch.randperm(n_blocks, generator=g)[:m]).values
    cand = cand.to(device)
    out = poison_(torch.empty(T, nb * 8, dtype=torch.float32, device=device))
    got = index_scores_paged_sparse(q, w, cache, bt, req, vis, ratio, bs, cand, 8, mode=mode, prefetch=prefetch,
                                    out=out)
    want = ref.index_scores_paged_sparse(q, w, cache, bt, req, vis, ratio, bs, cand, 8)
    dense_bound = _bound(mode, q, w, cache, bt, req, vis, ratio, bs, n_blocks * 8)
    cols = torch.arange(nb * 8, device=device)
    entry = (cand.long()[:, cols // 8] * 8 + cols % 8).clamp_min(0)
    bound = dense_bound.gather(1, entry)
    rel, frac = _tols(mode)
    if dtype == torch.float32:
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got))
        assert bool(((got[fin] - want[fin]).abs() <= rel * bound[fin] + 1e-30).all())
    else:
        check_scores(got, want, bound, frac, rel)


# (ratio, block size, candidate block, candidate blocks per token): pages of 4 records and
# 4-entry blocks take the per-key copies; the rest the paired copies of one block's 8 entries
SPARSE_COPY_CASES = [(2, 8, 8, 40), (1, 16, 4, 64), (2, 16, 8, 40), (2, 16, 16, 24), (1, 64, 8, 300),
                     (2, 256, 32, 70)]


@pytest.mark.skipif(INTERPRET, reason="mode 5 is a Gluon kernel: no interpreter")
@pytest.mark.parametrize("ratio,bs,cb,nb", SPARSE_COPY_CASES)
def test_sparse_scores_equal_dense_scores(device, ratio, bs, cb, nb):
    """The candidate path scores every kept entry exactly as the dense path does (same bits):
    only which records are copied differs. Candidates come unsorted, with -1 between them and
    blocks past a token's visible entries."""
    T, H, R, E = 6, 32, 3, 2000
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=31 * cb + bs + ratio)
    q, w = make_queries(device, g, T, H, torch.bfloat16)
    n_blocks = -(-E // cb)
    cand = torch.full((T, nb), -1, dtype=torch.int32)
    for t in range(T):
        kept = torch.randperm(n_blocks, generator=g)[: min(nb - 3, n_blocks)]
        cand[t, : kept.numel()] = kept.to(torch.int32)
        cand[t] = cand[t, torch.randperm(nb, generator=g)]
    cand = cand.to(device)
    dense = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, E, mode=5)
    got = index_scores_paged_sparse(q, w, cache, bt, req, vis, ratio, bs, cand, cb, torch.float32, mode=5,
                                    out=poison_(torch.empty(T, nb * cb, dtype=torch.float32, device=device)))
    cols = torch.arange(nb * cb, device=device)
    blk = cand.long()[:, cols // cb]
    entry = blk * cb + cols % cb
    valid = (blk >= 0) & (entry < vis.long()[:, None])
    want = torch.where(valid, dense.gather(1, entry.clamp(0, E - 1)), torch.full_like(got, NEG))
    assert valid.any(dim=1)[0] and not valid.any(dim=1)[1]
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} scores differ"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    hit = tot = 0
    for x, y in zip(a.cpu().tolist(), b.cpu().tolist()):
        sx, sy = {i for i in x if i >= 0}, {i for i in y if i >= 0}
        hit += len(sx & sy)
        tot += max(len(sx), len(sy))
    return hit / tot if tot else 1.0


@pytest.mark.parametrize("T,H,R,E,ratio,bs,k,kb", shapes(
    [(4, 4, 2, 300, 2, 16, 8, 6), (3, 4, 3, 150, 1, 16, 20, 4)],
    [(64, 32, 64, 131072, 2, 64, 512, 2048), (256, 32, 256, 8192, 1, 64, 512, 2048),
     (32, 32, 4, 40000, 2, 64, 512, 2048)],
))
def test_indexer_topk_end_to_end(device, T, H, R, E, ratio, bs, k, kb):
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=k + kb)
    q, w = make_queries(device, g, T, H, torch.bfloat16)
    kw = dict(ratio=ratio, block_size=bs, topk=k, candidate_topk_blocks=kb)
    idx, kept = indexer_topk(q, w, cache, bt, req, vis, candidate_source=True, **kw)
    scores = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs)
    # exact given the kernel's own scores
    assert torch.equal(idx.cpu().long(), ref.topk_indices(scores.cpu(), k, vis.cpu()))
    assert torch.equal(kept.cpu().long(), ref.candidate_blocks(scores.cpu(), vis.cpu(), 8, kb))
    # close to the full reference pipeline
    ref_idx, ref_kept = ref.indexer_topk(q, w, cache, bt, req, vis, candidate_source=True, **kw)
    assert _overlap(idx, ref_idx) >= 0.95
    assert _overlap(kept, ref_kept) >= 0.95
    # reindex layer: sparse scores over the kept blocks, exact vs select_topk on them
    idx2, none = indexer_topk(q, w, cache, bt, req, vis, candidates=kept, **kw)
    assert none is None
    compact = index_scores_paged_sparse(q, w, cache, bt, req, vis, ratio, bs, kept, 8)
    n = scores.shape[1]
    scattered = torch.full((T, n + 8), NEG, device=device)
    cols = torch.arange(compact.shape[1], device=device)
    entry = kept.long()[:, cols // 8] * 8 + cols % 8
    entry = torch.where((entry >= 0) & (entry < n), entry, torch.full_like(entry, n))
    scattered.scatter_(1, entry, compact)
    want2 = ref.topk_indices(scattered[:, :n].cpu(), k)
    assert torch.equal(idx2.cpu().long(), want2)
    # and it is the candidate-masked selection of the dense scores (same per-key arithmetic)
    mask = ref.candidate_mask_from_blocks(kept.cpu(), vis.cpu(), n, 8)
    masked = ref.topk_indices(scores.cpu().masked_fill(~mask, NEG), k)
    assert _overlap(idx2, masked) >= 0.99


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run under Triton's interpreter")
def test_scores_gluon_timeline(device):
    """The timeline build (``benchmarks/gpu/indexer.py --timeline``) scores exactly as the plain
    kernel and stamps every program: start <= first landed tile <= end, on a real SM."""
    import deepinfer_vllm.ops.triton.indexer as ix

    T, H, R, E, ratio, bs = 6, 32, 3, 5000, 2, 64
    g, cache, bt, req, vis = _case(device, T, H, R, E, ratio, bs, seed=91)
    vis[1] = E  # every token has live tiles: every program reaches its first tile
    q, w = make_queries(device, g, T, H, torch.bfloat16)
    want = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, max_visible=E, mode=5, tiles=8)
    stamps = torch.zeros(64, 4, dtype=torch.int64, device=device)
    plain = ix.gluon_index_scores
    ix.gluon_index_scores = lambda *a, **k: plain(*a, **{**k, "timeline": stamps})
    try:
        got = index_scores_paged(q, w, cache, bt, req, vis, ratio, bs, torch.float32, max_visible=E, mode=5, tiles=8)
    finally:
        ix.gluon_index_scores = plain
    assert torch.equal(got, want)
    programs = T * -(-E // (8 * 64))
    st = stamps[:programs].cpu()
    assert bool((stamps[programs:] == 0).all())
    live = st[:, 1] != 0  # programs with a visible key stamp their first tile
    assert bool((st[:, 0] > 0).all() and (st[:, 2] >= st[:, 0]).all())
    assert bool((st[live, 1] >= st[live, 0]).all() and (st[live, 2] >= st[live, 1]).all())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert bool(((st[:, 3] >= 0) & (st[:, 3] < sms)).all())
