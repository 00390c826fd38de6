"""Exact, tie-stable top-k per row (radix select) and the candidate-block stage.

Semantics are ``ops.indexer.select_topk``: the ``k`` largest selectable scores of a row (not -inf, not
NaN; +inf counts; ``-0.0`` ties with ``+0.0``), ties to the LOWER index, indices returned ASCENDING and
then ``-1`` fill. ``torch.topk`` is neither tie-stable nor index-ordered, so it is only a speed baseline.
Scores become order-preserving uint32 keys (``0`` for anything not selectable or ``j >= lengths[t]``);
the radix rule finds the exact k-th largest key with ``DBITS``-bit histogram passes over only the bits
the selectable keys differ in and returns ``(thr, need)``: the k largest are every key ``> thr`` plus
the first ``need`` keys ``== thr``, collected in index order with a prefix sum.
* "reg" (default whenever it fits, ``REG_MAX`` keys per register tile): one program per row keeps its
  keys in registers for every pass (arithmetic, not a memory round trip per chunk). Longer rows are
  first reduced to ``S1``-entry block maxima (``_bmax_kernel``); the top-k blocks by maximum contain the
  answer, so their ``<= k * S1`` entries are gathered and selected again.
* "stream" (any size; the previous default): one program per row streams the row in chunks for every
  pass; rows with ``N >= 16 k`` are first reduced through block maxima. Design notes: benchmarks/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args

__all__ = [
    "topk_indices", "block_scores", "candidate_blocks", "choose_block_reduction", "choose_reg_reduction",
]

FLT_MAX = tl.constexpr(3.4028234663852886e38)


def _default_dbits() -> int:
    """Radix digit width. Up to Triton 3.6 ``tl.histogram`` counts with one warp ballot per bit
    plus ~3 ops per bin a lane owns (bins / 32), so 5-bit digits (one bin per lane) are cheapest:
    on an H200 they beat 4, 6, 7 and 8 bits at 34 of 35 top-k shapes, by 4-15 % over 6 bits
    (``benchmarks/HISTORY.md``, run 12). Later versions count with one shared-memory atomic per
    element, and 8-bit digits save a pass."""
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return 5
    return 5 if (major, minor) <= (3, 6) else 8


DEFAULT_DBITS = _default_dbits()


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _and(a, b):
    return a & b


@triton.jit
def _score_keys(x, valid):
    """fp32 -> order-preserving uint32 keys; 0 = not selectable (-inf, NaN, masked)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)  # -0.0 ties with +0.0
    ok = valid & ((b & 0x7FFFFFFF) <= 0x7F800000) & (b != -8388608)  # not NaN, not -inf
    u = tl.where(b < 0, ~b, b | -2147483648)
    u = tl.where(ok, u, 0)
    return u.to(tl.uint32, bitcast=True)


@triton.jit
def _load_keys(src, i, n, FULL: tl.constexpr, FROM_SCORES: tl.constexpr):
    """Keys of ``src[i]`` for ``i < n``: fp32 scores (converted) or stored int32 keys.

    ``FULL`` (the whole chunk is in range) drops the mask so that the load vectorises."""
    m = i < n
    if FROM_SCORES:
        if FULL:
            x = tl.load(src + i)
        else:
            x = tl.load(src + i, mask=m, other=0.0)
        return _score_keys(x, m)
    else:
        if FULL:
            k = tl.load(src + i)
        else:
            k = tl.load(src + i, mask=m, other=0)
        return tl.where(m, k, 0).to(tl.uint32, bitcast=True)


@triton.jit
def _bit_length(x):
    """Significant bits of a uint32 scalar (0 for 0)."""
    n = tl.full([], 0, tl.int32)
    big = (x >> 16) != 0
    n += tl.where(big, 16, 0)
    x = tl.where(big, x >> 16, x)
    big = (x >> 8) != 0
    n += tl.where(big, 8, 0)
    x = tl.where(big, x >> 8, x)
    big = (x >> 4) != 0
    n += tl.where(big, 4, 0)
    x = tl.where(big, x >> 4, x)
    big = (x >> 2) != 0
    n += tl.where(big, 2, 0)
    x = tl.where(big, x >> 2, x)
    big = (x >> 1) != 0
    n += tl.where(big, 1, 0)
    x = tl.where(big, x >> 1, x)
    return n + (x != 0).to(tl.int32)


# Every pass below streams ``[0, n)`` as unmasked full chunks (vector loads, pipelinable) and
# then one masked tail chunk; ``*_chunk`` helpers hold the per-chunk work of each pass.


@triton.jit
def _stats_chunk(src, start, n, nsel, kor, kand, FROM_SCORES: tl.constexpr, BLOCK: tl.constexpr,
                 FULL: tl.constexpr):
    key = _load_keys(src, start + tl.arange(0, BLOCK), n, FULL, FROM_SCORES)
    sel = key != 0
    nsel += tl.sum(sel.to(tl.int32), 0)
    kor = kor | tl.reduce(tl.where(sel, key, tl.full([BLOCK], 0, tl.uint32)), 0, _or)
    kand = kand & tl.reduce(tl.where(sel, key, tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)), 0, _and)
    return nsel, kor, kand


@triton.jit
def _hist_chunk(src, start, n, fixed, pref, shu, hist, nex, FROM_SCORES: tl.constexpr, BLOCK: tl.constexpr,
                NB: tl.constexpr, FULL: tl.constexpr):
    key = _load_keys(src, start + tl.arange(0, BLOCK), n, FULL, FROM_SCORES)
    inplay = (key != 0) & ((key & fixed) == pref)
    d = ((key >> shu) & (NB - 1)).to(tl.int32)
    d = tl.where(inplay, d, 0)
    hist += tl.histogram(d, NB)
    nex += tl.sum(tl.where(inplay, 0, 1), 0)
    return hist, nex


@triton.jit
def _radix_rule(src, n, k, FROM_SCORES: tl.constexpr, BLOCK: tl.constexpr, DBITS: tl.constexpr):
    """``(thr, need)``: the ``k`` largest keys of ``src[:n]`` are the keys ``> thr`` plus the first
    ``need`` keys ``== thr`` in index order (``thr = 0, need = 0`` when at most ``k`` are selectable)."""
    NB: tl.constexpr = 1 << DBITS
    NPASS: tl.constexpr = (32 + DBITS - 1) // DBITS
    n_full = n // BLOCK * BLOCK
    nsel = tl.full([], 0, tl.int32)
    kor = tl.full([], 0, tl.uint32)
    kand = tl.full([], 0xFFFFFFFF, tl.uint32)
    for start in range(0, n_full, BLOCK):
        nsel, kor, kand = _stats_chunk(src, start, n, nsel, kor, kand, FROM_SCORES, BLOCK, True)
    if n_full < n:
        nsel, kor, kand = _stats_chunk(src, n_full, n, nsel, kor, kand, FROM_SCORES, BLOCK, False)
    varying = kor ^ kand  # bits on which the selectable keys differ
    all_equal = (nsel > k) & (varying == 0)
    thr = tl.where(all_equal, kand, tl.full([], 0, tl.uint32))
    need = tl.where(all_equal, k, 0)
    active = (nsel > k) & (varying != 0)
    hi = tl.maximum(_bit_length(varying) - 1, 0)
    lo = tl.maximum(_bit_length(varying & (~varying + 1)) - 1, 0)
    one_u = tl.full([], 1, tl.uint32)
    fixed = ~(((one_u << hi.to(tl.uint32)) << 1) - 1)  # bits above hi: equal in every key
    pref = kand & fixed
    lowmask = (one_u << lo.to(tl.uint32)) - 1
    r = need * 0 + k
    top = hi
    bins = tl.arange(0, NB)
    digit_mask = tl.full([], NB - 1, tl.uint32)
    for _p in range(NPASS):
        if active:
            shift = tl.maximum(top + 1 - DBITS, 0)
            shu = shift.to(tl.uint32)
            hist = tl.zeros([NB], dtype=tl.int32)
            nex = tl.full([], 0, tl.int32)
            for start in range(0, n_full, BLOCK):
                hist, nex = _hist_chunk(src, start, n, fixed, pref, shu, hist, nex, FROM_SCORES, BLOCK, NB,
                                        True)
            if n_full < n:
                hist, nex = _hist_chunk(src, n_full, n, fixed, pref, shu, hist, nex, FROM_SCORES, BLOCK, NB,
                                        False)
            hist = tl.where(bins == 0, hist - nex, hist)  # out-of-play entries were counted in bin 0
            c_ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # in-play keys in bins >= b
            b = tl.max(tl.where(c_ge >= r, bins, 0), 0)
            inbin = tl.sum(tl.where(bins == b, hist, 0), 0)
            above = tl.sum(tl.where(bins > b, hist, 0), 0)
            r = r - above
            pref = pref | (b.to(tl.uint32) << shu)
            fixed = fixed | (digit_mask << shu)
            top = shift - 1
            filled = inbin == r  # the whole bin is taken: every key >= its lower edge
            exact = top < lo  # every varying bit decided: the k-th key itself
            thr = tl.where(filled, tl.maximum(pref, one_u) - 1, tl.where(exact, pref | (kand & lowmask), thr))
            need = tl.where(filled, 0, tl.where(exact, r, need))
            active = active & (filled == 0) & (exact == 0)
    return thr, need


@triton.jit
def _collect_chunk(key_src, idx_src, start, n, thr, need, orow, mrow, pos, eqc,
                   FROM_SCORES: tl.constexpr, MAP_B: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    i = start + tl.arange(0, BLOCK)
    key = _load_keys(key_src, i, n, FULL, FROM_SCORES)
    eq = (key == thr) & (key != 0)
    gt = key > thr
    ne = tl.sum(eq.to(tl.int32), 0)
    ng = tl.sum(gt.to(tl.int32), 0)
    if ne + ng > 0:
        e = eq.to(tl.int32)
        rank = eqc + tl.cumsum(e, 0) - e
        sel = gt | (eq & (rank < need))
        s = sel.to(tl.int32)
        p = pos + tl.cumsum(s, 0) - s
        if FROM_SCORES:
            idx = i.to(tl.int64)
        else:
            idx = tl.load(idx_src + i, mask=sel, other=0).to(tl.int64)
        if MAP_B > 0:
            blk = tl.load(mrow + idx // MAP_B, mask=sel, other=0).to(tl.int64)
            idx = blk * MAP_B + idx % MAP_B
        tl.store(orow + p, idx.to(orow.dtype.element_ty), mask=sel)
        pos += tl.sum(s, 0)
    return pos, eqc + ne


@triton.jit
def _collect(
    key_src, idx_src, n, thr, need, orow, mrow,
    FROM_SCORES: tl.constexpr, MAP_B: tl.constexpr, BLOCK: tl.constexpr,
):
    """Write, in index order, the indices chosen by ``(thr, need)`` to ``orow[0:count]``."""
    n_full = n // BLOCK * BLOCK
    pos = tl.full([], 0, tl.int32)
    eqc = tl.full([], 0, tl.int32)
    for start in range(0, n_full, BLOCK):
        pos, eqc = _collect_chunk(key_src, idx_src, start, n, thr, need, orow, mrow, pos, eqc,
                                  FROM_SCORES, MAP_B, BLOCK, True)
    if n_full < n:
        pos, eqc = _collect_chunk(key_src, idx_src, n_full, n, thr, need, orow, mrow, pos, eqc,
                                  FROM_SCORES, MAP_B, BLOCK, False)
    return pos


@triton.jit
def _bmax_chunk(src, start, n, m1, n1, S1: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    R: tl.constexpr = BLOCK // S1
    rr = tl.arange(0, R)
    i = start + rr[:, None] * S1 + tl.arange(0, S1)[None, :]
    mx = tl.max(_load_keys(src, i, n, FULL, True), 1)
    b = start // S1 + rr
    tl.store(m1 + b, mx.to(tl.int32, bitcast=True), mask=b < n1)


@triton.jit
def _block_max_keys(src, n, m1, n1, S1: tl.constexpr, BLOCK: tl.constexpr):
    """``m1[b] = max key of src[b*S1 : (b+1)*S1]`` (0 when none is selectable)."""
    n_full = n // BLOCK * BLOCK
    for start in range(0, n_full, BLOCK):
        _bmax_chunk(src, start, n, m1, n1, S1, BLOCK, True)
    if n_full < n:
        _bmax_chunk(src, n_full, n, m1, n1, S1, BLOCK, False)


@triton.jit
def _filter_chunk(src, start, n, tau, gti, gtk, cnt, BLOCK: tl.constexpr, FULL: tl.constexpr):
    i = start + tl.arange(0, BLOCK)
    key = _load_keys(src, i, n, FULL, True)
    gt = key > tau
    g = gt.to(tl.int32)
    ng = tl.sum(g, 0)
    if ng > 0:
        p = cnt + tl.cumsum(g, 0) - g
        tl.store(gti + p, i, mask=gt)
        tl.store(gtk + p, key.to(tl.int32, bitcast=True), mask=gt)
    return cnt + ng


@triton.jit
def _filter_above(src, n, tau, gti, gtk, BLOCK: tl.constexpr):
    """Entries with key ``> tau`` -> ``gti`` (index) / ``gtk`` (key), in index order; returns the count."""
    n_full = n // BLOCK * BLOCK
    cnt = tl.full([], 0, tl.int32)
    for start in range(0, n_full, BLOCK):
        cnt = _filter_chunk(src, start, n, tau, gti, gtk, cnt, BLOCK, True)
    if n_full < n:
        cnt = _filter_chunk(src, n_full, n, tau, gti, gtk, cnt, BLOCK, False)
    return cnt


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _topk_kernel(
    s_ptr, stride_s, len_ptr, n_cols, k,
    out_ptr, stride_o,
    m1_ptr, stride_m1, gti_ptr, gtk_ptr, stride_gt,
    map_ptr, stride_map,
    HAS_LEN: tl.constexpr, S1: tl.constexpr, BLOCK: tl.constexpr, BLOCK2: tl.constexpr,
    DBITS: tl.constexpr, MAP_B: tl.constexpr, FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * stride_s
    orow = out_ptr + row * stride_o
    mrow = map_ptr + row * stride_map
    n = n_cols + 0
    if HAS_LEN:
        n = tl.maximum(tl.minimum(tl.load(len_ptr + row).to(tl.int32), n_cols), 0)
    if S1 == 1:
        thr, need = _radix_rule(src, n, k, True, BLOCK2, DBITS)
        cnt = _collect(src, src, n, thr, need, orow, mrow, True, MAP_B, BLOCK2)
    else:
        m1 = m1_ptr + row * stride_m1
        n1 = (n + S1 - 1) // S1
        _block_max_keys(src, n, m1, n1, S1, BLOCK)
        tl.debug_barrier()  # m1 written by other threads of this program
        tau, _unused = _radix_rule(m1, n1, k, False, BLOCK2, DBITS)
        gti = gti_ptr + row * stride_gt
        gtk = gtk_ptr + row * stride_gt
        ngt = _filter_above(src, n, tau, gti, gtk, BLOCK)
        tl.debug_barrier()
        if ngt >= k:
            thr, need = _radix_rule(gtk, ngt, k, False, BLOCK2, DBITS)
            cnt = _collect(gtk, gti, ngt, thr, need, orow, mrow, False, MAP_B, BLOCK2)
        else:  # the k-th score is tau itself: every key > tau, then the first ties
            cnt = _collect(src, src, n, tau, k - ngt, orow, mrow, True, MAP_B, BLOCK)
    offs = tl.arange(0, FILL)
    for start in range(0, k, FILL):
        p = start + offs
        tl.store(orow + p, tl.full([FILL], -1, orow.dtype.element_ty), mask=(p >= cnt) & (p < k))


@triton.jit
def _block_scores_kernel(
    s_ptr, stride_s, vis_ptr, n_cols, nb, out_ptr, stride_o,
    CB: tl.constexpr, BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    vis = tl.load(vis_ptr + row).to(tl.int32)
    lim = tl.minimum(vis, n_cols)
    b = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    j = b[:, None] * CB + tl.arange(0, CB)[None, :]
    x = tl.load(s_ptr + row * stride_s + j, mask=j < lim, other=float("-inf"))
    x = tl.where(x != x, float("-inf"), x)
    x = tl.minimum(x, FLT_MAX)
    m = tl.max(x, 1)
    newest = (vis - 1) // CB
    m = tl.where((b == newest) & (vis > 0), float("inf"), m)
    tl.store(out_ptr + row * stride_o + b, m, mask=b < nb)


# ----------------------------------------------------------------------------- register path
# The whole (reduced) row lives in registers: one load, every radix pass and the collection
# run on registers, so a program's time is arithmetic, not one memory round trip per chunk.


@triton.jit
def _rule_reg(key, k, NUMEL: tl.constexpr, DBITS: tl.constexpr):
    """``_radix_rule`` over a 1-D register tensor of ``NUMEL`` keys."""
    NB: tl.constexpr = 1 << DBITS
    NPASS: tl.constexpr = (32 + DBITS - 1) // DBITS
    sel = key != 0
    nsel = tl.sum(sel.to(tl.int32), 0)
    kor = tl.reduce(key, 0, _or)
    kand = tl.reduce(tl.where(sel, key, tl.full([NUMEL], 0xFFFFFFFF, tl.uint32)), 0, _and)
    varying = kor ^ kand
    all_equal = (nsel > k) & (varying == 0)
    thr = tl.where(all_equal, kand, tl.full([], 0, tl.uint32))
    need = tl.where(all_equal, k, 0)
    active = (nsel > k) & (varying != 0)
    hi = tl.maximum(_bit_length(varying) - 1, 0)
    lo = tl.maximum(_bit_length(varying & (~varying + 1)) - 1, 0)
    one_u = tl.full([], 1, tl.uint32)
    fixed = ~(((one_u << hi.to(tl.uint32)) << 1) - 1)
    pref = kand & fixed
    lowmask = (one_u << lo.to(tl.uint32)) - 1
    r = need * 0 + k
    top = hi
    inplay_n = nsel  # keys still in play (matching pref on the fixed bits)
    bins = tl.arange(0, NB)
    digit_mask = tl.full([], NB - 1, tl.uint32)
    for _p in range(NPASS):
        if active:
            shift = tl.maximum(top + 1 - DBITS, 0)
            shu = shift.to(tl.uint32)
            inplay = sel & ((key & fixed) == pref)
            d = tl.where(inplay, ((key >> shu) & (NB - 1)).to(tl.int32), 0)
            hist = tl.histogram(d, NB)
            hist = tl.where(bins == 0, hist - (NUMEL - inplay_n), hist)
            c_ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
            b = tl.max(tl.where(c_ge >= r, bins, 0), 0)
            inbin = tl.sum(tl.where(bins == b, hist, 0), 0)
            above = tl.sum(tl.where(bins > b, hist, 0), 0)
            r = r - above
            inplay_n = inbin
            pref = pref | (b.to(tl.uint32) << shu)
            fixed = fixed | (digit_mask << shu)
            top = shift - 1
            filled = inbin == r
            exact = top < lo
            thr = tl.where(filled, tl.maximum(pref, one_u) - 1, tl.where(exact, pref | (kand & lowmask), thr))
            need = tl.where(filled, 0, tl.where(exact, r, need))
            active = active & (filled == 0) & (exact == 0)
    return thr, need


@triton.jit
def _collect_reg(key, idx, thr, need, dst):
    """Write ``idx`` of the keys chosen by ``(thr, need)`` to ``dst[0:count]`` in tensor order
    (= index order); returns the count. One packed prefix sum: (> thr) + (== thr) << 16."""
    eq = (key == thr) & (key != 0)
    gt = key > thr
    v = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    cs = tl.cumsum(v, 0) - v
    g = cs & 0xFFFF
    e = cs >> 16
    sel = gt | (eq & (e < need))
    p = g + tl.minimum(e, need)
    tl.store(dst + p, idx.to(dst.dtype.element_ty), mask=sel)
    tot = tl.sum(v, 0)
    return (tot & 0xFFFF) + tl.minimum(tot >> 16, need)


@triton.jit
def _bmax_kernel(
    s_ptr, stride_s, len_ptr, n_cols, m1_ptr, stride_m1,
    HAS_LEN: tl.constexpr, S1: tl.constexpr, RB: tl.constexpr,
    PDL: tl.constexpr,
):
    """``m1[t, b]`` = key of the max of ``scores[t, b*S1 : (b+1)*S1]`` (0: none selectable)."""
    grid_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    n = n_cols + 0
    if HAS_LEN:
        n = tl.maximum(tl.minimum(tl.load(len_ptr + row).to(tl.int32), n_cols), 0)
    n1 = (n + S1 - 1) // S1
    b = tl.program_id(1) * RB + tl.arange(0, RB)
    j = b[:, None] * S1 + tl.arange(0, S1)[None, :]
    x = tl.load(s_ptr + row * stride_s + j, mask=j < n, other=float("-inf"))
    x = tl.where(x != x, float("-inf"), x)
    mk = _score_keys(tl.max(x, 1), b < n1)
    tl.store(m1_ptr + row * stride_m1 + b, mk.to(tl.int32, bitcast=True), mask=b < n1)


@triton.jit
def _reg_topk_kernel(
    s_ptr, stride_s, len_ptr, n_cols, k,
    out_ptr, stride_o,
    m1_ptr, stride_m1, ub_ptr, stride_ub,
    map_ptr, stride_map,
    HAS_LEN: tl.constexpr, S1: tl.constexpr, NA: tl.constexpr, NG: tl.constexpr,
    DBITS: tl.constexpr, MAP_B: tl.constexpr, FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program. ``S1 == 1``: the row (``<= NA`` entries) in registers. ``S1 > 1``:
    the ``k`` blocks of largest maximum (``_bmax_kernel``'s ``NA`` keys, ties to the lower
    block) hold the answer; their ``<= NG`` entries are gathered into registers."""
    grid_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * stride_s
    orow = out_ptr + row * stride_o
    mrow = map_ptr + row * stride_map
    n = n_cols + 0
    if HAS_LEN:
        n = tl.maximum(tl.minimum(tl.load(len_ptr + row).to(tl.int32), n_cols), 0)
    if S1 == 1:
        i = tl.arange(0, NA)
        key = _load_keys(src, i, n, False, True)
        thr, need = _rule_reg(key, k, NA, DBITS)
        cnt = _collect_reg(key, i, thr, need, orow)
    else:
        # Every chosen entry is >= tau (the k-th block max) and lies in one of the top-k blocks
        # (with ties among blocks of max == tau to the lower block: they hold the first ties).
        n1 = (n + S1 - 1) // S1
        b = tl.arange(0, NA)
        mk = tl.load(m1_ptr + row * stride_m1 + b, mask=b < n1, other=0).to(tl.uint32, bitcast=True)
        tau, need_b = _rule_reg(mk, k, NA, DBITS)
        ub = ub_ptr + row * stride_ub
        nub = _collect_reg(mk, b, tau, need_b, ub)
        tl.debug_barrier()  # ub written by other threads of this program
        c = tl.arange(0, NG)
        slot = c // S1
        blk = tl.load(ub + slot, mask=slot < nub, other=0)
        j = blk * S1 + c % S1
        valid = (slot < nub) & (j < n)
        x = tl.load(src + j, mask=valid, other=0.0)
        key = _score_keys(x, valid)
        key = tl.where(key >= tau, key, 0)  # below the k-th block max: never chosen
        thr, need = _rule_reg(key, k, NG, DBITS)
        cnt = _collect_reg(key, j, thr, need, orow)
    if MAP_B > 0:  # compact columns -> entries, in place (a short pass: the registers are free now)
        tl.debug_barrier()
    offs = tl.arange(0, FILL)
    for start in range(0, k, FILL):
        p = start + offs
        if MAP_B > 0:
            col = tl.load(orow + p, mask=p < cnt, other=0)
            # fresh names: Triton treats a name assigned before the loop as loop-carried
            mapped = tl.load(mrow + col // MAP_B, mask=p < cnt, other=0).to(col.dtype)
            res = tl.where(p < cnt, mapped * MAP_B + col % MAP_B, -1)
            tl.store(orow + p, res.to(orow.dtype.element_ty), mask=p < k)
        else:
            tl.store(orow + p, tl.full([FILL], -1, orow.dtype.element_ty), mask=(p >= cnt) & (p < k))


# ----------------------------------------------------------------------------- wrappers


def choose_block_reduction(n: int, k: int, max_s1: int = 32) -> int:
    """``S1``: the largest power of two <= ``n / (8 k)`` (capped), 1 = radix over the row itself."""
    s1 = 1
    while s1 * 2 <= max_s1 and s1 * 2 * 8 * k <= n:
        s1 *= 2
    return s1


def _check_rows(scores: torch.Tensor, name: str = "scores") -> None:
    if scores.dim() != 2:
        raise ValueError(f"{name} must be [T, N], got {tuple(scores.shape)}")
    if scores.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scores.dtype}")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (stride(1) == 1)")


def _check_vec(v: torch.Tensor, T: int, device: torch.device, name: str) -> None:
    if v.dim() != 1 or v.shape[0] != T:
        raise ValueError(f"{name} must be [{T}], got {tuple(v.shape)}")
    if v.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32/int64, got {v.dtype}")
    if v.device != device:
        raise ValueError(f"{name} is on {v.device}, scores on {device}")


REG_MAX = 16384  # largest register tile of the register path (16 warps x 32 keys)


def choose_reg_reduction(n: int, k: int, reg_max: int = REG_MAX, max_s1: int = 32) -> int | None:
    """``S1`` of the register path: the block size that keeps both register tiles (``ceil(n / S1)``
    block maxima, ``k * S1`` gathered entries) near 4096 entries. ``S1 = max(4096 / k, n / 4096)``
    rounded up to a power of two, at most ``max_s1`` unless the block maxima need more to fit,
    and ``k * S1 <= reg_max``; 1 where a row that fits whole would not be halved; None where
    nothing fits. On the H200 (benchmarks/HISTORY.md, run 11) this is the fastest block size, or
    within 2 % of it, at every benchmark shape (k = 512 over 8192-131072 entries, k = 2048 over
    16384-65536, the reindex layer's 16384), and up to 2.4x faster than the rule before (the
    smallest sum of the two tiles, which kept rows of <= 16384 entries whole)."""
    s1 = triton.next_power_of_2(max(1, 4096 // max(k, 1), triton.cdiv(n, 4096)))
    s1 = min(s1, max(max_s1, triton.next_power_of_2(triton.cdiv(n, reg_max))))
    while s1 > 1 and k * s1 > reg_max:
        s1 //= 2
    if s1 > 1 and 2 * k * s1 > n and n <= reg_max:
        s1 = 1
    if triton.cdiv(n, s1) > reg_max:
        return None
    return s1


def reg_fits(n: int, k: int, s1: int) -> bool:
    """Whether block size ``s1`` fits the register path for rows of ``n`` and top ``k``."""
    if s1 == 1:
        return n <= REG_MAX
    return triton.cdiv(n, s1) <= REG_MAX and k * s1 <= REG_MAX


def _reg_warps(numel: int) -> int:
    return 4 if numel <= 2048 else 8 if numel <= 8192 else 16


def topk_indices(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    index_map: torch.Tensor | None = None,
    map_block: int = 8,
    index_dtype: torch.dtype = torch.int32,
    *,
    method: str | None = None,
    s1: int | None = None,
    dbits: int | None = None,
    block: int = 2048,
    block2: int = 1024,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices of the ``k`` largest selectable scores per row -> ``[T, k]`` (int32 by default).

    Equals ``ops.paged_indexer.topk_indices`` (``select_topk`` with ``j >= lengths[t]``
    treated as ``-inf``; those entries are never read). With ``index_map`` (kept block ids
    ``[T, nb]``, ascending, -1 fill) compact columns ``c`` come back as entries
    ``index_map[t, c // map_block] * map_block + c % map_block``.

    ``method``: ``"reg"`` (default when it fits: the row, or its block maxima and the entries
    of its top-k blocks, in registers; ``s1`` = block size, default ``choose_reg_reduction``)
    or ``"stream"`` (chunked passes over memory, any size; ``s1`` default
    ``choose_block_reduction``, ``block`` / ``block2`` chunk sizes). ``dbits``: radix digit.
    """
    _check_rows(scores)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if index_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index_dtype must be int32 or int64, got {index_dtype}")
    T, N = scores.shape
    dev = scores.device
    if out is None:
        out = torch.empty(T, k, dtype=index_dtype, device=dev)
    elif out.shape != (T, k) or out.dtype != index_dtype or out.device != dev or (
        k > 1 and out.stride(1) != 1
    ):
        raise ValueError(f"out must be a row-contiguous {index_dtype} [{T}, {k}] on {dev}")
    if T == 0:
        return out
    if lengths is not None:
        _check_vec(lengths, T, dev, "lengths")
    if index_map is not None:
        if index_map.dim() != 2 or index_map.shape[0] != T or index_map.stride(1) != 1:
            raise ValueError(f"index_map must be a row-contiguous [T, nb], got {tuple(index_map.shape)}")
        if index_map.shape[1] * map_block < N:
            raise ValueError(f"index_map covers {index_map.shape[1] * map_block} columns < {N}")
        if map_block & (map_block - 1):
            raise ValueError(f"map_block must be a power of two, got {map_block}")
    if method not in (None, "reg", "stream"):
        raise ValueError(f"method must be 'reg' or 'stream', got {method!r}")
    if method is None and s1 is not None:
        raise ValueError("s1 belongs to a method: pass method='reg' or method='stream' with it")
    dbits = DEFAULT_DBITS if dbits is None else dbits
    if not 1 <= dbits <= 11:
        raise ValueError(f"dbits must be in [1, 11], got {dbits}")
    lens = lengths if lengths is not None else out
    mp = index_map if index_map is not None else out
    map_b = map_block if index_map is not None else 0
    fill = min(1024, triton.next_power_of_2(k))
    if method != "stream":
        rs1 = choose_reg_reduction(N, k) if s1 is None else s1
        if rs1 is not None and (rs1 & (rs1 - 1) or rs1 < 1):
            raise ValueError(f"s1 must be a power of two, got {rs1}")
        if rs1 is not None and rs1 > 1 and not reg_fits(N, k, rs1):
            if method == "reg":
                raise ValueError(f"s1={rs1} does not fit the register path (N={N}, k={k})")
            rs1 = None
        if rs1 is None and method == "reg":
            raise ValueError(f"no block size fits the register path (N={N}, k={k})")
        if rs1 is not None:
            _topk_reg(scores, k, lengths, lens, out, mp, map_b, rs1, dbits, num_warps, fill)
            return out
    s1 = choose_block_reduction(N, k) if s1 is None else s1
    if s1 & (s1 - 1) or s1 > block:
        raise ValueError(f"s1 must be a power of two <= block, got {s1}")
    if s1 > 1:
        n1 = triton.cdiv(N, s1)
        cap = max(1, min(N, k * s1))
        pad = lambda x: (x + 15) // 16 * 16  # 64-byte aligned rows: vector loads
        m1 = torch.empty(T, pad(n1), dtype=torch.int32, device=dev)
        gti = torch.empty(T, pad(cap), dtype=torch.int32, device=dev)
        gtk = torch.empty(T, pad(cap), dtype=torch.int32, device=dev)
    else:
        m1 = gti = gtk = torch.empty(1, 1, dtype=torch.int32, device=dev)
    _topk_kernel[(T,)](
        scores, scores.stride(0), lens, N, k,
        out, out.stride(0),
        m1, m1.stride(0), gti, gtk, gti.stride(0),
        mp, mp.stride(0),
        HAS_LEN=lengths is not None, S1=s1, BLOCK=block, BLOCK2=block2,
        DBITS=dbits, MAP_B=map_b, FILL=fill,
        num_warps=8 if num_warps is None else num_warps,
        **pdl_args(scores.device),
    )
    return out


def _topk_reg(scores, k, lengths, lens, out, mp, map_b, s1, dbits, num_warps, fill) -> None:
    T, N = scores.shape
    dev = scores.device
    if s1 == 1:
        na, ng = max(16, triton.next_power_of_2(N)), 16
        m1 = ub = out
    else:
        n1 = triton.cdiv(N, s1)
        na, ng = max(16, triton.next_power_of_2(n1)), triton.next_power_of_2(k * s1)
        m1 = torch.empty(T, (n1 + 15) // 16 * 16, dtype=torch.int32, device=dev)
        ub = torch.empty(T, (k + 15) // 16 * 16, dtype=torch.int32, device=dev)
        rb = max(1, min(4096 // s1, triton.next_power_of_2(n1)))
        _bmax_kernel[(T, triton.cdiv(n1, rb))](
            scores, scores.stride(0), lens, N, m1, m1.stride(0),
            HAS_LEN=lengths is not None, S1=s1, RB=rb, num_warps=4,
            **pdl_args(scores.device),
        )
    _reg_topk_kernel[(T,)](
        scores, scores.stride(0), lens, N, k,
        out, out.stride(0),
        m1, m1.stride(0), ub, ub.stride(0),
        mp, mp.stride(0),
        HAS_LEN=lengths is not None, S1=s1, NA=na, NG=ng,
        DBITS=dbits, MAP_B=map_b, FILL=fill,
        num_warps=_reg_warps(max(na, ng)) if num_warps is None else num_warps,
        **pdl_args(scores.device),
    )


def block_scores(scores: torch.Tensor, visible: torch.Tensor, block_size: int = 8) -> torch.Tensor:
    """Candidate block scores fp32 ``[T, ceil(N / block_size)]``: max over visible entries
    (NaN -> -inf, +inf capped at the largest finite fp32), newest visible block = +inf."""
    _check_rows(scores)
    T, N = scores.shape
    _check_vec(visible, T, scores.device, "visible")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    nb = triton.cdiv(N, block_size)
    out = torch.empty(T, nb, dtype=torch.float32, device=scores.device)
    if T == 0 or nb == 0:
        return out
    block_b = min(512, triton.next_power_of_2(nb))
    _block_scores_kernel[(T, triton.cdiv(nb, block_b))](
        scores, scores.stride(0), visible, N, nb, out, out.stride(0),
        CB=block_size, BLOCK_B=block_b, num_warps=4,
        **pdl_args(scores.device),
    )
    return out


def candidate_blocks(
    scores: torch.Tensor,
    visible: torch.Tensor,
    block_size: int = 8,
    topk_blocks: int = 2048,
    index_dtype: torch.dtype = torch.int32,
    **topk_options,
) -> torch.Tensor:
    """Kept candidate block ids ``[T, topk_blocks]`` ascending, -1 fill (``candidate_block_mask``'s set).
    ``topk_options``: ``topk_indices``'s tuning knobs (method, s1, dbits, num_warps)."""
    return topk_indices(block_scores(scores, visible, block_size), topk_blocks, index_dtype=index_dtype,
                        **topk_options)
